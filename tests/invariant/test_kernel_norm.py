"""kvfid.kernels.invariant.norm: correctness against fp64, bitwise batch invariance (kernel and rowwise mode), controls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (BATCH_SIZES, CHECKED_ROWS, DTYPE_IDS, DTYPES, assert_bitwise_equal,
                     assert_close_to_ref, bits_equal, max_abs_diff, randn)

from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.invariant.norm import mean_last_dim, mean_last_dim_ref, rms_norm, rms_norm_ref

EPS = 1e-6


# ---- correctness -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(37, 300), (2, 5, 64), (1, 1000)], ids=str)
def test_mean_matches_fp64_reference(shape, dtype):
    x = randn(*shape, dtype=dtype)
    ref = mean_last_dim_ref(x.double(), keepdim=True)  # reference
    out = mean_last_dim(x, keepdim=True)  # kernel
    assert_close_to_ref(out, ref, dtype)  # compare


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(37, 300), (2, 5, 64), (1, 1000)], ids=str)
def test_rms_norm_matches_fp64_reference(shape, dtype):
    x, w = randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype, seed=1)
    ref = rms_norm_ref(x.double(), w.double(), EPS)
    out = rms_norm(x, w, EPS)
    assert_close_to_ref(out, ref, dtype)


# ---- fidelity: a row alone vs the same row in batches ------------------------------------------

def mean_rowwise(x):
    with set_batch_invariant_mode(impl="rowwise"):
        return x.mean(dim=-1)


def rms_norm_rowwise(x, w):
    with set_batch_invariant_mode(impl="rowwise"):  # F.rms_norm decomposes to aten mean.dim on CPU
        return F.rms_norm(x, x.shape[-1:], w, EPS)


PATHS = {
    ("mean", "kernel"): lambda x, w: mean_last_dim(x),
    ("mean", "mode-rowwise"): lambda x, w: mean_rowwise(x),
    ("rms_norm", "kernel"): lambda x, w: rms_norm(x, w, EPS),
    ("rms_norm", "mode-rowwise"): rms_norm_rowwise,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op,path", list(PATHS), ids=lambda v: v if isinstance(v, str) else None)
def test_every_row_alone_equals_row_in_any_batch(op, path, dtype):
    fn = PATHS[op, path]
    pool = randn(max(BATCH_SIZES), 300, dtype=dtype)  # two column tiles, the second partial
    w = randn(300, dtype=dtype, seed=1)
    rows = CHECKED_ROWS if path == "kernel" else range(max(BATCH_SIZES))  # interpreter time
    alone = {i: fn(pool[i:i + 1], w) for i in rows}
    for n in BATCH_SIZES:
        out = fn(pool[:n], w)
        bad = [i for i in rows if i < n and not bits_equal(out[i:i + 1], alone[i])]
        assert not bad, (f"batch of {n}: rows {bad} differ from alone, max |diff| "
                         f"{max(max_abs_diff(out[i:i + 1], alone[i]) for i in bad)!r}")


WIDE = 65536  # where stock CPU mean split one row's reduction across two threads (measured)


def test_wide_rows_alone_equal_rows_in_batch():
    pool = randn(7, WIDE)
    out = mean_last_dim(pool)
    for i in (0, 3, 6):  # first, middle, last (each alone is an interpreter launch over 64k columns)
        assert_bitwise_equal(out[i:i + 1], mean_last_dim(pool[i:i + 1]), f"row {i} in a batch of 7")


# ---- negative control --------------------------------------------------------------------------

def test_control_a_row_count_split_mean_fails_the_row_alone_check():
    """Twin of the wide-row test: a mean whose reduction is split by the number of rows (variant
    by construction, on any CPU and thread count) gives a row alone other bits than in a batch of
    7, so the check that the kernel passes can fail. (Stock CPU mean over 65536 fp32 columns was
    measured batch-variant with two threads and invariant with one: a finding, not a control.)"""
    from kvfid.stacks.twins import _split_sum, _splits

    def twin(x):
        return _split_sum(x.float(), _splits(x.shape[0]), torch.float32) / x.shape[-1]

    pool = randn(7, WIDE).cpu()
    out = twin(pool)
    assert any(not torch.equal(twin(pool[i:i + 1]), out[i:i + 1]) for i in range(7))


def test_control_the_rms_norm_twin_fails_the_row_alone_check():
    from kvfid.stacks.twins import rms_norm_twin

    pool, w = randn(64, WIDE).cpu(), randn(WIDE, seed=1).cpu()
    out = rms_norm_twin(pool, w, EPS)
    assert any(not torch.equal(rms_norm_twin(pool[i:i + 1], w, EPS), out[i:i + 1]) for i in range(64))
