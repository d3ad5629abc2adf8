"""kvfid.kernels.attention.kernel with logit softcapping, attention sinks, different q/k and v head dims (MLA)
and head dims up to 256: each against fp64 (with a control showing the check sees the mechanism),
and every position's bits the same in prefill, chunks and decode.

Sizes: 32-key tiles (`SMALL`) over LENGTH 70 positions, so keys cross tile edges at 32 and 64 and
the window of 20 moves its first key across the edge at 32 (at position 51). Interpreter time is
per launch: a decode step is one stateless launch for one position, so `SCHEDULES` decodes the
positions one below, at and one above each such edge and the last one, and chunks the rest. Each
mechanism runs in one dtype (the interpreter path computes in fp32 whatever the input dtype; a
dtype changes the loads and the output cast only), bf16 and fp32 both among them, and the
combined sinks-window-softcap in both.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_to_ref, bits_equal, randn

from kvfid.kernels.attention.kernel import AttentionConfig, attention, attention_ref

SMALL = AttentionConfig(block_n=32, max_tile_rows=64, num_warps=4, num_stages=1, use_dot=False)
LENGTH = 70
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])  # one per query head (4 over 2 kv heads)
VARIANTS = {  # name: (q/k head dim, v head dim, keyword arguments)
    "softcap": (32, 32, {"softcap": 2.0}),
    "sinks": (32, 32, {"sinks": SINKS}),
    "mla-48-32": (48, 32, {}),
    "d256": (256, 256, {}),
    "sinks-window-softcap": (64, 64, {"sinks": SINKS, "window": 20, "softcap": 3.0}),
}
BF16, FP32 = torch.bfloat16, torch.float32
CASES = [("softcap", BF16), ("sinks", FP32), ("mla-48-32", BF16), ("d256", FP32),
         ("sinks-window-softcap", FP32), ("sinks-window-softcap", BF16)]
CASE_IDS = [f"{name}-{'fp32' if dtype == FP32 else 'bf16'}" for name, dtype in CASES]
# Decode steps at 31-33, 50-52 (window start crossing 32), 63-65 and 69, chunks between them;
# and a 33-token prompt, a 7-token chunk, then 9-token chunks.
SCHEDULES = {"chunks-and-decode-at-edges": [0, 10, 31, 32, 33, 34, 50, 51, 52, 53, 63, 64, 65, 66,
                                            69, LENGTH],
             "prompt-33-then-chunks-9": [0, 33] + list(range(40, LENGTH, 9)) + [LENGTH]}


def qkv(dtype, qk_dim, v_dim, length=LENGTH, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = randn(batch, 4, length, qk_dim, dtype=dtype, gen=gen, scale=3.0)  # sharp scores: caps bite
    k = randn(batch, 2, length, qk_dim, dtype=dtype, gen=gen)
    v = randn(batch, 2, length, v_dim, dtype=dtype, gen=gen)
    return q, k, v


def as_ref(kwargs):
    return {n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in kwargs.items()}


@pytest.mark.parametrize("name,dtype", CASES, ids=CASE_IDS)
def test_mechanism_matches_fp64_reference(name, dtype):
    qk_dim, v_dim, kwargs = VARIANTS[name]
    q, k, v = qkv(dtype, qk_dim, v_dim, batch=2)
    for q_len in (LENGTH, 9, 1):
        ref = attention_ref(q[:, :, -q_len:].double(), k.double(), v.double(), **as_ref(kwargs))
        out = attention(q[:, :, -q_len:], k, v, config=SMALL, **kwargs)
        assert out.shape == (2, 4, q_len, v_dim)
        assert_close_to_ref(out, ref, dtype)


@pytest.mark.parametrize("name", ["softcap", "sinks"])
def test_control_the_reference_check_sees_the_mechanism(name):
    """The tolerance check has teeth: the kernel without the mechanism is far from its reference."""
    qk_dim, v_dim, kwargs = VARIANTS[name]
    q, k, v = qkv(torch.float32, qk_dim, v_dim)
    ref = attention_ref(q.double(), k.double(), v.double(), **as_ref(kwargs))
    assert not torch.allclose(attention(q, k, v, config=SMALL).double(), ref, atol=1e-2)


def test_sinks_follow_gpt_oss_eager_attention():
    """The sink as transformers' gpt-oss eager attention computes it (concatenated logit,
    max-subtracted softmax, dropped), written out here independently of attention_ref."""
    q, k, v = qkv(torch.float64, 16, 16, length=12)
    keys = k.repeat_interleave(2, dim=1)
    scores = q @ keys.transpose(2, 3) / 4.0
    scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    logits = torch.cat([scores, SINKS.double().reshape(1, -1, 1, 1).expand(1, -1, 12, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    expected = probs @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(attention_ref(q, k, v, sinks=SINKS.double()), expected)
    out = attention(q.float(), k.float(), v.float(), sinks=SINKS, config=SMALL)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,dtype", CASES, ids=CASE_IDS)
def test_mechanism_every_position_same_bits_in_prefill_chunks_and_decode(name, dtype):
    qk_dim, v_dim, kwargs = VARIANTS[name]
    q, k, v = qkv(dtype, qk_dim, v_dim)
    prefill = attention(q, k, v, config=SMALL, **kwargs)
    for bounds in SCHEDULES.values():
        out = torch.cat([attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], config=SMALL, **kwargs)
                         for s, e in zip(bounds, bounds[1:])], dim=2)
        bad = [t for t in range(LENGTH) if not bits_equal(out[:, :, t], prefill[:, :, t])]
        assert not bad, f"{name}: positions {bad} differ from prefill"


def test_mechanism_arguments_are_checked():
    q, k, v = qkv(torch.float32, 16, 16, length=4)
    for kwargs in ({"softcap": 0.0}, {"sinks": torch.zeros(3)}):
        with pytest.raises(ValueError):
            attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="head dims up to 256"):
        attention(*qkv(torch.float32, 288, 16, length=4))
