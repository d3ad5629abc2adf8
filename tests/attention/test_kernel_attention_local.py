"""kvfid.kernels.attention.kernel with local attention: sliding windows and block-local (chunked) attention over
caches that hold only the last keys (transformers' sliding-window cache layer).

Correctness against fp64; every position's bits the same in a full-cache prefill and in decode
steps and chunks over a window cache (the kernel told where the held keys start); co-batched rows
with left padding equal the row alone; and the twin whose key tiles start at the first *held* key
(not at absolute 0), which must fail the same check. Small tiles (`SMALL`) make short sequences
cross several key tiles and windows, cheaply in the interpreter.

Interpreter time is per launch. A decode step over a window cache is one stateless launch whose
keys (the last `held_span` ones) depend on its position only, so the decode schedule runs every
position once and the other schedules chunk (a prompt, then chunks: their decode steps would
repeat the decode schedule's launches exactly). Every local variant runs in fp32; bf16 (the
interpreter path computes in fp32 after the loads, so the dtype changes loads and the output
cast only) runs the combined chunk-40-window-30.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_to_ref, bits_equal, device, randn

from kvfid.kernels.attention.kernel import INTERPRETER_CONFIG, AttentionConfig, attention_into, attention_ref

SMALL = AttentionConfig(block_n=32, max_tile_rows=64, num_warps=4, num_stages=1, use_dot=False)
LENGTH = 90  # positions: three 32-key tiles, the last one partial
LOCAL = {"window-20": {"window": 20}, "window-45": {"window": 45}, "chunk-24": {"chunk": 24},
         "chunk-40-window-30": {"chunk": 40, "window": 30}}
# fp16 shares bf16's path; each variant in fp32, the combined one in bf16 too (module docstring)
CASES = [(name, torch.float32) for name in LOCAL] + [("chunk-40-window-30", torch.bfloat16)]
CASE_IDS = [f"{name}-fp32" for name in LOCAL] + ["chunk-40-window-30-bf16"]


def qkv(dtype, batch=1, n_q=2, n_kv=1, length=LENGTH, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(batch, h, length, head_dim, dtype=dtype, gen=gen) for h in (n_q, n_kv, n_kv))


def held_span(local: dict) -> int:
    """Keys a window cache keeps between calls (transformers keeps window - 1; chunked layers
    are cached as a window of the chunk size)."""
    return max(local.values()) - 1


def by_window_cache(q, k, v, bounds, local, config=SMALL, **options):
    """Outputs for all positions, chunk by chunk, each chunk seeing only what a window cache holds
    (the last `held_span` keys before it, and its own)."""
    outs = []
    for s, e in zip(bounds, bounds[1:]):
        start = max(0, s - held_span(local))
        out = torch.empty_like(q[:, :, s:e])
        outs.append(attention_into(out, q[:, :, s:e], k[:, :, start:e], v[:, :, start:e],
                                   key_start=start, config=config, **local, **options))
    return torch.cat(outs, dim=2)


def schedules(length):
    return {"decode": list(range(length + 1)), "chunks-7": list(range(0, length, 7)) + [length],
            "prompt-33-then-chunks-9": [0] + list(range(33, length, 9)) + [length]}


def differing(a, b):
    return [t for t in range(a.shape[2]) if not bits_equal(a[:, :, t], b[:, :, t])]


# ---- correctness -------------------------------------------------------------------------------

@pytest.mark.parametrize("name,dtype", CASES, ids=CASE_IDS)
def test_local_attention_matches_fp64_reference(name, dtype):
    local = LOCAL[name]
    q, k, v = qkv(dtype, batch=2, n_q=4, n_kv=2)
    for s, start in ((0, 0), (70, 70 - held_span(local)), (89, 89 - held_span(local))):
        ref = attention_ref(q[:, :, s:].double(), k[:, :, start:].double(), v[:, :, start:].double(),
                            key_start=start, **local)
        out = attention_into(torch.empty_like(q[:, :, s:]), q[:, :, s:], k[:, :, start:],
                             v[:, :, start:], key_start=start, config=SMALL, **local)
        assert_close_to_ref(out, ref, dtype)


def test_control_the_reference_check_sees_the_window():
    """The tolerance check has teeth: plain causal attention is not close to the windowed reference."""
    q, k, v = qkv(torch.float32)
    ref = attention_ref(q.double(), k.double(), v.double(), window=20)
    out = attention_into(torch.empty_like(q), q, k, v, config=SMALL)
    assert not torch.allclose(out.double(), ref, atol=1e-2)


# ---- fidelity: every position, full cache or window cache --------------------------------------

@pytest.mark.parametrize("name,dtype", CASES, ids=CASE_IDS)
def test_window_cache_constructions_give_the_prefill_bits(name, dtype):
    local = LOCAL[name]
    q, k, v = qkv(dtype)
    prefill = attention_into(torch.empty_like(q), q, k, v, config=SMALL, **local)  # full cache
    for schedule, bounds in schedules(LENGTH).items():
        bad = differing(by_window_cache(q, k, v, bounds, local), prefill)
        assert not bad, f"{name} {schedule}: positions {bad} differ from the prefill"


def test_window_cache_at_the_interpreter_tiles():
    """The same at the interpreter's default tiles (128 keys), over more than one key tile."""
    local = {"window": 100}
    q, k, v = qkv(torch.float32, length=200)
    prefill = attention_into(torch.empty_like(q), q, k, v, config=INTERPRETER_CONFIG, **local)
    bounds = [0, 150] + list(range(160, 201, 10))
    out = by_window_cache(q, k, v, bounds, local, config=INTERPRETER_CONFIG)
    assert not differing(out, prefill)


