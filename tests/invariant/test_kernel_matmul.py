"""kvfid.kernels.invariant.matmul: correctness against fp64, bitwise batch invariance (kernel and both modes), controls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (BATCH_SIZES, CHECKED_ROWS, DTYPE_IDS, DTYPES, assert_close_to_ref, bits_equal,
                     max_abs_diff, randn)

from kvfid.stacks.twins import matmul_twin
from kvfid.kernels.invariant.matmul import bmm, matmul, matmul_ref
from kvfid.kernels.invariant.mode import set_batch_invariant_mode


# ---- correctness -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,k,n,with_bias", [(37, 70, 90, True), (1, 576, 300, False), (130, 64, 257, True)])
def test_matmul_matches_fp64_reference(m, k, n, with_bias, dtype):
    a, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype, seed=1)
    bias = randn(n, dtype=dtype, seed=2) if with_bias else None
    ref = matmul_ref(a.double(), w.t().double(), bias.double() if with_bias else None)  # reference
    out = matmul(a, w.t(), bias)  # kernel (a transposed weight, as F.linear passes it)
    assert_close_to_ref(out, ref, dtype)  # compare


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bmm_matches_fp64_reference(dtype):
    a, b = randn(5, 7, 33, dtype=dtype), randn(5, 33, 9, dtype=dtype, seed=1)
    ref = matmul_ref(a.double(), b.double())
    out = bmm(a, b)
    assert_close_to_ref(out, ref, dtype)


# ---- fidelity: a row alone vs the same row in batches ------------------------------------------

def linear_kernel(a, w, bias):
    return matmul(a, w.t(), bias)


def linear_rowwise(a, w, bias):
    with set_batch_invariant_mode(impl="rowwise"):  # F.linear -> aten addmm / mm
        return F.linear(a, w, bias)


PATHS = {"kernel": linear_kernel, "mode-rowwise": linear_rowwise}


ALL_ROWS = range(max(BATCH_SIZES))


def rows_differing(fn, pool: torch.Tensor, *args, rows=ALL_ROWS) -> dict[int, list[int]]:
    """For each batch size n: rows i < n (of `rows`) of fn(pool[:n]) whose bits differ from
    fn(pool[i:i+1])."""
    alone = {i: fn(pool[i:i + 1], *args) for i in rows}
    found = {}
    for n in BATCH_SIZES:
        out = fn(pool[:n], *args)
        bad = [i for i in rows if i < n and not bits_equal(out[i:i + 1], alone[i])]
        if bad:
            found[n] = (bad, max(max_abs_diff(out[i:i + 1], alone[i]) for i in bad))
    return found


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["mm", "addmm"])
@pytest.mark.parametrize("path", PATHS)
def test_every_row_alone_equals_row_in_any_batch(path, with_bias, dtype):
    pool = randn(max(BATCH_SIZES), 96, dtype=dtype)  # 128 different rows, K not a tile multiple
    w = randn(80, 96, dtype=dtype, seed=1)
    bias = randn(80, dtype=dtype, seed=2) if with_bias else None
    found = rows_differing(PATHS[path], pool, w, bias, rows=CHECKED_ROWS if path == "kernel" else ALL_ROWS)
    assert not found, f"batch size -> (rows differing from alone, max |diff|): {found}"


def bmm_rowwise(a, b):
    with set_batch_invariant_mode(impl="rowwise"):
        return torch.bmm(a, b)


# Batch sizes for the interpreted bmm: an item is its own program (grid axis 2, read by no
# arithmetic) and the interpreter pays per program (the 12 sizes summed to 356), so a few, odd
# and even, up to one past 32; the rowwise mode (stock ops) takes every size.
BMM_KERNEL_BATCH_SIZES = (2, 3, 8, 17, 33)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("path", ["kernel", "mode-rowwise"])
def test_bmm_item_alone_equals_item_in_any_batch(path, dtype):
    fn = bmm if path == "kernel" else bmm_rowwise
    a, b = randn(max(BATCH_SIZES), 3, 24, dtype=dtype), randn(max(BATCH_SIZES), 24, 10, dtype=dtype, seed=1)
    alone = fn(a[-1:], b[-1:])  # the probe item, placed last among different items below
    for n in BMM_KERNEL_BATCH_SIZES if path == "kernel" else BATCH_SIZES:
        out = fn(torch.cat([a[:n - 1], a[-1:]]), torch.cat([b[:n - 1], b[-1:]]))[-1:]
        assert bits_equal(out, alone), f"batch of {n}: max |diff| {max_abs_diff(out, alone)!r}"


# ---- negative control --------------------------------------------------------------------------

def linear_twin(a, w, bias):
    out = matmul_twin(a, w)  # split-K, the split count chosen from the number of rows
    return out + bias if bias is not None else out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["mm", "addmm"])
def test_control_the_batch_check_catches_a_batch_variant_twin(with_bias, dtype):
    """Twin of the batch test: the same check, the same inputs, on a deliberately batch-variant
    matmul, finds rows that differ at every batch size (on any CPU, unlike a stock mm)."""
    pool = randn(max(BATCH_SIZES), 96, dtype=dtype)
    w = randn(80, 96, dtype=dtype, seed=1)
    bias = randn(80, dtype=dtype, seed=2) if with_bias else None
    found = rows_differing(linear_twin, pool, w, bias, rows=CHECKED_ROWS)  # the kernel's check
    assert set(found) == set(BATCH_SIZES), f"twin not caught at batch sizes {set(BATCH_SIZES) - set(found)}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_twin_is_a_correct_matmul(dtype):
    """The twin differs in bits, not in value: it matches fp64 within the dtype's tolerance."""
    a, w = randn(37, 96, dtype=dtype), randn(80, 96, dtype=dtype, seed=1)
    assert_close_to_ref(matmul_twin(a, w), matmul_ref(a.double(), w.t().double()), dtype)
