"""The matmul's M buckets (kvfid.kernels.invariant.matmul.BUCKETS) in the interpreter: a row's
bits are the same whichever bucket's tiles compute it, every row checked, and the control: a
bucket that changed the reduction tile BLOCK_K would be caught.

In the interpreter the products are fp32 broadcast multiplies reduced with `tl.sum` over each K
tile, so what is shown here is the tiling's half of the argument (the same K tiles in the same
order, whatever BLOCK_M and BLOCK_N). The GPU half, that the MMA instruction a bucket's tile
shape selects leaves a row's bits alone, is tests/gpu/test_kernel_gpu_buckets.py's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import bits_equal, randn

from kvfid.kernels.invariant import matmul as mm

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only")

M, K, N = 24, 72, 40  # K and N not multiples of a tile; each config is given explicitly


def interpreted(config: mm.MatmulConfig) -> mm.MatmulConfig:
    """A GPU config's tiling with the interpreter's products (the `tl.sum` branch)."""
    return dataclasses.replace(config, use_dot=False)


def rows_alone(a, w, bias, config):
    """Every row of `a` as its own M = 1 product, in one launch: the kernel's batch axis with
    the weight broadcast (each program computes one row at M = 1)."""
    c = torch.empty(a.shape[0], 1, w.shape[0], dtype=a.dtype)
    return mm._launch(a.unsqueeze(1), w.t().unsqueeze(0).expand(a.shape[0], -1, -1), c, bias,
                      interpreted(config))[:, 0]


def differing_rows(x, y):
    return [i for i in range(x.shape[0]) if not bits_equal(x[i], y[i])]


def test_every_row_of_m1_in_every_bucket_equals_its_row_under_the_fixed_config():
    """bf16 operands (the buckets' dtype), bias added as the QKV projections add it; each row at
    M = 1 and all rows at M = 24, under each bucket's tiling, against M = 24 under the fixed one."""
    dtype = torch.bfloat16
    a, w, bias = randn(M, K, dtype=dtype), randn(N, K, dtype=dtype, seed=1), randn(N, dtype=dtype, seed=2)
    buckets = mm.BUCKETS[("sm_90", dtype)]
    assert len(buckets) > 1 and len({c.block_k for _, c in buckets}) == 1
    whole = mm.matmul(a, w.t(), bias, config=interpreted(buckets[-1][1]))
    for bound, config in buckets:
        assert not differing_rows(rows_alone(a, w, bias, config), whole), (bound, config)
        inside = mm.matmul(a, w.t(), bias, config=interpreted(config))
        assert not differing_rows(inside, whole), (bound, config)


def test_control_a_bucket_with_another_reduction_tile_is_caught():
    a, w = randn(M, K), randn(N, K, seed=1)
    fixed = mm.BUCKETS[("sm_90", torch.bfloat16)][-1][1]
    whole = mm.matmul(a, w.t(), config=interpreted(fixed))
    other = dataclasses.replace(fixed, block_k=fixed.block_k // 2)
    assert differing_rows(rows_alone(a[:8], w, None, other), whole[:8])


def test_buckets_are_ordered_and_end_with_the_fixed_config():
    for key, buckets in mm.BUCKETS.items():
        bounds = [b for b, _ in buckets]
        assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1]), key
        assert buckets[-1][1] == mm.CONFIGS[key], key
        assert len({c.block_k for _, c in buckets}) == 1, key   # one reduction tile per dtype
    assert mm.bucket_for(mm.BUCKETS[("sm_90", torch.bfloat16)], 1).block_m == 64
    assert mm.bucket_for(mm.BUCKETS[("sm_90", torch.bfloat16)], 2048) == mm.CONFIGS[("sm_90", torch.bfloat16)]
