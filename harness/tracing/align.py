"""How `blame` aligns the ops of two calls when a recurrent layer is stepped, and which modules run
different algorithms on the two sides.

* **Stepped layers.** Under `kvfid.kernels.recurrence.faithful_recurrence`, a recurrent layer runs a
  call of several tokens one token at a time, so in a prefill its ops repeat once per token. Each
  op is keyed by its module path, a *tag* and the op: the tag is 0 for ordinary modules (one call
  per forward) and "p" for the step of a stepped layer that computes the blamed position (the one
  call of a one-token decode step, or step p - start of a longer call); ops of the other steps,
  the wrapper's own slicing, and the dropped first call that makes an empty cache's state (the
  token then runs again as a step from zero), belong to other positions or to no result, and are
  not compared.
* **Different algorithms.** A recurrent layer's chunked prefill and its decode step run different
  op sequences (a chunked scan and a triangular solve against a one-token recurrence): the ops
  found on one side only, grouped by module, name the layer whose two sides are not the same
  computation, and `diverging_modules` says so in the result, beside the culprits.
"""

from __future__ import annotations

from collections import Counter

import torch

from kvfid.kernels.recurrence import PRIMING, is_stepped, step_of

DIFFER = ("culprit", "inherited", "unverified")  # the op kinds whose boundary slice differs
SKIP = None  # the tag of an op that belongs to another position's step
# Ops that only move or copy bits: one side running an extra one is not another computation.
MOVES = {"clone", "copy_", "_to_copy", "cat", "stack", "constant_pad_nd", "index", "index_put_",
         "slice_scatter", "select_scatter", "_unsafe_view"}


class Tagger:
    """The alignment tag of each op of one traced call over positions [start, end)."""

    def __init__(self, module: torch.nn.Module, span: tuple[int, int], position: int):
        self._span, self._position = span, position
        self._stepped = {name: m for name, m in module.named_modules() if name and is_stepped(m)}
        self._seen: Counter = Counter()

    def _owner(self, where: str):
        for name, layer in self._stepped.items():
            if where == name or where.startswith(name + "."):
                return layer
        return None

    def key(self, where: str, op: str):
        """(module path, tag, op, occurrence) of this op, or None when it is not compared."""
        owner = self._owner(where)
        if owner is None:
            tag = 0
        else:
            step, (start, end) = step_of(owner), self._span
            if step == PRIMING:  # the call that makes the layer's state: its output is dropped
                tag = SKIP
            elif step is None:  # a one-token call, or the stepping wrapper's own ops
                tag = "p" if end - start == 1 else SKIP
            else:
                tag = "p" if start + step == self._position else SKIP
        if tag is SKIP:
            return None
        head = (where, tag, op)
        self._seen[head] += 1
        return (*head, self._seen[head] - 1)


def diverging_modules(only_a: list[str], only_b: list[str]) -> list[dict]:
    """Modules with computing ops (not only MOVES) found on one side only ("module op" strings):
    the module, how many ops each side alone runs there, and the first few op names of each."""
    by_module: dict[str, tuple[Counter, Counter]] = {}
    for side, ops in ((0, only_a), (1, only_b)):
        for entry in ops:
            module, _, op = entry.rpartition(" ")
            by_module.setdefault(module, (Counter(), Counter()))[side][op] += 1
    return [{"module": module or "(model)", "only_a": sum(a.values()), "only_b": sum(b.values()),
             "ops_a": sorted(a)[:6], "ops_b": sorted(b)[:6]} for module, (a, b) in by_module.items()
            if set(a) | set(b) - MOVES]


def render_diverging(only_a: list[str], only_b: list[str]) -> list[str]:
    """One line per module whose two sides are different computations: a culprit no aligned op shows."""
    return [f"culprit layer: {d['module']} runs different computations on the two sides: {d['only_a']} "
            f"op(s) only in a {d['ops_a']}, {d['only_b']} only in b {d['ops_b']}"
            for d in diverging_modules(only_a, only_b)]


def no_culprit_line(ops) -> str:
    """The verdict when no compared op differs, saying how many could not be compared."""
    n = sum(o.kind == "uncompared" for o in ops)
    return ("no culprit: every op gave the boundary position the same bits on both sides"
            + (f" ({n} op output(s) not comparable at it, e.g. MoE rows sorted by expert)" if n else ""))


def aggregate_of_unknowns(side_a, inputs_b, outputs_b, boundary) -> bool:
    """An op none of whose inputs can be sliced at the position and whose outputs have the same
    shapes on both sides (nothing to slice: e.g. MoE expert counts over all of a call's tokens):
    its outputs are compared whole, which says nothing about the position, so it is not evidence."""
    return (bool(inputs_b) and all(boundary(x, y) is None for x, y in zip(side_a.inputs, inputs_b))
            and all(x.shape == y.shape for x, y in zip(side_a.outputs, outputs_b)))
