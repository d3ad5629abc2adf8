"""Batch-invariant mode: swap batch-invariant kernels in for the aten ops a transformers model calls.

`set_batch_invariant_mode()` registers replacements for the ops that a Llama/Qwen2 forward reaches
(found with a TorchDispatchMode trace: `mm` for the projections and the LM head, `addmm` for
Qwen2's q/k/v biases, `bmm` for eager attention, `mean.dim` for RMSNorm, `_softmax` for eager
attention, `_log_softmax` for log-probabilities; plus `mm.dtype` where torch has a kernel for it) under the CPU and CUDA dispatch keys with
`torch.library.Library("aten", "IMPL")`, and removes them again on exit, also when the body
raises. Anything the replacements do not cover (other dtypes, 0-d or empty inputs, addmm with
alpha/beta) goes to the kernel that was registered before. Reductions over any dim are covered:
mean over any dims (moved last and flattened), (log-)softmax over any dim, `half_to_float`.

Three implementations:

* `"triton"` (the product): the Triton kernels of this package (`matmul`, `norm`, `softmax`);
  CPU tensors on a machine that runs Triton natively (no interpreter) take the rowwise path.
* `"rowwise"`: each row computed alone by the previously registered stock kernel, on a fresh copy
  of the row: invariant by construction, and much faster than the Triton interpreter on a CPU.
* `"tiled"`: the stock kernel on fixed tiles of rows (kvfid.kernels.invariant.tiled): one call shape whatever
  M, tile size and dtype route timed on this machine (kvfid.kernels.invariant.route), each (op, shape)
  probed before its tiles are trusted, row by row where the probe fails.

`stock_ops()` lets a block that already fixes its call shapes itself (the native attention's tiles,
kvfid.kernels.attention.native) reach the stock kernels directly while the mode is on.

The overrides are process-wide (all threads), like any dispatcher registration. Nested use is safe:
the innermost request wins and each exit restores what its entry found.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Callable

import torch

from contextlib import contextmanager

from kvfid.kernels.invariant import matmul as _matmul
from kvfid.kernels.invariant import route as _route
from kvfid.kernels.invariant import tiled as _tiled
from kvfid.kernels.invariant import ops as _mode_ops
from kvfid.kernels.invariant import complex_products as _complex
from kvfid.kernels.invariant import norm as _norm
from kvfid.kernels.invariant import softmax as _softmax
from kvfid.kernels import FLOAT_DTYPES, triton_runs_on

IMPLS = ("triton", "rowwise", "tiled")
DISPATCH_KEYS = ("CPU", "CUDA")
# aten overloads replaced while the mode is on (op name as torch.library spells it).
OVERRIDDEN_OPS = ("mm", "addmm", "bmm", "mean.dim", "_softmax", "_log_softmax")
# Their out= forms, which compiled code calls (inductor's extern kernels write into buffers): they
# run the functional override and copy its bits into `out`. Like WHERE_STOCK_OPS, replaced only
# under the keys where torch has a kernel for them (a CPU build has no CUDA `mm.out`).
OUT_OPS = ("mm.out", "addmm.out", "bmm.out")
# Replaced only under the dispatch keys where torch has a kernel for them: `mm.dtype` (e.g. bf16 in,
# fp32 out) has a CUDA kernel, but torch 2.13's CPU build has the overload with no CPU kernel, and
# the mode does not invent one.
WHERE_STOCK_OPS = ("mm.dtype",)

_lock = threading.RLock()
# (token, (impl, complex products) or None), innermost last
_requests: list[tuple[object, tuple[str, bool] | None]] = []
_installed: tuple[tuple[str, bool], torch.library.Library] | None = None
# The threads inside stock_ops() now, by ident: every overridden call tests it, so the common case
# (no thread inside) is one global read, not a thread-local attribute lookup.
_stock_threads: set[int] = set()


def _dense_float(*tensors: torch.Tensor) -> bool:
    first = tensors[0].dtype
    return all(t.layout == torch.strided and t.dtype == first for t in tensors) and first in FLOAT_DTYPES


def _reduced_last(x: torch.Tensor, dim) -> tuple[torch.Tensor, list[int]]:
    """x [..] with the reduced dims (all if `dim` is empty or None) moved last and flattened:
    ([*kept, n], the reduced dims, ascending). A copy only when the layout needs one."""
    dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims)
    return moved.reshape(*moved.shape[:len(kept)], -1), dims  # [*kept, n]


def _triton(impl: str, x: torch.Tensor) -> bool:
    """Use the Triton kernel? Not for CPU tensors on a CUDA machine (no interpreter): those take
    the rowwise path, which is batch-invariant too."""
    return impl == "triton" and triton_runs_on(x.device)


def _fresh(row: torch.Tensor) -> torch.Tensor:
    """A new, contiguous, allocator-aligned copy: every row reaches the stock kernel alike."""
    return row.clone(memory_format=torch.contiguous_format)


def _key(op: str, width: int, other: torch.Tensor | None, dtype: torch.dtype, *extra) -> tuple:
    """A tiled call's probe key: what fixes the stock call (op, width, dtype, the other operand's
    shape and layout); kvfid.kernels.invariant.tiled names it in words only where a probe fails."""
    layout = (tuple(other.shape), other.stride()) if other is not None else None
    return (op, width, layout, dtype, *extra)


def _rows_alone(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply `fn` to each row of x [..., n] as a [1, n] tensor; stack back to [..., m]."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([fn(_fresh(rows[i:i + 1])) for i in range(rows.shape[0])])
    return out.reshape(*x.shape[:-1], out.shape[-1])


# Each factory takes the implementation name and the previously registered kernel, and returns the
# replacement (called with the dispatch keyset first, as `with_keyset=True` asks).

def _mm(impl: str, original) -> Callable:
    def mm(keys, a, b):
        if not _dense_float(a, b) or a.shape[0] == 0:
            return original.call_boxed(keys, a, b)
        if _triton(impl, a):
            return _matmul.matmul(a, b)
        if impl == "tiled":
            return _tiled.product(_key("mm", a.shape[1], b, a.dtype),
                                  lambda t, w: original.call_boxed(keys, t, w), a, b)
        return torch.cat([original.call_boxed(keys, _fresh(a[i:i + 1]), b) for i in range(a.shape[0])])
    return mm


def _mm_dtype(impl: str, original) -> Callable:
    def mm_dtype(keys, a, b, out_dtype):
        if not _dense_float(a, b) or out_dtype not in FLOAT_DTYPES or a.shape[0] == 0:
            return original.call_boxed(keys, a, b, out_dtype)
        if _triton(impl, a):
            return _matmul.matmul(a, b, out_dtype=out_dtype)
        if impl == "tiled":
            call = lambda t, w: original.call_boxed(keys, t, w, out_dtype)   # noqa: E731
            return _tiled.by_tiles(_key("mm.dtype", a.shape[1], b, a.dtype, out_dtype),
                                   lambda t: call(t, b), a, probe=lambda: _tiled.on_stand_in(call, b))
        return torch.cat([original.call_boxed(keys, _fresh(a[i:i + 1]), b, out_dtype)
                          for i in range(a.shape[0])])
    return mm_dtype


def _addmm(impl: str, original) -> Callable:
    def addmm(keys, bias, a, b, *, beta=1, alpha=1):
        n = b.shape[1] if b.dim() == 2 else -1
        plain = beta == 1 and alpha == 1 and bias.shape in ((n,), (1, n))
        if not plain or not _dense_float(bias, a, b) or a.shape[0] == 0:
            return original.call_boxed(keys, bias, a, b, beta=beta, alpha=alpha)
        if _triton(impl, a):
            return _matmul.matmul(a, b, bias)
        if impl == "tiled":
            return _tiled.product(_key("addmm", a.shape[1], b, a.dtype, tuple(bias.shape)),
                                  lambda t, w, c: original.call_boxed(keys, c, t, w), a, b, bias)
        return torch.cat([original.call_boxed(keys, bias, _fresh(a[i:i + 1]), b)
                          for i in range(a.shape[0])])
    return addmm


def _bmm(impl: str, original) -> Callable:
    def bmm(keys, a, b):
        if not _dense_float(a, b) or a.shape[0] == 0 or a.shape[1] == 0:
            return original.call_boxed(keys, a, b)
        if _triton(impl, a):
            return _matmul.bmm(a, b)
        if impl == "tiled":
            key = _key("bmm", a.shape[2], b[0], a.dtype)
            return torch.stack([_tiled.product(key, lambda t, w: original.call_boxed(keys, t[None], w)[0],
                                               a[i], _fresh(b[i:i + 1])) for i in range(a.shape[0])])
        items = []
        for i in range(a.shape[0]):
            b_item = _fresh(b[i:i + 1])  # [1, K, N]
            items.append(torch.cat([original.call_boxed(keys, _fresh(a[i:i + 1, r:r + 1]), b_item)[0]
                                    for r in range(a.shape[1])]))
        return torch.stack(items)
    return bmm


def _mean_dim(impl: str, original) -> Callable:
    """Mean over any dims: the reduced dims are flattened last, so each output element is one
    row's reduction, computed alone (rowwise) or by the row kernel (triton)."""
    def mean_dim(keys, x, dim, keepdim=False, *, dtype=None):
        covered = _dense_float(x) and x.dim() > 0 and x.numel() > 0
        if not covered or (dtype is not None and dtype not in FLOAT_DTYPES):
            return original.call_boxed(keys, x, dim, keepdim, dtype=dtype)
        last = x.dim() - 1
        if impl == "tiled" and dim is not None and len(dim) == 1 and dim[0] % x.dim() == last:
            # the common case (a norm's mean over the last dim): no permute, one reshape each way
            flat = x.reshape(-1, x.shape[-1])  # [R, n]
            out = _tiled.by_tiles(_key("mean.dim", flat.shape[1], None, x.dtype, dtype),
                                  lambda t: original.call_boxed(keys, t, [-1], True, dtype=dtype), flat)
            return out.reshape(*x.shape[:-1], 1) if keepdim else out.reshape(x.shape[:-1])
        rows, dims = _reduced_last(x, dim)  # [*kept, n]
        if _triton(impl, x):
            out = _norm.mean_last_dim(rows, dtype=dtype)
        elif impl == "tiled":
            flat = rows.reshape(-1, rows.shape[-1])  # [R, n]
            out = _tiled.by_tiles(_key("mean.dim", flat.shape[1], None, x.dtype, dtype),
                                  lambda t: original.call_boxed(keys, t, [-1], True, dtype=dtype), flat)
            out = out.reshape(rows.shape[:-1])  # [*kept]
        else:
            out = _rows_alone(rows, lambda row: original.call_boxed(keys, row, [-1], True, dtype=dtype))
            out = out.squeeze(-1)  # [*kept]
        for d in dims if keepdim else ():
            out = out.unsqueeze(d)
        return out
    return mean_dim


