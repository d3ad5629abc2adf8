"""Negative controls for `kvfid compile`: two kernels the GPU-path rules must reject.

Imported by the compile workers (not a test module): `kvfid compile` must flag the split-K matmul
for its atomics (partial sums land in an order the hardware picks) and the fp32-upcast bf16 matmul
for having no tensor-core instruction (what the kernels did before the tensor-core path).
"""

import triton
import triton.language as tl


@triton.jit
def split_k_atomic_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c += a[:, k-slice] @ b[k-slice, :], one K slice per program along axis 2."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + rm[:, None] * sam + rk[None, :] * sak,
                mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
    b = tl.load(b_ptr + rk[:, None] * sbk + rn[None, :] * sbn,
                mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
    partial = tl.dot(a, b)
    tl.atomic_add(c_ptr + rm[:, None] * scm + rn[None, :] * scn, partial,
                  mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def upcast_dot_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c = a @ b with bf16 operands upcast to fp32 and IEEE products: CUDA cores only."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * sam + (k0 + rk)[None, :] * sak,
                    mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k0 + rk)[:, None] * sbk + rn[None, :] * sbn,
                    mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))
