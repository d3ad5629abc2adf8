"""kvfid.kernels.invariant.softmax: correctness against fp64, bitwise batch invariance (kernel and rowwise mode).

Stock CPU softmax and log-softmax showed no batch dependence here (300 to 2**20 columns, fp32 and
bf16), so there is no stock twin on CPU; the twin below instead perturbs one element of the probe
row slightly and asserts the comparison sees it, so a check that cannot fail is still caught.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import (BATCH_SIZES, CHECKED_ROWS, DTYPE_IDS, DTYPES, assert_close_to_ref, bits_equal,
                     max_abs_diff, randn)

from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.invariant.softmax import log_softmax, log_softmax_ref, softmax, softmax_ref


randn = partial(randn, scale=3.0)  # logits of about +-9: exp spans many binades


# ---- correctness -------------------------------------------------------------------------------

KERNELS = {"softmax": (softmax, softmax_ref), "log_softmax": (log_softmax, log_softmax_ref)}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,dim", [((37, 300), -1), ((2, 3, 1100), -1), ((5, 40), 0)], ids=str)
@pytest.mark.parametrize("name", KERNELS)
def test_matches_fp64_reference(name, shape, dim, dtype):
    kernel, reference = KERNELS[name]
    x = randn(*shape, dtype=dtype)
    ref = reference(x.double(), dim)  # reference
    out = kernel(x, dim)  # kernel
    assert_close_to_ref(out, ref, dtype)  # compare


def test_half_input_float_output():
    x = randn(4, 50, dtype=torch.bfloat16)
    out = softmax(x, -1, dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close_to_ref(out, softmax_ref(x.double()), torch.float32)


def test_masked_columns():
    x = randn(3, 600)
    x[:, 100:] = float("-inf")
    assert_close_to_ref(softmax(x), softmax_ref(x.double()), torch.float32)


# ---- fidelity: a row alone vs the same row in batches ------------------------------------------

def rowwise(name):
    def fn(x):
        with set_batch_invariant_mode(impl="rowwise"):
            return torch.softmax(x, -1) if name == "softmax" else torch.log_softmax(x, -1)
    return fn


PATHS = {(name, "kernel"): KERNELS[name][0] for name in KERNELS}
PATHS.update({(name, "mode-rowwise"): rowwise(name) for name in KERNELS})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name,path", list(PATHS), ids=lambda v: v if isinstance(v, str) else None)
def test_every_row_alone_equals_row_in_any_batch(name, path, dtype):
    fn = PATHS[name, path]
    pool = randn(max(BATCH_SIZES), 700, dtype=dtype)  # two column tiles, the second partial
    rows = CHECKED_ROWS if path == "kernel" else range(max(BATCH_SIZES))  # interpreter time
    alone = {i: fn(pool[i:i + 1]) for i in rows}
    for n in BATCH_SIZES:
        out = fn(pool[:n])
        bad = [i for i in rows if i < n and not bits_equal(out[i:i + 1], alone[i])]
        assert not bad, (f"batch of {n}: rows {bad} differ from alone, max |diff| "
                         f"{max(max_abs_diff(out[i:i + 1], alone[i]) for i in bad)!r}")


# ---- negative control --------------------------------------------------------------------------

@pytest.mark.parametrize("name", KERNELS)
def test_control_a_small_change_in_the_probe_row_is_seen(name):
    kernel = KERNELS[name][0]
    pool = randn(7, 700)
    alone = kernel(pool[3:4])
    nudged = pool.clone()
    nudged[3, 123] += 1e-3
    assert not torch.equal(kernel(nudged)[3:4], alone)
