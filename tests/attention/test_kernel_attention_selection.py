"""Selections in the kernels' visibility (Triton, interpreted here, and native): a query that sees
a chosen subset of the keys at or before it (a sparse indexer's top-k, itself included or not)
and a padded query that sees none. Correctness against fp64, the bitwise claim (every query has
the bits of its chosen keys alone, as a decode step over them; a prefill under the selection
equals its decode steps), padded queries left at zero, and the negative control (key tiles at
held indexes: a left-padded row's selected keys sit elsewhere and its bits change)."""

from __future__ import annotations

import pytest
import torch

from helpers import (DTYPE_IDS, DTYPES, assert_bitwise_equal, assert_close_to_ref, bits_equal)
from test_kernel_attention_visibility import KERNELS, ON, SMALL, _alone, held_tiles_twin, qkv

from kvfid.kernels.attention.reference import attention_ref

LENGTH, TOP_K, PAD = 24, 5, 3


def selection(batch: int = 2, length: int = LENGTH, top_k: int = TOP_K, pad: int = PAD,
              seed: int = 0) -> torch.Tensor:
    """[B, T, T] bool: each query's top-k of random scores among its visible keys (row 1 left-
    padded by `pad`: its pad queries see nothing, its pad keys are never chosen). Query 13 of
    row 0 is not given itself, whatever the scores, so both kinds of query occur."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, length, length, generator=gen)
    index = torch.arange(length)
    visible = (index[None, :] <= index[:, None]).expand(batch, length, length).clone()
    if batch > 1:
        visible[1, :, :pad] = False
        visible[1, :pad] = False
    visible[0, 13, 13] = False
    scores = scores.masked_fill(~visible, -1.0)
    top = scores.topk(top_k, dim=-1).indices
    chosen = torch.zeros(batch, length, length, dtype=torch.bool).scatter(-1, top, True)
    return chosen & visible


def test_the_selection_has_both_kinds_of_query_and_padding():
    mask = selection()
    index = torch.arange(LENGTH)
    sees_self = mask[:, index, index]
    assert not bool(sees_self[0, 13]) and bool(sees_self[0, :TOP_K].all())   # skipped; given
    assert int(mask[0].sum(-1).max()) == TOP_K < LENGTH                       # a selection
    assert not bool(mask[1, :PAD].any()) and not bool(mask[1, :, :PAD].any())  # padding


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_selection_matches_fp64_reference(kernel, dtype):
    mask = selection()
    q, k, v = qkv(2, LENGTH, dtype, on=ON[kernel])
    ref = attention_ref(q.double(), k.double(), v.double(), visibility=mask)  # reference
    out = KERNELS[kernel](q, k, v, visibility=mask, **SMALL[kernel])  # kernel
    assert_close_to_ref(out, ref, dtype)  # compare
    assert bool((out[1, :, :PAD] == 0).all())   # padded queries: not computed, zero


def test_control_the_reference_check_sees_the_selection():
    mask = selection()
    q, k, v = qkv(2, LENGTH, torch.float32)
    dense = attention_ref(q.double(), k.double(), v.double())
    with pytest.raises(AssertionError):
        assert_close_to_ref(KERNELS["native"](q, k, v, visibility=mask), dense, torch.float32)


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_selected_query_has_the_bits_of_its_chosen_keys_alone(kernel):
    mask = selection()
    q, k, v = qkv(2, LENGTH, torch.bfloat16, on=ON[kernel])
    fn, kw = KERNELS[kernel], SMALL[kernel]
    prefill = fn(q, k, v, visibility=mask, **kw)
    for b in range(2):
        for i in range(PAD if b else 0, LENGTH):
            assert_bitwise_equal(prefill[b, :, i], _alone(fn, q, k, v, mask, b, i, **kw),
                                 f"{kernel} row {b} query {i} alone")
            step = fn(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, :i + 1], v[b:b + 1, :, :i + 1],
                      visibility=mask[b:b + 1, i:i + 1, :i + 1], **kw)   # a decode step
            assert_bitwise_equal(prefill[b, :, i], step[0, :, 0], f"{kernel} row {b} query {i} step")


def test_control_key_tiles_at_held_indexes_change_a_padded_rows_bits():
    """Row 1 is row 0's tokens behind `PAD` pad keys: under the selection in view coordinates its
    queries keep their bits; with key tiles at held indexes (a kernel that only masks) they move."""
    length = LENGTH - PAD
    q, k, v = qkv(1, length, torch.float32, seed=2)
    alone = selection(batch=1, length=length, pad=0, seed=3)
    padded = torch.zeros(1, LENGTH, LENGTH, dtype=torch.bool)
    padded[:, PAD:, PAD:] = alone
    pad = [torch.cat([torch.zeros(1, x.shape[1], PAD, x.shape[-1]), x], 2) for x in (q, k, v)]
    ours = KERNELS["native"](q, k, v, visibility=alone, **SMALL["native"])
    ours_padded = KERNELS["native"](*pad, visibility=padded, **SMALL["native"])
    assert_bitwise_equal(ours_padded[:, :, PAD:], ours, "native: padded row vs alone")
    twin = held_tiles_twin(q, k, v, alone, tile=8)
    twin_padded = held_tiles_twin(*pad, padded, tile=8)[:, :, PAD:]
    assert_close_to_ref(twin_padded, attention_ref(q.double(), k.double(), v.double(),
                                                   visibility=alone), torch.float32)  # correct ...
    assert not bits_equal(twin_padded, twin)  # ... but caught
