"""The GPU branch (`tl.dot`, the GPU tile configs) run in the Triton interpreter against fp64.

Not bitwise: the interpreter's `tl.dot` is a NumPy BLAS product (docs/hazards.md); the
bit-invariance of the GPU path is checked on a GPU (test_kernel_gpu.py). These catch an indexing,
masking or casting error of the tensor-core branch here, before any GPU.

The interpreter of triton 3.9 multiplies bf16 operands as their raw 16-bit integer patterns
(`InterpreterBuilder.create_dot` converts only fp8; bf16 is stored as uint16), so a bf16 `tl.dot`
returns garbage there; fp16 and fp32 are correct. For bf16 the fixture below widens the operands
to fp32 before the product (exact: every bf16 is an fp32), which is what a bf16 MMA with fp32
accumulation computes up to the order of the sums.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from helpers import DTYPE_IDS, DTYPES, assert_close_to_ref, randn

from kvfid.kernels.attention import kernel as attn
from kvfid.kernels.invariant import matmul as mm

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only")


@pytest.fixture
def bf16_dot_in_fp32(monkeypatch):
    """Patch the interpreter's bf16 `tl.dot` to widen its operands to fp32 (see the module doc)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16  # bf16 is the high half of an fp32
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        return original(self, widen(a), widen(b), d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


randn = partial(randn, on="cpu")  # inputs the interpreter runs, on the CPU


def distinct_configs(table):
    """(dtype, arch) pairs whose configs differ in what the interpreter runs (warps and stages
    mean nothing there, so sm_80 and sm_90 at half precision are one case, run once)."""
    seen, cases = set(), []
    for dtype in DTYPES:
        for arch in ("sm_80", "sm_90", "sm_100"):
            config = table[(arch, dtype)]
            tiling = tuple(v for n, v in vars(config).items() if n not in ("num_warps", "num_stages"))
            if (dtype, tiling) not in seen:
                seen.add((dtype, tiling))
                cases.append((dtype, arch))
    return cases


def case_ids(cases):
    return [f"{DTYPE_IDS[DTYPES.index(dtype)]}-{arch}" for dtype, arch in cases]


THREE_TILES = "3tiles"  # a length over three of the config's key tiles, the last partial
ATTENTION_SHAPES = [  # (Hq, Hkv, Tq, Tk, D)
    (7, 1, THREE_TILES, THREE_TILES, 64),  # Qwen2.5 group 7: group chunks, prefill over 3 key tiles
    (4, 1, 1, 130, 128),  # decode over three key tiles (of 64), head dim 128
    (8, 2, 21, 90, 64),  # a chunk crossing a key tile, group 8
    (2, 2, 9, 9, 16),  # MHA, tiny head dim
]


def length(n, config):
    """`n`, or for THREE_TILES 2 key tiles and a third of one: 150 at 64-key tiles, 38 at 16
    (fp32: the prefill's interpreter time grows with its tiles squared)."""
    return 2 * config.block_n + config.block_n // 3 + 1 if n == THREE_TILES else n


@pytest.mark.parametrize("dtype,arch", distinct_configs(attn.CONFIGS), ids=case_ids(distinct_configs(attn.CONFIGS)))
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "Hq{}-Hkv{}-Tq{}-Tk{}-D{}".format(*s))
def test_attention_gpu_branch_matches_fp64(shape, dtype, arch, bf16_dot_in_fp32):
    config = attn.CONFIGS[(arch, dtype)]
    n_q, n_kv, q_len, kv_len, head_dim = shape
    q_len, kv_len = length(q_len, config), length(kv_len, config)
    assert config.use_dot
    q = randn(1, n_q, kv_len, head_dim, dtype=dtype, seed=0)[:, :, kv_len - q_len:]
    k, v = (randn(1, n_kv, kv_len, head_dim, dtype=dtype, seed=s) for s in (1, 2))
    ref = attn.attention_ref(q.double(), k.double(), v.double())  # reference
    out = attn.attention(q, k, v, config=config)  # the GPU branch, GPU tiles
    assert_close_to_ref(out, ref, dtype)  # compare