def _softmax_like(log: bool) -> Callable:
    def factory(impl: str, original) -> Callable:
        def softmax(keys, x, dim, half_to_float):
            if not _dense_float(x) or x.numel() == 0 or x.dim() == 0:
                return original.call_boxed(keys, x, dim, half_to_float)
            out_dtype = torch.float32 if half_to_float else x.dtype
            if _triton(impl, x):
                fn = _softmax.log_softmax if log else _softmax.softmax
                return fn(x, dim, dtype=out_dtype)
            # The stock CPU kernel refuses half_to_float; an exact upcast of the row computes the
            # same function (fp32 math, fp32 out), as CUDA's does.
            moved = x.movedim(dim, -1).to(out_dtype)  # [..., n]
            if impl == "tiled":
                flat = moved.reshape(-1, moved.shape[-1])  # [R, n]
                name = "_log_softmax" if log else "_softmax"
                out = _tiled.by_tiles(_key(name, flat.shape[1], None, x.dtype, out_dtype),
                                      lambda t: original.call_boxed(keys, t, -1, False), flat,
                                      scale=3.0, reveal=False).reshape(moved.shape)
            else:
                out = _rows_alone(moved, lambda row: original.call_boxed(keys, row, -1, False))
            return out.movedim(-1, dim).contiguous()  # the stock op's layout
        return softmax
    return factory


