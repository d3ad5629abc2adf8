"""Batch-invariant RMSNorm and last-dim mean (Triton) and their PyTorch references.

Both reduce each row over its last dimension in fixed column tiles visited in order, with fp32
accumulators, so a row's bits depend only on the row. `mean_last_dim` is the reduction transformers'
Llama/Qwen2 RMSNorm actually calls (`aten::mean.dim` over the hidden size); `rms_norm` is the whole
norm in one kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfid.kernels import LAUNCH_OPTIONS, check_row_input
from kvfid.kernels.jit import device_function, kernel

BLOCK_ROWS = 16  # rows per program; fixed, never a function of the row count
BLOCK_COLS = 256  # columns per step of the in-order reduction
# rms_norm's warps on a GPU: with Triton's default 4 the sm_100 cubin keeps a 16-byte stack frame
# (STL/LDL); 8 has none on sm_80/90/100 (`kvfid compile`).
RMS_NORM_WARPS = 8



@device_function
def _row_sum_tile(x_ptr, rows, row_ok, sx_row, sx_col, n_cols, SQUARE: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Per-row sum of x (or x**2) over the columns, one fixed column tile at a time."""
    cols = tl.arange(0, BLOCK_COLS).to(tl.int64)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], tl.float32)
    for c0 in range(0, n_cols, BLOCK_COLS):
        mask = row_ok[:, None] & ((c0 + cols) < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * sx_row + (c0 + cols)[None, :] * sx_col,
                    mask=mask, other=0.0).to(tl.float32)
        if SQUARE:
            acc += x * x
        else:
            acc += x
    return tl.sum(acc, axis=1)


@kernel
def _mean_kernel(x_ptr, out_ptr, n_rows, n_cols, sx_row, sx_col,
                 BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    row_ok = rows < n_rows
    total = _row_sum_tile(x_ptr, rows, row_ok, sx_row, sx_col, n_cols, False, BLOCK_ROWS, BLOCK_COLS)
    tl.store(out_ptr + rows, (total / n_cols).to(out_ptr.dtype.element_ty), mask=row_ok)


@kernel
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, n_cols, sx_row, sx_col, so_row, eps,
                     HAS_WEIGHT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    row_ok = rows < n_rows
    sum_sq = _row_sum_tile(x_ptr, rows, row_ok, sx_row, sx_col, n_cols, True, BLOCK_ROWS, BLOCK_COLS)
    rstd = 1.0 / tl.sqrt_rn(sum_sq / n_cols + eps)  # [BLOCK_ROWS]
    cols = tl.arange(0, BLOCK_COLS).to(tl.int64)
    for c0 in range(0, n_cols, BLOCK_COLS):
        col_ok = (c0 + cols) < n_cols
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * sx_row + (c0 + cols)[None, :] * sx_col,
                    mask=mask, other=0.0).to(tl.float32)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + c0 + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * so_row + (c0 + cols)[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [rows, n] (a view when the layout allows)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def mean_last_dim(x: torch.Tensor, *, keepdim: bool = False,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mean over the last dimension with fp32 accumulation; a row's bits depend only on the row."""
    check_row_input("mean_last_dim", x)
    if x.dim() == 0:
        raise ValueError("mean_last_dim needs at least one dimension")
    out_dtype = dtype or x.dtype
    rows = _as_rows(x)
    n_rows, n_cols = rows.shape
    out = torch.empty(n_rows, dtype=out_dtype, device=x.device)
    if n_rows:
        if n_cols == 0:
            out.fill_(float("nan"))
        else:
            _mean_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](
                rows, out, n_rows, n_cols, rows.stride(0), rows.stride(1),
                BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, **LAUNCH_OPTIONS)
    out = out.reshape(x.shape[:-1])
    return out.unsqueeze(-1) if keepdim else out


def mean_last_dim_ref(x: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
    """Plain PyTorch mean over the last dimension."""
    return x.mean(dim=-1, keepdim=keepdim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """`x * rsqrt(mean(x**2, -1) + eps) * weight`, computed in fp32, returned in x's dtype."""
    check_row_input("rms_norm", x)
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")
    rows = _as_rows(x)
    n_rows, n_cols = rows.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows and n_cols:
        w = weight.contiguous() if weight is not None else out
        _rms_norm_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](
            rows, w, out, n_rows, n_cols, rows.stride(0), rows.stride(1), out.stride(0), float(eps),
            HAS_WEIGHT=weight is not None, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS,
            num_warps=RMS_NORM_WARPS, **LAUNCH_OPTIONS)
    return out.reshape(x.shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Plain PyTorch RMSNorm with the same contract (compute in x's dtype; pass fp64 for a reference)."""
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * weight if weight is not None else y
