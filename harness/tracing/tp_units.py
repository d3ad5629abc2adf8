"""What `blame` traces when a side runs tensor parallel: units, each read whole.

Two sides at different TP sizes run different aten ops inside a sharded layer (a product over
K/N and an all-reduce against one product over K; each rank's heads against all of them), so
their ops cannot be aligned one by one. Here each unit is reported as one op, with its tensors
whole: every `ParallelLinear` (kvfid.stacks.tp; a column-parallel output and a row-parallel input
gathered from the ranks), every child of a decoder layer (norms, attention, MLP: their inputs and
first output are whole on every rank), and every leaf outside the layers (embeddings, final
norm). A unit is aligned by its module path and kind, so `blame` names the first unit whose inputs
are bit-equal on both sides and whose output is not: a row-parallel product, a column-parallel
one, or the attention between them. Each ParallelLinear also says how it ran (`describe`), and a
row-parallel one at TP>1 whether the all-reduce's sum is the ranks' partial sums added in rank
order (then the parting is the product's split of the reduction axis, else the collective's sum).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from kvfid.stacks import tp
from kvfid.stacks.compiled import units
from kvfid.states.cache import bits_equal


def _floats(values) -> list[torch.Tensor]:
    return [v.detach().cpu().clone() for v in tree_flatten(values)[0]
            if isinstance(v, torch.Tensor) and v.is_floating_point()]


def describe(layer: tp.ParallelLinear, rank_sum: bool | None) -> tuple[str, str]:
    """How one ParallelLinear ran: the op it names (a row-parallel layer at TP>1 whose all-reduce
    is not the partials' rank-order sum names the all-reduce) and, in words, its products."""
    kind, size = layer.kind, layer.size
    op = "all_reduce" if rank_sum is False else f"{kind}-parallel product"
    if layer.invariant:
        how = (f"TP={size}, TP-invariant: fixed "
               + ("segments, their sums gathered and added in one tree" if kind == "row"
                  else "output pieces"))
    elif size == 1:
        how = "TP=1: one product"
    elif kind == "row":
        how = (f"TP={size}: each rank's product over 1/{size} of K, then all_reduce"
               + (" (= the partial sums added in rank order)" if rank_sum else
                  " (not the partial sums added in rank order)"))
    else:
        how = f"TP={size}: each rank's 1/{size} of the outputs" + (", gathered" if kind == "vocab" else "")
    return op, how


def trace(module: torch.nn.Module, run, on_op, notes: dict[str, tuple[str, str]] | None = None) -> None:
    """`optrace.trace`'s contract at the granularity of TP units: run `run()` with each unit's
    call reported as on_op(path, kind, whole inputs, whole first output); `notes[path]` gets the
    op each ParallelLinear names and how it ran (`describe`)."""
    chosen = dict(units(module))
    linears = {name: sub for name, sub in module.named_modules() if isinstance(sub, tp.ParallelLinear)}
    handles = []

    def report(name, sub):
        def hook(_unit, args, kwargs, output):
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            first = output[0] if isinstance(output, tuple) else output
            if isinstance(sub, tp.ParallelLinear):
                inputs, first = _whole(sub, inputs[0], first)
                if notes is not None:
                    notes[name] = describe(sub, _rank_sum(sub))
                on_op(name, f"{sub.kind}-parallel", _floats(inputs), _floats(first))
            else:
                on_op(name, "unit", _floats(inputs), _floats(first))
        return hook

    for name, sub in {**chosen, **linears}.items():
        handles.append(sub.register_forward_hook(report(name, sub), with_kwargs=True))
    tp.ParallelLinear.recording = True
    try:
        run()
    finally:
        tp.ParallelLinear.recording = False
        for layer in linears.values():
            layer.last_partial = None
        for handle in handles:
            handle.remove()


def _whole(layer: tp.ParallelLinear, x: torch.Tensor, out: torch.Tensor):
    """The layer's input and output with every rank's slice gathered."""
    if layer.size > 1 and layer.kind == "row":
        x = tp.gather(x, -1)
    if layer.size > 1 and layer.kind == "column":
        out = tp.gather(out, -1)
    return [x], out


def _rank_sum(layer: tp.ParallelLinear) -> bool | None:
    """A stock row-parallel layer at TP>1: whether its all-reduce gave the partial sums added in
    rank order (None for any other layer)."""
    partial = getattr(layer, "last_partial", None)
    if partial is None or layer.size == 1 or layer.kind != "row" or layer.invariant:
        return None
    mine, reduced = partial
    parts = tp.gather(mine[None], 0)
    total = parts[0]
    for part in parts[1:]:
        total = total + part

    return bits_equal(total, reduced)
