"""kvfid.kernels.attention.kernel's split path (key axis cut into fixed segments at absolute positions, the
segments' softmax states merged in order): correctness, every position's bits the same in prefill,
chunks and decode at lengths within one segment and across several (full and window caches),
one segment equal to the unsplit kernel, and the twin whose segments start at the first held key.

Sizes (interpreter time is per launch and per program, so launches are what is cut): 32-key tiles,
64-key segments, LENGTH 150 = three segments, the last partial (the GPU configs' 1024-key segments
are crossed in test_kernel_gpu_branch.py). The bitwise tests stack 2 query heads over 1 KV head
(a GQA group of 2 in one program, as the GPU's 4-head groups are); the fp64 test keeps 4 over 2,
so a KV head other than 0 reads its own keys and workspace slots. A decode step is one stateless
launch for one position, so `SCHEDULES` decodes the positions where a step's segments or key
tiles change (one below, at and one above each segment edge 64 and 128 and the tile edge 96,
and the last position) and chunks everything between: every position is still built a second
and a third way, and compared with the prefill.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import torch
from helpers import assert_close_to_ref, bits_equal, randn

from kvfid.kernels.attention.kernel import AttentionConfig, attention, attention_into, attention_ref

UNSPLIT = AttentionConfig(block_n=32, max_tile_rows=64, num_warps=4, num_stages=1, use_dot=False)
SPLIT = dataclasses.replace(UNSPLIT, segment=64)  # two key tiles per segment
LENGTH = 150  # three segments, the last partial
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
VARIANTS = {"causal": {}, "window-50": {"window": 50}, "sinks-softcap": {"sinks": SINKS, "softcap": 4.0}}
# Positions 0..59 by chunks within the first segment, decode steps at the edges (63-65, 95-97,
# 127-129, 149), chunks between them; and a 100-key prompt, then 13-key chunks (126:139 crosses 128).
SCHEDULES = {"chunks-then-decode-at-edges": [0, 20, 33, 60, 63, 64, 65, 66, 95, 96, 97, 98,
                                             127, 128, 129, 130, 149, 150],
             "prompt-100-then-chunks-13": [0, 100] + list(range(113, LENGTH, 13)) + [LENGTH]}


def qkv(dtype, length=LENGTH, seed=0, heads=(2, 1)):
    gen = torch.Generator().manual_seed(seed)
    n_q, n_kv = heads
    return tuple(randn(1, h, length, 32, dtype=dtype, gen=gen) for h in (n_q, n_kv, n_kv))


def variant(name, n_q=2):
    """The variant's keyword arguments for n_q query heads (one sink per head)."""
    return {n: (x[:n_q] if n == "sinks" else x) for n, x in VARIANTS[name].items()}


def as_ref(kwargs):
    return {n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in kwargs.items()}


@lru_cache(maxsize=None)
def prefill(name, dtype, config=SPLIT, align_absolute=True):
    """One prefill of the bitwise tests' inputs (computed once per module, read only)."""
    q, k, v = qkv(dtype)
    return attention_into(torch.empty_like(q), q, k, v, config=config, align_absolute=align_absolute,
                          **variant(name))


def by_chunks(q, k, v, bounds, kwargs, config=SPLIT, window_cache=False, **options):
    held = kwargs.get("window", 0) - 1 if window_cache else 0
    outs = []
    for s, e in zip(bounds, bounds[1:]):
        start = max(0, s - held) if held > 0 else 0
        out = torch.empty_like(q[:, :, s:e])
        outs.append(attention_into(out, q[:, :, s:e], k[:, :, start:e], v[:, :, start:e],
                                   key_start=start, config=config, **kwargs, **options))
    return torch.cat(outs, dim=2)


def differing(a, b):
    return [t for t in range(a.shape[2]) if not bits_equal(a[:, :, t], b[:, :, t])]


# Each variant in fp32; bf16 (loads and the output cast differ, the fp32 arithmetic does not) once.
CASES = [(name, torch.float32) for name in VARIANTS] + [("causal", torch.bfloat16)]
CASE_IDS = [*VARIANTS, "causal-bf16"]


@pytest.mark.parametrize("name,dtype", CASES, ids=CASE_IDS)
def test_split_matches_fp64_reference(name, dtype):
    q, k, v = qkv(dtype, heads=(4, 2))
    for q_len in (LENGTH, 70, 1):
        ref = attention_ref(q[:, :, -q_len:].double(), k.double(), v.double(), **as_ref(VARIANTS[name]))
        assert_close_to_ref(attention(q[:, :, -q_len:], k, v, config=SPLIT, **VARIANTS[name]), ref, dtype)


@pytest.mark.parametrize("name,dtype", CASES, ids=CASE_IDS)
def test_split_every_position_same_bits_in_prefill_chunks_and_decode(name, dtype):
    kwargs = variant(name)
    q, k, v = qkv(dtype)
    whole = prefill(name, dtype)
    for schedule, bounds in SCHEDULES.items():
        for window_cache in (False, True) if "window" in kwargs else (False,):
            bad = differing(by_chunks(q, k, v, bounds, kwargs, window_cache=window_cache), whole)
            assert not bad, f"{name} {schedule} window cache {window_cache}: positions {bad} differ"


@pytest.mark.parametrize("name", VARIANTS)
def test_one_segment_gives_the_unsplit_bits_and_more_do_not(name):
    """Within the first segment the split path is the unsplit kernel, bit for bit; past it the
    two differ somewhere (the merge is a different order of sums: the check has teeth)."""
    split, unsplit = prefill(name, torch.float32), prefill(name, torch.float32, UNSPLIT)
    reach = SPLIT.segment  # positions whose keys all lie in segment 0
    assert not differing(split[:, :, :reach], unsplit[:, :, :reach])
    if "window" not in VARIANTS[name]:
        assert differing(split[:, :, reach:], unsplit[:, :, reach:])


def test_long_prefill_in_query_chunks_is_bit_identical(monkeypatch):
    """A workspace too small for the launch makes it run as query chunks: the same bits."""
    import kvfid.kernels.attention.kernel as attention_module

    q, k, v = qkv(torch.float32)
    whole = prefill("causal", torch.float32)  # before the patch: one launch
    monkeypatch.setattr(attention_module, "WORKSPACE_BYTES", 1)
    assert not differing(attention(q, k, v, config=SPLIT), whole)


def test_control_segments_from_the_first_held_key_are_caught():
    """Twin: key tiles and segments aligned to the first held key move as a window cache slides;
    the window-cache check above fails on it in every schedule."""
    q, k, v = qkv(torch.float32)
    twin_prefill = prefill("window-50", torch.float32, align_absolute=False)
    for schedule, bounds in SCHEDULES.items():
        out = by_chunks(q, k, v, bounds, variant("window-50"), window_cache=True, align_absolute=False)
        assert differing(out, twin_prefill), f"{schedule}: the held-aligned split twin passed"
