"""Op tracing: every aten op of one forward, with the module path that ran it.

`trace(module, run, on_op)` runs `run()` under a TorchDispatchMode and calls
`on_op(module path, op name, float inputs, float outputs)` for each op that computes something
on floating-point data. Views and allocations are skipped, and so are ops with no float tensor
in or out: integer and boolean bookkeeping (a mask's checks, index arithmetic) carries no bits
blame could compare, and a model runs it by the call's shape, not its values (transformers
5.17's recurrent mask checks an all-ones mask with `eq` and `all` in a multi-token call only),
so recording it would report a structural difference where the computation is the same and
shift the occurrence count that aligns float ops of the same name. Tensors are detached copies
on the CPU, so the caller may keep or drop them as it likes. Used by `kvfid blame`.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Tracer(TorchDispatchMode):
    """Records (module path, op name, float inputs, float outputs) of every aten op."""

    def __init__(self, where: list[str], on_op):
        super().__init__()
        self.where, self.on_op = where, on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in _SKIPPED and not _is_view(func):
            inputs = _floats(tree_flatten((args, kwargs or {}))[0])
            outputs = _floats(tree_flatten(out)[0])
            if inputs or outputs:   # an integer/boolean-only op computes no float bits
                self.on_op(self.where[-1] if self.where else "", str(func.overloadpacket.__name__),
                           inputs, outputs)
        return out


# Ops that only allocate, describe or move memory; their outputs carry no computed bits.
_SKIPPED = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
            "full", "full_like", "arange", "detach", "detach_", "set_", "lift_fresh", "_local_scalar_dense", "sym_size",
            "sym_stride", "is_same_size", "new_empty", "new_zeros", "new_ones", "scalar_tensor"}


def _is_view(func) -> bool:
    """A view (transpose, reshape, select, ...) computes nothing: its bits are its input's. Views
    are not recorded, also because a view of a buffer that a kernel fills later would be compared
    before it is written."""
    returns = func._schema.returns
    alias = returns[0].alias_info if returns else None
    return alias is not None and not alias.is_write


def _floats(values) -> list[torch.Tensor]:
    return [v.detach().cpu().clone() for v in values
            if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _module_hooks(module: torch.nn.Module, where: list[str]) -> list:
    """Hooks that keep `where` the stack of module paths being run (hooks return None: a forward
    hook's return value would replace the module's output)."""
    def enter(name):
        def hook(_module, _args):
            where.append(name)
        return hook

    def leave(_module, _args, _out):
        where.pop()

    handles = []
    for name, sub in module.named_modules():
        if name:
            handles += [sub.register_forward_pre_hook(enter(name)), sub.register_forward_hook(leave)]
    return handles


def trace(module: torch.nn.Module, run, on_op) -> None:
    """Run `run()` (one forward) with every aten op reported to on_op(module, op, inputs, outputs)."""
    where: list[str] = []
    handles = _module_hooks(module, where)
    try:
        with _Tracer(where, on_op):
            run()
    finally:
        for handle in handles:
            handle.remove()