def _out_form(functional: str) -> Callable:
    def factory(impl: str, original) -> Callable:
        op = getattr(torch.ops.aten, functional).default   # dispatches to the mode's override

        def out_kernel(keys, *args, out, **kwargs):
            result = op(*args, **kwargs)
            out.resize_(result.shape)
            return out.copy_(result)
        return out_kernel
    return factory


_FACTORIES = {
    "mm": _mm, "mm.dtype": _mm_dtype, "addmm": _addmm, "bmm": _bmm, "mean.dim": _mean_dim,
    "_softmax": _softmax_like(log=False), "_log_softmax": _softmax_like(log=True),
    **{op: _out_form(op.split(".")[0]) for op in OUT_OPS},
}
# MoE, recurrent-scan and element-wise ops (kernels/invariant/ops.py).
OVERRIDDEN_OPS, WHERE_STOCK_OPS, _FACTORIES = _mode_ops.extend(OVERRIDDEN_OPS, WHERE_STOCK_OPS, _FACTORIES)


def _install(impl: str, complex_products: bool) -> torch.library.Library:
    # Complex products served, or the ops that make a complex tensor guarded (complex_products.py).
    left_out = _complex.GUARD if complex_products else _complex.SERVE
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # Replacing aten kernels is the point; torch warns about it once per process.
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for key, op in itertools.product(DISPATCH_KEYS, OVERRIDDEN_OPS + OUT_OPS + WHERE_STOCK_OPS):
                if op in left_out:
                    continue
                # The kernel registered now (before ours) is the fallback and the "rowwise" worker.
                original = _stock_kernel(op, key)
                if original is not None and (key == "CPU" or op not in _mode_ops.CPU_ONLY_OPS):
                    stock = _mode_ops.STOCK_CALLS.get(op, _boxed)(original)
                    lib.impl(op, _unless_stock(_FACTORIES[op](impl, original), stock), key,
                             with_keyset=True)
    except BaseException:
        _remove(lib)
        raise
    return lib


