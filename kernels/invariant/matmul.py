"""Batch-invariant matmul (Triton) and its PyTorch reference.

`c = a @ b (+ bias)` with tiles fixed in advance (chosen from M only by bucket, and only on an arch
where a GPU has shown a bucket's rows equal to the others': BUCKETS_SHOWN), the K axis reduced in
one program in order (no split-K; one K tile in every bucket) with fp32 accumulation, and the bias
added once at the end. A row of `c` is therefore computed by the same arithmetic whatever number
of rows comes with it.

Products: on CUDA `tl.dot` accumulating into the fp32 tile (`kvfid.kernels.dot.mma`): bf16/fp16
operands go to the tensor cores as they are, fp32 operands stay IEEE fp32. Every element of the
tile is computed from its row of `a` and its column of `b` by the same MMA sequence over K, whose
order the fixed config (tiles, warps, stages from `CONFIGS` by arch and dtype) decides, so a row's
bits still do not depend on M or on its place in the tile. In the Triton interpreter a broadcast
multiply reduced with `tl.sum`, because the interpreter's `tl.dot` (a NumPy BLAS call) can give a
row different bits depending on its place in the tile (docs/hazards.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kvfid.kernels import FLOAT_DTYPES, LAUNCH_OPTIONS, gpu_arch, triton_runs_on, uses_tl_dot
from kvfid.kernels.dot import mma
from kvfid.kernels.jit import kernel


@dataclass(frozen=True)
class MatmulConfig:
    """One execution path's fixed tiling: a function of (arch, dtype), never of M."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool = True


INTERPRETER_CONFIG = MatmulConfig(16, 256, 64, num_warps=4, num_stages=1, use_dot=False)
# Sized for H100/H200 (and A100) by `kvfid compile`: no spills, shared memory within the limit.
# BLOCK_N 64 keeps a decode GEMV (M = 1) spread over many programs, since K is never split.
_HALF = MatmulConfig(128, 64, 64, num_warps=4, num_stages=3)
_FP32 = MatmulConfig(64, 64, 32, num_warps=8, num_stages=3)  # 4 warps / 2 stages spilled on triton 3.6
ARCHS = ("sm_80", "sm_90", "sm_100")
CONFIGS = {(arch, dtype): _FP32 if dtype == torch.float32 else _HALF
           for arch in ARCHS for dtype in FLOAT_DTYPES}

# Configs bucketed by M (bf16/fp16): a call of at most 128 rows takes 64 x 32 tiles, so a decode
# GEMV (M = 1 .. 16) at N = 4096 runs 128 programs instead of 64, one per SM of an H100 (an
# estimate from the grid, not a measurement). The reduction tile BLOCK_K is the same in every
# bucket, so a row's products are summed over the same K tiles in the same order; and BLOCK_M
# stays a multiple of 64, so on sm_90 every bucket runs warpgroup MMAs (HGMMA), never the
# mma.sync of a 16-row tile. Whether the MMA instruction's N (32 or 64) leaves a row's bits alone
# is a property of the hardware that only a GPU can show: tests/gpu/test_kernel_gpu_buckets.py checks
# every row of M = 1 against the same row inside M = 2048 for every bucket. Until that test has
# passed on an arch, and its name is added to BUCKETS_SHOWN, `config_for` there ignores M.
_SMALL_M_HALF = MatmulConfig(64, 32, 64, num_warps=4, num_stages=4)
# (max rows or None for the rest, config), in order; fp32 (IEEE products) keeps its one config.
BUCKETS = {(arch, dtype): ((None, _FP32),) if dtype == torch.float32
           else ((128, _SMALL_M_HALF), (None, _HALF))
           for arch in ARCHS for dtype in FLOAT_DTYPES}
BUCKETS_SHOWN: frozenset[str] = frozenset()  # archs whose GPU run passed the bucket test


@kernel
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    sab, sam, sak, sbb, sbk, sbn, scb, scm, scn, s_bias,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    # int64 indices: no overflow, and no per-operation int32 overflow checks in the interpreter.
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)  # bmm's batch axis (0 for a plain matmul)
    a_ptr += batch * sab
    b_ptr += batch * sbb
    c_ptr += batch * scb
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + (rm[:, None] * sam + rk[None, :] * sak)  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + (rk[:, None] * sbk + rn[None, :] * sbn)  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if USE_DOT:
            acc = mma(a, b, acc)
        else:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        a_ptrs += BLOCK_K * sak
        b_ptrs += BLOCK_K * sbk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn * s_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + (rm[:, None] * scm + rn[None, :] * scn)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])



