"""The attention kernel's GQA packing and dispatch in the interpreter, every position checked:

* a group of 7 query heads packed into one program (NARROW_CONFIGS: 8 heads x 16 rows = 128 rows,
  the eighth a padding head) gives each position the same bits in prefill, chunks and decode
  steps, on the split path (segments of 64 keys here) whose merge reads only the real rows, and
  the same bits as the same group run as two 4-head programs;
* a call whose keys all lie in the first segment is one unsplit launch, past it the split path's
  two launches (the identity behind it is test_kernel_attention_split.py's);
* the control: another key tiling differs at some position (the comparison has teeth).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_close_to_ref, bits_equal, randn

import kvfid.kernels.attention.kernel as module
from kvfid.kernels.attention.kernel import (NARROW_CONFIGS, attention, attention_ref,
                                            group_tile_for)

PACKED = dataclasses.replace(NARROW_CONFIGS[("sm_90", torch.bfloat16)], use_dot=False, segment=64)
FOUR_HEADS = dataclasses.replace(PACKED, max_tile_rows=64)
LENGTH = 150  # three 64-key segments, the last partial
# Chunks, with decode steps around the segment edges 64 and 128 and at the end.
BOUNDS = [0, 30, 63, 64, 65, 66, 100, 127, 128, 129, 130, 149, 150]


@pytest.fixture(scope="module")
def qkv():
    gen = torch.Generator().manual_seed(0)
    return tuple(randn(1, h, LENGTH, 64, gen=gen) for h in (7, 1, 1))


def differing(a, b):
    return [t for t in range(a.shape[2]) if not bits_equal(a[:, :, t], b[:, :, t])]


def test_group_of_seven_packed_in_one_program_same_bits_every_way(qkv):
    q, k, v = qkv
    assert group_tile_for(7, PACKED) == 8 and group_tile_for(7, FOUR_HEADS) == 4
    whole = attention(q, k, v, config=PACKED)
    assert_close_to_ref(whole, attention_ref(q.double(), k.double(), v.double()), torch.float32)
    chunks = torch.cat([attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], config=PACKED)
                        for s, e in zip(BOUNDS, BOUNDS[1:])], dim=2)
    assert not differing(chunks, whole)
    assert not differing(attention(q, k, v, config=FOUR_HEADS), whole)


def test_control_another_key_tiling_differs(qkv):
    q, k, v = qkv
    other = dataclasses.replace(PACKED, block_n=PACKED.block_n // 2)
    assert differing(attention(q, k, v, config=other), attention(q, k, v, config=PACKED))


def test_a_call_within_the_first_segment_is_one_unsplit_launch(qkv, monkeypatch):
    q, k, v = qkv
    launches, real = [], module._attention_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((len(grid), kwargs["SEGMENT"], kwargs.get("MERGE", False)))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_attention_kernel", Recorder())
    for keys, key_start, expected in ((64, 0, [(2, 0, False)]),
                                      (65, 0, [(3, 64, False), (2, 64, True)]),
                                      (64, 1, [(3, 64, False), (2, 64, True)])):
        launches.clear()
        attention(q[:, :, keys - 1:keys], k[:, :, :keys], v[:, :, :keys], key_start=key_start,
                  config=PACKED)
        assert launches == expected, (keys, key_start, launches)
