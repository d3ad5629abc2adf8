"""kernels.attention's split path (key axis cut into fixed segments at absolute positions, the
segments' softmax states merged in order): correctness, every position's bits the same in prefill,
chunks and decode at lengths within one segment and across several (full and window caches),
one segment equal to the unsplit kernel, and the twin whose segments start at the first held key.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_close_to_ref, bits_equal, randn

from kernels.attention import AttentionConfig, attention, attention_into, attention_ref

UNSPLIT = AttentionConfig(block_n=32, max_tile_rows=64, num_warps=4, num_stages=1, use_dot=False)
SPLIT = dataclasses.replace(UNSPLIT, segment=64)  # two key tiles per segment
LENGTH = 150  # three segments, the last partial
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
VARIANTS = {"causal": {}, "window-50": {"window": 50}, "sinks-softcap": {"sinks": SINKS, "softcap": 4.0}}


def qkv(dtype, length=LENGTH, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(1, h, length, 32, dtype=dtype, gen=gen) for h in (4, 2, 2))


def as_ref(kwargs):
    return {n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in kwargs.items()}


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


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("name", VARIANTS)
def test_split_matches_fp64_reference(name, dtype):
    q, k, v = qkv(dtype)
    for q_len in (LENGTH, 70, 1):
        ref = attention_ref(q[:, :, -q_len:].double(), k.double(), v.double(), **as_ref(VARIANTS[name]))
        assert_close_to_ref(attention(q[:, :, -q_len:], k, v, config=SPLIT, **VARIANTS[name]), ref, dtype)


@pytest.mark.parametrize("name,dtype", [(name, torch.float32) for name in VARIANTS]
                         + [("causal", torch.bfloat16)], ids=[*VARIANTS, "causal-bf16"])
def test_split_every_position_same_bits_in_prefill_chunks_and_decode(name, dtype):
    kwargs = VARIANTS[name]
    q, k, v = qkv(dtype)
    prefill = attention(q, k, v, config=SPLIT, **kwargs)
    # Positions 0..59 by chunks within the first segment, then decode steps across two more.
    schedules = {"chunks-then-decode": [0, 20, 33, 60] + list(range(61, LENGTH + 1)),
                 "prompt-100-then-chunks-13": [0, 100] + list(range(113, LENGTH, 13)) + [LENGTH]}
    for schedule, bounds in schedules.items():
        for window_cache in (False, True) if "window" in kwargs else (False,):
            bad = differing(by_chunks(q, k, v, bounds, kwargs, window_cache=window_cache), prefill)
            assert not bad, f"{name} {schedule} window cache {window_cache}: positions {bad} differ"


@pytest.mark.parametrize("name", VARIANTS)
def test_one_segment_gives_the_unsplit_bits_and_more_do_not(name):
    """Within the first segment the split path is the unsplit kernel, bit for bit; past it the
    two differ somewhere (the merge is a different order of sums: the check has teeth)."""
    q, k, v = qkv(torch.float32)
    split = attention(q, k, v, config=SPLIT, **VARIANTS[name])
    unsplit = attention(q, k, v, config=UNSPLIT, **VARIANTS[name])
    reach = SPLIT.segment if "window" not in VARIANTS[name] else SPLIT.segment  # keys in segment 0
    assert not differing(split[:, :, :reach], unsplit[:, :, :reach])
    if "window" not in VARIANTS[name]:
        assert differing(split[:, :, reach:], unsplit[:, :, reach:])


def test_long_prefill_in_query_chunks_is_bit_identical(monkeypatch):
    """A workspace too small for the launch makes it run as query chunks: the same bits."""
    import kernels.attention as attention_module

    q, k, v = qkv(torch.float32)
    whole = attention(q, k, v, config=SPLIT)
    monkeypatch.setattr(attention_module, "WORKSPACE_BYTES", 1)
    assert not differing(attention(q, k, v, config=SPLIT), whole)


def test_control_segments_from_the_first_held_key_are_caught():
    """Twin: key tiles and segments aligned to the first held key move as a window cache slides."""
    kwargs = VARIANTS["window-50"]
    q, k, v = qkv(torch.float32)
    prefill = attention_into(torch.empty_like(q), q, k, v, config=SPLIT, align_absolute=False, **kwargs)
    out = by_chunks(q, k, v, list(range(LENGTH + 1)), kwargs, window_cache=True, align_absolute=False)
    assert differing(out, prefill), "the held-aligned split twin passed the window-cache check"
