"""The batch-invariant mode's overrides for what MoE and recurrent (linear-attention, state-space)
layers run, beside the dense-decoder ones in `mode.py` (which adds these with `extend`).

Found by tracing MoE (Qwen3-MoE, gpt-oss, DeepSeek-V3) and Gated DeltaNet (Qwen3-Next) forwards
in transformers 5.24 with a TorchDispatchMode, and measuring which ops give a row different bits
alone than inside a batch (`tests/bench/mode_families.py`):

* `_grouped_mm` (transformers' default `grouped_mm` experts on CPU and CUDA): each row of a group
  is multiplied alone by its expert's weight, so a token's expert product does not depend on how
  many tokens the expert got;
* `sum.dim_IntList` (the top-k combine, l2norm, the recurrent step's state read) and `cumsum`
  (the chunked scan's decay): a pairwise tree and a doubling scan of element-wise adds, in an order
  fixed by the reduced length alone (a few launches, not one per row, so CUDA can afford it);
* `convolution` for a depthwise 1-d convolution (the causal conv1d and its update): a fixed-order
  sum over the taps, accumulated in fp32, so a position's output does not depend on the length of
  the call; other convolutions go to the stock kernel;
* `linalg_solve_triangular` (the chunked scan's UT transform): each matrix solved alone;
* `topk` (a sparse-attention indexer's key selection, a MoE router's experts): a stable sort, so
  among equal scores the lower index wins, whatever the row's width (the stock kernel breaks ties
  differently for rows of different widths: which keys a query selects would then depend on the
  construction before any rounding); the values come back in that order, `sorted` or not;
* element-wise transcendental functions (`exp`, `sigmoid`, `silu`, `softplus`, `tanh`, ...): on
  a CPU the stock kernel computes a vectorized body and a scalar tail, which can round
  differently, so an element's bits depend on where it sits in the tensor (measured: `silu`,
  `sigmoid` and `softplus` on an AVX-512 machine). The override hands the stock kernel a
  contiguous tensor of a multiple of `LANES` elements (the tensor itself where it is one, else a
  zero-padded copy), in single-threaded blocks of `BLOCK` elements: every element goes through
  the same vector code, whatever the tensor's size (functional overloads only: `out=` and
  in-place forms go to the stock kernel);
* complex `mul` (a complex rotary: Llama 4's `xq_ * freqs_cis`; kernels/invariant/complex_products.py):
  the real and imaginary parts from real element-wise mul, sub and add, whatever the operands'
  layout; installed only where a model may compute complex products, the ops that make a complex
  tensor guarded elsewhere. CPU only (CPU_ONLY_OPS).

The implementation name (`triton`, `rowwise`, ...) does not change these: each is the same
fixed-order computation under every implementation. Each factory has the signature of those in
`mode.py`: `(impl, previously registered kernel) -> replacement(keyset, *args)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvfid.kernels import FLOAT_DTYPES
from kvfid.kernels.invariant import complex_products as _complex

# Element-wise ops whose CPU kernel has a vector body and a scalar tail (transcendental functions);
# exact IEEE ops (add, mul, div, sqrt) round the same on both paths and are left alone.
ELEMENTWISE_OPS = ("exp", "sigmoid", "silu", "softplus", "tanh", "gelu", "log1p", "expm1", "erf",
                   "cos", "sin", "rsqrt", "log", "reciprocal")
REDUCTION_OPS = ("sum.dim_IntList", "cumsum")
MOE_OPS = ("_grouped_mm",)
SCAN_OPS = ("convolution", "linalg_solve_triangular")
SELECT_OPS = ("topk",)
COMPLEX_OPS = _complex.SERVE + _complex.GUARD
# Overridden on the CPU only: a CUDA complex product takes one path whatever the layout, and every
# product of a GPU stack would otherwise pass through Python.
CPU_ONLY_OPS = COMPLEX_OPS
OPS = MOE_OPS + REDUCTION_OPS + SCAN_OPS + SELECT_OPS + ELEMENTWISE_OPS + COMPLEX_OPS

LANES = 256     # a multiple of any CPU vector loop's step (2 x 512-bit vectors of 1-byte elements)
BLOCK = 16384   # elements per call: a multiple of LANES, below ATen's parallel grain (32768)


def _dense_float(*tensors: torch.Tensor) -> bool:
    first = tensors[0].dtype
    return all(t.layout == torch.strided and t.dtype == first for t in tensors) and first in FLOAT_DTYPES


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


# --- MoE ------------------------------------------------------------------------------------------

def _grouped_mm(impl: str, original) -> Callable:
    """x [S, K] rows sorted by group, w [G, K, N], offs [G] (cumulative row ends): row r of group
    g is x[r] @ w[g], computed alone."""
    def grouped_mm(keys, x, w, offs=None, bias=None, out_dtype=None):
        plain = offs is not None and bias is None and x.dim() == 2 and w.dim() == 3
        if not plain or not _dense_float(x, w) or x.shape[0] == 0:
            return original.call_boxed(keys, x, w, offs, bias, out_dtype)
        ends = offs.tolist()
        out = x.new_zeros(x.shape[0], w.shape[2], dtype=out_dtype or x.dtype)  # [S, N]
        start = 0
        for g, end in enumerate(ends):
            for r in range(start, min(end, x.shape[0])):
                out[r] = torch.mm(_fresh(x[r:r + 1]), w[g])[0].to(out.dtype)
            start = end
        return out
    return grouped_mm


# --- reductions -----------------------------------------------------------------------------------

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def tree_sum_last(rows: torch.Tensor) -> torch.Tensor:
    """rows [R, n] -> [R]: n zero-padded to a power of two, then halves added pairwise (element i
    with i + n/2) until one is left, in rows' dtype. Element-wise adds only, in an order fixed by
    n: a row's sum does not depend on R, on the device's reduction kernel, or on its split."""
    width = 1 << max(0, (rows.shape[-1] - 1).bit_length())
    x = torch.nn.functional.pad(rows, (0, width - rows.shape[-1])) if width != rows.shape[-1] else rows
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0]


def scan_last(rows: torch.Tensor) -> torch.Tensor:
    """rows [R, n] -> [R, n] inclusive prefix sums by doubling steps (Hillis-Steele): step s adds
    the value s places back. Position j's result depends on elements 0..j only, in an order fixed
    by j: not on R, nor on n."""
    x, step = rows, 1
    while step < x.shape[-1]:
        x = torch.cat([x[:, :step], x[:, step:] + x[:, :-step]], dim=1)
        step *= 2
    return x


def _sum_dim(impl: str, original) -> Callable:
    """Sum over any dims: the reduced dims flattened last, each row summed by `tree_sum_last` in
    fp32 (fp64 for fp64), rounded once to the output dtype."""
    def sum_dim(keys, x, dim, keepdim=False, *, dtype=None):
        covered = _dense_float(x) and x.dim() > 0 and x.numel() > 0
        if not covered or (dtype is not None and dtype not in FLOAT_DTYPES):
            return original.call_boxed(keys, x, dim, keepdim, dtype=dtype)
        dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
        kept = [d for d in range(x.dim()) if d not in dims]
        rows = x.permute(*kept, *dims).reshape(-1, math.prod(x.shape[d] for d in dims))  # [kept, n]
        out = tree_sum_last(rows.to(_acc_dtype(dtype or x.dtype))).to(dtype or x.dtype)
        out = out.reshape([x.shape[d] for d in kept])
        for d in dims if keepdim else ():
            out = out.unsqueeze(d)
        return out
    return sum_dim


def _cumsum(impl: str, original) -> Callable:
    """Cumulative sum along `dim` by `scan_last` in fp32 (fp64 for fp64), rounded once."""
    def cumsum(keys, x, dim, *, dtype=None):
        if not _dense_float(x) or x.dim() == 0 or x.numel() == 0 or (dtype is not None and dtype not in FLOAT_DTYPES):
            return original.call_boxed(keys, x, dim, dtype=dtype)
        moved = x.movedim(dim, -1)
        rows = moved.reshape(-1, moved.shape[-1]).to(_acc_dtype(dtype or x.dtype))  # [lines, n]
        out = scan_last(rows).to(dtype or x.dtype)
        return out.reshape(moved.shape).movedim(-1, dim).contiguous()
    return cumsum


# --- scans: causal conv1d, UT transform ---------------------------------------------------------

def _depthwise_1d(x: torch.Tensor, w: torch.Tensor, stride, padding, dilation, groups) -> bool:
    return (x.dim() == 3 and w.dim() == 3 and w.shape[1] == 1 and groups == x.shape[1] == w.shape[0]
            and list(stride) == [1] and list(dilation) == [1] and len(padding) == 1)


def conv1d_depthwise_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, padding: int) -> torch.Tensor:
    """x [B, C, T], w [C, 1, K]: out[b, c, t] = bias[c] + sum_k w[c, k] x_padded[b, c, t + k],
    the taps summed in order k = 0..K-1 in fp32, rounded once to x's dtype."""
    xp = torch.nn.functional.pad(x.float(), (padding, padding))  # [B, C, T + 2p]
    taps, n_out = w.shape[-1], xp.shape[-1] - w.shape[-1] + 1
    acc = torch.zeros(x.shape[0], x.shape[1], n_out, dtype=torch.float32, device=x.device)
    for k in range(taps):
        acc = acc + xp[..., k:k + n_out] * w[:, 0, k].float()[None, :, None]
    if bias is not None:
        acc = acc + bias.float()[None, :, None]
    return acc.to(x.dtype)  # [B, C, T + 2p - K + 1]