def test_control_tiles_from_the_first_held_key_are_caught():
    """Twin: key tiles aligned to held positions (correct, but they move as the window slides);
    the window-cache check fails on it in each chunked schedule (decode: interpreter time)."""
    local = LOCAL["window-20"]
    q, k, v = qkv(torch.float32)
    prefill = attention_into(torch.empty_like(q), q, k, v, config=SMALL, align_absolute=False, **local)
    for schedule in ("chunks-7", "prompt-33-then-chunks-9"):
        out = by_window_cache(q, k, v, schedules(LENGTH)[schedule], local, align_absolute=False)
        assert_close_to_ref(out, attention_ref(q.double(), k.double(), v.double(), **local), torch.float32)
        assert differing(out, prefill), f"{schedule}: the held-aligned twin passed the window-cache check"


# ---- fidelity: left padding and neighbours under a window cache --------------------------------

def test_padded_row_with_a_window_cache_equals_the_row_alone():
    """A probe left-padded by 50 among two neighbours, decoded over a window cache (pad keys drop
    out of it), against the probe alone; also the padding twin, which must differ."""
    local = {"window": 20}
    probe = qkv(torch.float32, length=40, seed=5)
    alone = by_window_cache(*probe, schedules(40)["chunks-7"], local)
    width, row = 90, 1
    batch = list(qkv(torch.float32, batch=3, seed=6))
    for t, p in zip(batch, probe):
        t[row, :, width - 40:] = p[0]
    first_valid = torch.tensor([0, width - 40, 30])
    # A 60-token prompt (its cache then starts among the probe's pads: 60 - 19 < 50), decode steps
    # while the held start leaves the pads (60, 61, 68-70: own window start 0 at padded 69) and
    # at the probe's key-tile edge (own 32: padded 81, 82) and its last position; chunks between.
    bounds = [0, 60, 61, 62, 68, 69, 70, 71, 81, 82, 83, 89, width]
    for align_own in (True, False):
        outs = []
        for s, e in zip(bounds, bounds[1:]):
            start = max(0, s - held_span(local))
            out = torch.zeros_like(batch[0][:, :, s:e])
            outs.append(attention_into(out, batch[0][:, :, s:e], batch[1][:, :, start:e],
                                       batch[2][:, :, start:e], first_valid=first_valid,
                                       key_start=start, config=SMALL, align_own=align_own, **local))
        out = torch.cat(outs, dim=2)[row:row + 1, :, width - 40:]
        assert bits_equal(out, alone) == align_own, f"align_own={align_own}"


def test_local_arguments_are_checked():
    q = torch.zeros(1, 1, 4, 16, device=device())
    for kwargs in ({"window": 0}, {"chunk": 0}, {"key_start": -1}):
        with pytest.raises(ValueError):
            attention_into(torch.empty_like(q), q, q, q, **kwargs)
