"""The matmul's M buckets on a real GPU: every row of M = 1, computed with each bucket's config,
has the bits of the same row inside M = 2048 (the largest bucket's config), with and without
bias, at the GPU benches' 4096 x 4096 weight. Hopper selects its MMA instruction from the tile's
shape, so this is what allows `config_for` to pick a config by M on an arch (BUCKETS_SHOWN).
The control, a bucket with another reduction tile, must differ."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from helpers import bits_equal, randn

from kvfid.kernels import gpu_arch
from kvfid.kernels.invariant import matmul as mm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

randn = partial(randn, on="cuda")
M, K, N = 2048, 4096, 4096
HALF = (torch.bfloat16, torch.float16)


def differing_rows(a, w, bias, config, whole):
    """Rows i whose M = 1 product under `config` differs from row i of `whole`."""
    return [i for i in range(a.shape[0])
            if not bits_equal(mm.matmul(a[i:i + 1], w.t(), bias, config=config)[0], whole[i])]


@pytest.mark.parametrize("with_bias", (False, True), ids=("plain", "bias"))
@pytest.mark.parametrize("dtype", HALF, ids=("bf16", "fp16"))
def test_gpu_every_row_of_m1_in_every_bucket_equals_its_row_in_m2048(dtype, with_bias):
    buckets = mm.BUCKETS[(gpu_arch(torch.device("cuda")), dtype)]
    a, w = randn(M, K, dtype=dtype), randn(N, K, dtype=dtype, seed=1, scale=K ** -0.5)
    bias = randn(N, dtype=dtype, seed=2) if with_bias else None
    whole = mm.matmul(a, w.t(), bias, config=mm.bucket_for(buckets, M))
    for bound, config in buckets:
        bad = differing_rows(a, w, bias, config, whole)
        assert not bad, f"bucket <= {bound} ({config}): {len(bad)} of {M} rows differ, first {bad[:5]}"


def test_gpu_control_a_bucket_with_another_reduction_tile_is_caught():
    a, w = randn(64, K, dtype=torch.bfloat16), randn(N, K, dtype=torch.bfloat16, seed=1, scale=K ** -0.5)
    fixed = mm.BUCKETS[(gpu_arch(torch.device("cuda")), torch.bfloat16)][-1][1]
    whole = mm.matmul(a, w.t(), config=fixed)
    assert differing_rows(a, w, None, dataclasses.replace(fixed, block_k=fixed.block_k // 2), whole)