def _convolution(impl: str, original) -> Callable:
    def convolution(keys, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
        if transposed or not _dense_float(x, w) or not _depthwise_1d(x, w, stride, padding, dilation, groups):
            return original.call_boxed(keys, x, w, bias, stride, padding, dilation, transposed,
                                       output_padding, groups)
        return conv1d_depthwise_ref(x, w, bias, padding[0])
    return convolution


def _solve_triangular(impl: str, original) -> Callable:
    """A [..., n, n] X = B [..., n, k]: each matrix solved alone."""
    def solve_triangular(keys, a, b, *, upper, left=True, unitriangular=False):
        if not _dense_float(a, b) or a.dim() < 3 or a.shape[:-2] != b.shape[:-2] or a.numel() == 0:
            return original.call_boxed(keys, a, b, upper=upper, left=left, unitriangular=unitriangular)
        batch = a.shape[:-2]
        a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
        out = torch.stack([original.call_boxed(keys, _fresh(a3[i]), _fresh(b3[i]), upper=upper, left=left,
                                               unitriangular=unitriangular) for i in range(a3.shape[0])])
        return out.reshape(*batch, *out.shape[-2:])
    return solve_triangular


# --- selection ------------------------------------------------------------------------------------

def _topk(impl: str, original) -> Callable:
    """x [..., n] along `dim`: the k largest (smallest) by a stable sort: ties in index order."""
    def topk(keys, x, k, dim=-1, largest=True, sorted=True):
        if not _dense_float(x) or x.dim() == 0:
            return original.call_boxed(keys, x, k, dim, largest, sorted)
        order = torch.sort(x, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        order = order.contiguous()   # as stock topk returns it (a caller may .view(-1) it)
        return torch.gather(x, dim, order), order
    return topk


# --- element-wise ---------------------------------------------------------------------------------

def lane_uniform(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 fn_out: Callable[[torch.Tensor, torch.Tensor], object] | None = None) -> torch.Tensor:
    """fn (element-wise) with no element of x in a scalar tail or at a thread split, whatever x's
    size: x itself where it is contiguous and a multiple of LANES elements, else a contiguous copy
    padded with zeros to one, in calls of at most BLOCK elements (one call where it is no more),
    written by `fn_out(block, out)` into one output buffer where given."""
    n = x.numel()
    size = -(-n // LANES) * LANES
    if size == n and x.is_contiguous():             # lanes-whole already: no copy
        if n <= BLOCK:
            return fn(x)
        padded = x.view(-1)                                           # [size]
    else:
        padded = torch.constant_pad_nd(x.reshape(-1), (0, size - n))   # [size], zeros after x
    if size <= BLOCK:
        return fn(padded)[:n].view(x.shape)
    if fn_out is None:
        out = torch.cat([fn(padded[i:i + BLOCK]) for i in range(0, size, BLOCK)])
    else:
        out = torch.empty_like(padded)
        for i in range(0, size, BLOCK):
            fn_out(padded[i:i + BLOCK], out[i:i + BLOCK])
    return out[:n].view(x.shape)


def lane_uniform_(fn, x: torch.Tensor, room: torch.Tensor | None = None) -> torch.Tensor:
    """`lane_uniform` in place: fn (element-wise, through out=) over contiguous x, on calls of a multiple of LANES
    elements, at most BLOCK per call where a thread split could land inside one (one thread: no
    split), so no element is in a scalar tail; returns x. `room`: a flat buffer x starts at whose
    following elements may be overwritten (the call is rounded up inside it instead of copied)."""
    flat = x.view(-1)
    n = flat.numel()
    whole = -(-n // LANES) * LANES
    if room is not None and whole <= room.numel() and flat.data_ptr() == room.data_ptr():
        flat = room.narrow(0, 0, whole)
    if flat.numel() % LANES == 0 and (whole <= BLOCK or torch.get_num_threads() == 1):
        fn(flat, out=flat)
        return x
    work = flat if flat.numel() == whole else torch.cat([flat, flat.new_zeros(whole - n)])
    step = whole if torch.get_num_threads() == 1 else BLOCK
    for i in range(0, whole, step):
        part = work[i:i + step]
        fn(part, out=part)
    if work is not flat:
        flat.copy_(work[:n])
    return x


def _elementwise(name: str) -> Callable:
    """The factory of element-wise op `name`: its functional form through `lane_uniform`, the
    blocks of a tensor above BLOCK elements written by the op's `out=` form (the same structured
    kernel) into one buffer."""
    out_form = getattr(torch.ops.aten, name).out

    def factory(impl: str, original) -> Callable:
        def elementwise(keys, x, *args, **kwargs):
            if not (isinstance(x, torch.Tensor) and x.layout == torch.strided
                    and x.dtype in FLOAT_DTYPES and x.numel()):
                return original.call_boxed(keys, x, *args, **kwargs)
            return lane_uniform(lambda block: original.call_boxed(keys, block, *args, **kwargs), x,
                                lambda block, out: out_form(block, *args, out=out, **kwargs))
        return elementwise
    return factory


# The stock kernel as `mode.stock_ops()` calls it, where a plain boxed call would not take what a
# Python kernel receives.
STOCK_CALLS = _complex.STOCK_CALLS

FACTORIES = {"_grouped_mm": _grouped_mm, "sum.dim_IntList": _sum_dim, "cumsum": _cumsum,
             "convolution": _convolution, "linalg_solve_triangular": _solve_triangular,
             "topk": _topk, **_complex.FACTORIES,
             **{op: _elementwise(op) for op in ELEMENTWISE_OPS}}


def extend(ops: tuple[str, ...], where_stock: tuple[str, ...], factories: dict):
    """`mode.py`'s (overridden ops, ops replaced where torch has a kernel, factories) with these
    added to the second group (a CPU-only build has no CUDA kernel for some of them); `mode.py`'s
    own entries win."""
    added = tuple(op for op in OPS if op not in ops and op not in where_stock)
    return ops, where_stock + added, {**FACTORIES, **factories}
