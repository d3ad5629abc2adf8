"""Visibility masks through transformers: a packed stage program (branches in one sequence under
the block mask, parallel position ids) given as a 4-D `attention_mask`, served by sdpa, eager and
kvfid's kernels; under the batch-invariant mode the kernels' caches are bit-exact between the
packed prefill and step-by-step decoding, and a branch's keys are those it gets as a row of its
own (the batched layout composes into the packed one); the variant twin differs; refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise_equal, bits_equal, cache_keyword
from test_kernel_hf import layer_kv, narrow_model
from transformers import DynamicCache

from kvfid.stacks import twins
from kvfid.kernels import hf, hf_native, triton_runs_on
from kvfid.kernels.attention.reference import segment_mask
from kvfid.kernels.invariant.mode import set_batch_invariant_mode

PROMPT, BRANCHES, MERGE = 6, (5, 4), 4  # 19 tokens: crosses one 16-query tile edge
KERNELS = {"triton": hf.register, "native": hf_native.register}


def packed_program():
    """Token ids [1, T], visibility [1, T, T] and parallel position ids [1, T] (each branch
    continues the prompt; the merge continues the longest branch)."""
    lens = [PROMPT, *BRANCHES, MERGE]
    seg = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])[None]
    sees = torch.eye(len(lens), dtype=torch.bool)
    sees[:, 0] = sees[-1] = True
    positions = torch.cat([torch.arange(PROMPT)] + [torch.arange(PROMPT, PROMPT + n) for n in BRANCHES]
                          + [torch.arange(MERGE) + PROMPT + max(BRANCHES)])[None]
    ids = torch.randint(0, 256, (1, seg.shape[1]), generator=torch.Generator().manual_seed(0))
    return ids, segment_mask(seg, sees), positions


def additive(visibility: torch.Tensor) -> torch.Tensor:
    """[B, 1, q, kv] float mask (0: attend, dtype min: not), as eager adds and sdpa takes."""
    return torch.zeros(visibility.shape).masked_fill(~visibility, torch.finfo(torch.float32).min)[:, None]


def feed(model, ids, visibility, positions, steps):
    """A fresh DynamicCache fed in chunks (bounds `steps`), each with its rows of the mask;
    returns (cache, logits)."""
    cache, logits = DynamicCache(config=model.config), []
    for s, e in zip(steps, steps[1:]):
        out = model(ids[:, s:e], attention_mask=additive(visibility[:, s:e, :e]),
                    position_ids=positions[:, s:e], **{cache_keyword(model): cache})
        logits.append(out.logits)
    return cache, torch.cat(logits, 1)


def test_every_backend_honours_the_mask():
    model = narrow_model("llama")
    ids, visibility, positions = packed_program()
    branch2 = slice(PROMPT + BRANCHES[0], PROMPT + sum(BRANCHES))
    # the second branch as a row of its own: the prompt, then the branch, same positions
    alone_ids = torch.cat([ids[:, :PROMPT], ids[:, branch2]], 1)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        alone = model(alone_ids, position_ids=torch.arange(alone_ids.shape[1])[None]).logits
        for impl in ("sdpa", "eager", hf.register(), hf_native.register()):
            model.set_attn_implementation(impl)
            _, logits = feed(model, ids, visibility, positions, [0, ids.shape[1]])
            torch.testing.assert_close(logits[:, branch2], alone[:, PROMPT:], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, impl=impl: f"{impl}: {m}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_prefill_equals_decoding_and_the_batched_layout_under_the_mode(kernel):
    model = narrow_model("llama")
    model.set_attn_implementation(KERNELS[kernel]())
    ids, visibility, positions = packed_program()
    total = ids.shape[1]
    first = PROMPT + BRANCHES[0]  # the second branch's first key
    with torch.no_grad(), set_batch_invariant_mode(impl="rowwise"):
        prefill, prefill_logits = feed(model, ids, visibility, positions, [0, total])
        steps, step_logits = feed(model, ids, visibility, positions, [0, PROMPT, *range(PROMPT + 1, total + 1)])
        keys = visibility[0, first + BRANCHES[1] - 1].nonzero().flatten()  # the prompt and branch 2
        row, _ = feed(model, ids[:, keys], visibility[:, keys][:, :, keys], positions[:, keys],
                      [0, len(keys)])
    for layer in range(model.config.num_hidden_layers):
        for name, a, b in zip("KV", layer_kv(steps, layer), layer_kv(prefill, layer)):
            assert_bitwise_equal(a, b, f"{kernel}: decode vs prefill, layer {layer} {name}")
        for name, a, b in zip("KV", layer_kv(row, layer), layer_kv(prefill, layer)):
            assert_bitwise_equal(a, b[:, :, keys], f"{kernel}: branch 2's row vs packed, layer {layer} {name}")
    assert_bitwise_equal(step_logits[:, -1], prefill_logits[:, -1], f"{kernel}: boundary logits")


def test_control_a_variant_attention_under_the_mask_is_caught():
    if not triton_runs_on(torch.device("cpu")):
        pytest.skip("the CPU twin needs the Triton interpreter")
    model = narrow_model("llama")
    model.set_attn_implementation(twins.register_hf())
    ids, visibility, positions = packed_program()
    total = ids.shape[1]
    with torch.no_grad(), set_batch_invariant_mode(impl="rowwise"):
        prefill, _ = feed(model, ids, visibility, positions, [0, total])
        steps, _ = feed(model, ids, visibility, positions, [0, PROMPT, *range(PROMPT + 1, total + 1)])
    assert any(not bits_equal(a, b) for layer in range(model.config.num_hidden_layers)
               for a, b in zip(layer_kv(steps, layer), layer_kv(prefill, layer)))


def test_visibility_refusals_name_the_kernel_and_the_reason():
    q = torch.zeros(1, 2, 4, 16)
    packed = additive(segment_mask(torch.tensor([[0, 0, 1, 2]]),
                                   torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)))
    bare = hf.make_attention("bare", lambda out, *a, **kw: out, frozenset())
    with pytest.raises(ValueError, match="bare: got an attention mask that is neither"):
        bare(torch.nn.Module(), q, q, q, packed)
    with pytest.raises(ValueError, match="visibility mask on a sliding-window or chunked layer"):
        hf_native.kvfid_native_attention(torch.nn.Module(), q, q, q, packed, sliding_window=2,
                                  position_ids=torch.arange(4)[None])
    served = hf_native.kvfid_native_attention(torch.nn.Module(), q, q, q, packed)[0]
    assert served.shape == (1, 4, 2, 16)
