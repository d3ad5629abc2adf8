"""The peers' ragged-batch determinism checks, in kvfid's words, on the triton stack (padding-aware
kernel + batch-invariant mode): greedy tokens and their log-probabilities of a prompt are the same
alone and in left-padded batches of other prompts. The models are the presets at 2 layers and one
KV head (`protocol_fixtures.small`): the kernel runs in the interpreter, whose cost grows with
layers x KV heads, and the claim is about the padding, not the depth.

* needle: one prompt at every batch position among different prompts (vLLM);
* bs1 vs bsN: every prompt of a batch of different lengths against itself alone (vLLM);
* prefix sharing: prompts that share a long prefix and differ in their tails (SGLang).

Stock attention's behaviour here depends on the CPU (Intel AMX, AMD AVX-512 or AVX2 differ), so no
test assumes it fails. The negative control is the kernel's padding-variant twin (tiles aligned to
padded positions, `align_own=False`), which the same check must catch: one prompt of each batch is
LONG tokens, so a short prompt's padding puts its keys across a key-tile edge.
"""

from __future__ import annotations

import functools
import random

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvfid.protocol import cobatch
from kvfid.stacks.stack import Stack
from kvfid.protocol.decode import Runner, new_cache
from kvfid.environment.invariance import bits_equal
from kvfid.kernels import hf
from protocol_fixtures import small

STEPS = 3  # greedy tokens per prompt
LONG = 140  # one prompt per batch: wider than a 128-key tile
TWIN = "kvfid_triton_padded_tiles"


def prompts(lengths, seed=0, vocab=200):
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, vocab) for _ in range(n)) for n in lengths]


def generate(module, rows) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy STEPS tokens for every row of a left-padded batch, all rows decoding together;
    per row (tokens, log-probabilities of the chosen tokens [STEPS], fp32)."""
    batch = cobatch.CoBatch(tuple(rows), 0, ())
    runner = Runner(module)
    logits, mask, cached = cobatch.prefill(runner, new_cache(module), batch)  # [N, V], [N, W]
    positions = torch.tensor([[len(r) - 1] for r in rows])  # [N, 1]
    tokens, logprobs = [], []
    for step in range(STEPS):
        logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
        chosen = logp.argmax(-1, keepdim=True)  # [N, 1]
        tokens.append(chosen[:, 0].tolist())
        logprobs.append(logp.gather(-1, chosen)[:, 0])
        if step < STEPS - 1:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions + 1
            logits, cached = runner.forward(chosen.cpu(), cached, attention_mask=mask,
                                            position_ids=positions)
    return [([t[i] for t in tokens], torch.stack([lp[i] for lp in logprobs])) for i in range(len(rows))]


def differences(module, batch_rows, checked, alone=None) -> list[str]:
    """Rows (indices in `checked`) whose tokens or log-prob bits differ alone vs in the batch;
    `alone` (a dict by prompt) keeps the runs alone for the next call."""
    together = generate(module, batch_rows)
    alone = {} if alone is None else alone
    out = []
    for i in checked:
        if batch_rows[i] not in alone:
            alone[batch_rows[i]] = generate(module, [batch_rows[i]])[0]
        alone_tokens, alone_logp = alone[batch_rows[i]]
        tokens, logp = together[i]
        if tokens != alone_tokens or not bits_equal(logp, alone_logp):
            out.append(f"row {i} (length {len(batch_rows[i])}): tokens {tokens} vs {alone_tokens}, "
                       f"max |logp diff| {(logp - alone_logp).abs().max().item()!r}")
    return out


@functools.lru_cache(maxsize=None)
def register_twin() -> str:
    AttentionInterface.register(TWIN, functools.partial(hf.kvfid_triton_attention,
                                                     kernel_options={"align_own": False}))
    AttentionMaskInterface.register(TWIN, hf.kvfid_triton_mask)
    return TWIN


def needle_differences(module, n=3) -> list[str]:
    """The needle at every position of a batch of n with different prompts (one of them LONG; the
    needle's padding, LONG - 20, puts its keys across the 128-key tile edge)."""
    needle, *others = prompts([20, LONG, 7][:n], seed=1)
    out, alone = [], {}
    for position in range(n):
        rows = others[:position] + [needle] + others[position:]
        out += [f"position {position}: {d}" for d in differences(module, rows, [position], alone)]
    return out


def test_needle_at_every_batch_position():
    with Stack("triton", "fp32", True, threads=1).activate(small("tiny-llama")) as module:
        failures = needle_differences(module)
    assert not failures, "; ".join(failures)


def test_bs1_vs_bsn_with_different_lengths():
    # Padded to LONG: 5 keeps all its keys past the 128-key tile edge; 17 and 64 straddle it
    # (17 across one 16-query tile edge of its own, 64 across three).
    rows = prompts([LONG, 5, 17, 64], seed=2)
    with Stack("triton", "fp32", True, threads=1).activate(small("tiny-qwen2")) as module:
        failures = differences(module, rows, range(len(rows)))
    assert not failures, "; ".join(failures)


def test_prefix_sharing_prompts():
    shared = prompts([24], seed=3)[0]
    tails = prompts([1, 6, 11, LONG - 24], seed=4)
    rows = [shared + tail for tail in tails]
    with Stack("triton", "bf16", True, threads=1).activate(small("tiny-mistral")) as module:
        failures = differences(module, rows, range(len(rows) - 1))
    assert not failures, "; ".join(failures)


def test_control_the_padding_variant_twin_fails_the_needle_check():
    with Stack("triton", "fp32", True, threads=1).activate(small("tiny-llama")) as module:
        module.set_attn_implementation(register_twin())  # the stack restores its own on exit
        failures = needle_differences(module, n=2)
    assert failures, "the padding-variant twin passed the needle check"