def _boxed(original) -> Callable:
    """The stock kernel called as the dispatcher hands our kernel its arguments."""
    return original.call_boxed


def _unless_stock(replacement: Callable, stock: Callable) -> Callable:
    """The replacement, except inside `stock_ops()`, where `stock` (the stock kernel) runs."""
    def kernel(keys, *args, **kwargs):
        if _stock_threads and threading.get_ident() in _stock_threads:
            return stock(keys, *args, **kwargs)
        return replacement(keys, *args, **kwargs)
    return kernel


@contextmanager
def stock_ops():
    """Within the block (this thread), the overridden ops run their stock kernels even while the
    mode is on: for code that fixes every call's shape itself (kvfid.kernels.attention.native)."""
    ident = threading.get_ident()
    if ident in _stock_threads:          # nested: the outer block restores
        yield
        return
    _stock_threads.add(ident)
    try:
        yield
    finally:
        _stock_threads.discard(ident)


def _stock_kernel(op: str, key: str):
    """The kernel registered for `op` under `key` now; None for a WHERE_STOCK_OPS op without one."""
    try:
        return torch.library.get_kernel(f"aten::{op}", key)
    except RuntimeError:
        if op in OVERRIDDEN_OPS:
            raise
        return None


_route.use_stock_block(stock_ops)    # the tiled routes are timed on the stock kernels


def _remove(lib: torch.library.Library) -> None:
    # Destroying the library deregisters its kernels, which brings back the previous ones.
    lib._destroy()


def _apply(wanted: tuple[str, bool] | None) -> None:
    """Make the installed overrides match `wanted` ((impl, complex products); None: none installed)."""
    global _installed
    if (_installed[0] if _installed else None) == wanted:
        return
    if _installed is not None:
        _remove(_installed[1])
        _installed = None
    if wanted is not None:
        _installed = (wanted, _install(*wanted))


class set_batch_invariant_mode:  # noqa: N801  (named like the context managers it sits beside)
    """Within the block, the overridden aten ops run batch-invariant kernels; `enabled=False`
    turns them off inside an enclosing mode. Each exit restores what its entry found, also when the
    body raises. Nested and re-entrant use (the same object entered again) are both safe.
    `complex_products=False` (for a model that computes none: complex_products.makes_complex)
    leaves every product to the stock `mul` and refuses the ops that make a complex tensor."""

    def __init__(self, enabled: bool = True, *, impl: str = "triton", complex_products: bool = True):
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
        self._wanted = (impl, bool(complex_products)) if enabled else None
        self._tokens: list[object] = []

    @property
    def impl(self) -> str | None:
        """The implementation this mode installs on entry; None for a mode that turns them off."""
        return self._wanted[0] if self._wanted else None

    def __enter__(self) -> "set_batch_invariant_mode":
        token = object()
        with _lock:
            _requests.append((token, self._wanted))
            try:
                _apply(self._wanted)
            except BaseException:
                _requests.pop()
                _apply(_requests[-1][1] if _requests else None)
                raise
        self._tokens.append(token)
        return self

    def __exit__(self, *exc_info) -> bool:
        token = self._tokens.pop()
        with _lock:
            index = next(i for i, (t, _) in enumerate(_requests) if t is token)
            del _requests[index]
            _apply(_requests[-1][1] if _requests else None)
        return False


def batch_invariant_mode() -> str | None:
    """The implementation whose overrides are installed now ("triton", "rowwise", "tiled"), or None."""
    with _lock:
        return _installed[0][0] if _installed else None
