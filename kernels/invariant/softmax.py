"""Batch-invariant softmax and log-softmax over the last dimension (Triton) and references.

Each row is reduced over fixed column tiles visited in order (an online max and sum of exponentials
in fp32), then normalized in a second pass; rows never interact, so a row's bits depend only on the
row, whatever the number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfid.kernels import LAUNCH_OPTIONS, check_row_input
from kvfid.kernels.jit import kernel

BLOCK_ROWS = 16  # rows per program; fixed, never a function of the row count
BLOCK_COLS = 512  # columns per step of the in-order reduction



@kernel
def _softmax_kernel(x_ptr, out_ptr, n_rows, n_cols, sx_row, sx_col, so_row,
                    LOG: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    row_ok = rows < n_rows
    # Rows past the end read the last real row (and are not stored): no all -inf rows, no NaN noise.
    src_rows = tl.minimum(rows, n_rows - 1)
    cols = tl.arange(0, BLOCK_COLS).to(tl.int64)

    m_i = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_ROWS], tl.float32)
    for c0 in range(0, n_cols, BLOCK_COLS):
        col_ok = (c0 + cols) < n_cols
        x = tl.load(x_ptr + src_rows[:, None] * sx_row + (c0 + cols)[None, :] * sx_col,
                    mask=col_ok[None, :], other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        # A row that is all -inf so far keeps m = -inf; guard its rescale against inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_i = s_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m_i = m_new

    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    if LOG:
        log_s = tl.log(s_i)
    else:
        inv_s = 1.0 / s_i
    for c0 in range(0, n_cols, BLOCK_COLS):
        col_ok = (c0 + cols) < n_cols
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + src_rows[:, None] * sx_row + (c0 + cols)[None, :] * sx_col,
                    mask=col_ok[None, :], other=float("-inf")).to(tl.float32)
        if LOG:
            y = (x - m_safe[:, None]) - log_s[:, None]
        else:
            y = tl.exp(x - m_safe[:, None]) * inv_s[:, None]
        tl.store(out_ptr + rows[:, None] * so_row + (c0 + cols)[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, log: bool, dtype: torch.dtype | None) -> torch.Tensor:
    check_row_input("log_softmax" if log else "softmax", x)
    rows = x.reshape(-1, x.shape[-1])
    n_rows, n_cols = rows.shape
    out = torch.empty((n_rows, n_cols), dtype=dtype or x.dtype, device=x.device)
    if n_rows and n_cols:
        _softmax_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](
            rows, out, n_rows, n_cols, rows.stride(0), rows.stride(1), out.stride(0),
            LOG=log, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, **LAUNCH_OPTIONS)
    return out.reshape(x.shape)


def _over_dim(x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype | None) -> torch.Tensor:
    if x.dim() == 0:  # a 0-d tensor is one row of one element, as torch treats it
        return _launch(x.reshape(1), log, dtype).reshape(())
    return _launch(x.movedim(dim, -1), log, dtype).movedim(-1, dim).contiguous()


def softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax over `dim` (fp32 internally); output in `dtype` (default x's dtype), contiguous."""
    return _over_dim(x, dim, False, dtype)


def log_softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Log-softmax over `dim` (fp32 internally); output in `dtype` (default x's dtype), contiguous."""
    return _over_dim(x, dim, True, dtype)


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Plain PyTorch softmax."""
    return torch.softmax(x, dim=dim)


def log_softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Plain PyTorch log-softmax."""
    return torch.log_softmax(x, dim=dim)