@pytest.mark.parametrize("dtype,arch", distinct_configs(mm.CONFIGS), ids=case_ids(distinct_configs(mm.CONFIGS)))
@pytest.mark.parametrize("rows", [1, 130])  # decode; a prefill over two row tiles
def test_matmul_gpu_branch_matches_fp64(rows, dtype, arch, bf16_dot_in_fp32):
    config = mm.CONFIGS[(arch, dtype)]
    a = randn(rows, 200, dtype=dtype, seed=0)  # K = 200: not a multiple of BLOCK_K
    w = randn(90, 200, dtype=dtype, seed=1)  # N = 90: not a multiple of BLOCK_N
    bias = randn(90, dtype=dtype, seed=2)
    ref = mm.matmul_ref(a.double(), w.double().t(), bias.double())
    out = mm.matmul(a, w.t(), bias, config=config)
    assert_close_to_ref(out, ref, dtype)


def test_config_tables_keep_the_invariance_preconditions():
    """Every (arch, dtype) has a config; key tiles are whole query tiles (module docstring)."""
    for arch in ("sm_80", "sm_90", "sm_100"):
        for dtype in DTYPES:
            config = attn.CONFIGS[(arch, dtype)]
            assert config.use_dot and config.block_n % attn.BLOCK_M == 0
            assert config.max_tile_rows % attn.BLOCK_M == 0
            assert mm.CONFIGS[(arch, dtype)].use_dot


def test_bf16_dot_fixture_is_exact(bf16_dot_in_fp32):
    """The widened bf16 product equals the fp32 product of the same values (the fixture adds no
    rounding of its own)."""
    a, w = randn(16, 64, dtype=torch.bfloat16, seed=3), randn(32, 64, dtype=torch.bfloat16, seed=4)
    config = mm.CONFIGS[("sm_90", torch.bfloat16)]
    out = mm.matmul(a, w.t(), config=config, out_dtype=torch.float32)
    ref = mm.matmul(a.float(), w.float().t(), config=mm.CONFIGS[("sm_90", torch.float32)])
    assert_close_to_ref(out, ref.double(), torch.float32)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_attention_gpu_branch_split_across_segments_matches_fp64(dtype, bf16_dot_in_fp32):
    """The split path at the GPU config (1024-key segments): a 20-query chunk at 1100 keys
    crosses a segment edge, with a window reaching back across it and sinks. Two query heads
    over one KV head: a GQA group (two group chunks in sm_90's 16-row fp32 tiles)."""
    config = attn.CONFIGS[("sm_90", dtype)]
    assert config.segment and 1100 > config.segment
    q = randn(1, 2, 20, 64, dtype=dtype, seed=0)
    k, v = (randn(1, 1, 1100, 64, dtype=dtype, seed=s) for s in (1, 2))
    sinks = randn(2, seed=3)
    for kwargs in ({}, {"window": 300, "sinks": sinks}):
        ref = attn.attention_ref(q.double(), k.double(), v.double(),
                                 **{n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in kwargs.items()})
        assert_close_to_ref(attn.attention(q, k, v, config=config, **kwargs), ref, dtype)


def test_attention_gpu_branch_packed_group_of_seven_matches_fp64(bf16_dot_in_fp32):
    """NARROW_CONFIGS' 128-row tiles (head dim 64: 7 query heads and a padding head in one
    program) on the `tl.dot` branch, a prefill over three 64-key tiles."""
    q_len = 150
    config = attn.NARROW_CONFIGS[("sm_90", torch.bfloat16)]
    assert attn.group_tile_for(7, config) * attn.BLOCK_M == 128
    q = randn(1, 7, 150, 64, dtype=torch.bfloat16, seed=0)[:, :, 150 - q_len:]
    k, v = (randn(1, 1, 150, 64, dtype=torch.bfloat16, seed=s) for s in (1, 2))
    ref = attn.attention_ref(q.double(), k.double(), v.double())
    assert_close_to_ref(attn.attention(q, k, v, config=config), ref, torch.bfloat16)