def config_for(device: torch.device, dtype: torch.dtype, m: int | None = None) -> MatmulConfig:
    """The tiling used on `device` for `dtype`: fixed per execution path, or, on an arch in
    BUCKETS_SHOWN, the bucket of M (`m` rows) whose rows were shown equal to the other buckets'."""
    if not uses_tl_dot(device):
        return INTERPRETER_CONFIG
    arch = _arch(device)
    if m is not None and arch in BUCKETS_SHOWN:
        return bucket_for(BUCKETS[(arch, dtype)], m)
    return CONFIGS[(arch, dtype)]


def bucket_for(buckets, m: int) -> MatmulConfig:
    """The config of the first bucket (max rows, config) whose bound holds `m` rows."""
    return next(config for bound, config in buckets if bound is None or m <= bound)


@lru_cache(maxsize=None)
def _arch(device: torch.device) -> str:
    return gpu_arch(device)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
            config: MatmulConfig | None = None) -> torch.Tensor:
    """c[i] = a[i] @ b[i] (+ bias) for 3-D views a [Bt, M, K], b [Bt, K, N], c [Bt, M, N]."""
    batch, m, k = a.shape
    n = b.shape[2]
    if batch == 0 or m == 0 or n == 0:
        return c
    if k == 0:
        return c.copy_(bias.reshape(n).expand_as(c)) if bias is not None else c.zero_()
    config = config or config_for(a.device, a.dtype, m)
    block_m, block_n = config.block_m, config.block_n
    bias_arg = bias.reshape(n) if bias is not None else c  # any pointer when there is no bias
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), batch)
    _matmul_kernel[grid](
        a, b, c, bias_arg, m, n, k,
        *a.stride(), *b.stride(), *c.stride(), bias_arg.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=config.block_k,
        USE_DOT=config.use_dot, num_warps=config.num_warps, num_stages=config.num_stages,
        **LAUNCH_OPTIONS,
    )
    return c


def _check_operands(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if not triton_runs_on(a.device):
        raise ValueError(f"{name}: tensors on {a.device} need CUDA or the Triton interpreter "
                         "(TRITON_INTERPRET=1 set before triton is imported)")
    if a.dtype not in FLOAT_DTYPES or b.dtype != a.dtype:
        raise TypeError(f"{name} supports {FLOAT_DTYPES} with one dtype for both operands; got {a.dtype}, {b.dtype}")


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, config: MatmulConfig | None = None) -> torch.Tensor:
    """`a [M, K] @ b [K, N] (+ bias [N])` with fp32 accumulation; a row's bits do not depend on M.

    Any strides (a transposed weight needs no copy). The result has `out_dtype` (default a's).
    `config` overrides the path's tiling (tests run the GPU configs in the interpreter).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul expects a [M, K] and b [K, N]; got {tuple(a.shape)}, {tuple(b.shape)}")
    _check_operands("matmul", a, b)
    n = b.shape[1]
    if bias is not None and bias.shape not in ((n,), (1, n)):
        raise ValueError(f"bias must have shape [{n}] or [1, {n}]; got {tuple(bias.shape)}")
    c = torch.empty((a.shape[0], n), dtype=out_dtype or a.dtype, device=a.device)
    _launch(a.unsqueeze(0), b.unsqueeze(0), c.unsqueeze(0), bias, config)
    return c


def bmm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batched `a [Bt, M, K] @ b [Bt, K, N]`; a row's bits depend neither on M nor on Bt."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm expects a [Bt, M, K] and b [Bt, K, N]; got {tuple(a.shape)}, {tuple(b.shape)}")
    _check_operands("bmm", a, b)
    c = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=out_dtype or a.dtype, device=a.device)
    return _launch(a, b, c, None)


def matmul_ref(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch `a @ b (+ bias)`, 2-D or batched (any float dtype; use fp64 as the reference)."""
    out = a @ b
    return out + bias.reshape(-1) if bias is not None else out
