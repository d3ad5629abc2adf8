"""Blame: which operation first makes the boundary position's bits depend on the construction.

Two constructions compute the boundary position (the last position of P) differently: the step
that feeds P's last token over a cache of the rest (what live decoding and teacher-forcing do),
and one call over all of P (prefill) or the last chunk of a chunked construction. `blame()`
traces every aten op of both computations (a TorchDispatchMode; the module path of each op comes
from forward hooks), aligns the two sequences by (module path, op, occurrence), and for each
aligned pair compares the boundary position's slice of every float input and output bit by bit:

* where the two sides' shapes differ in one dimension (`T` vs 1: [T, K] vs [1, K]), the slice is
  the last index of that dimension; where they agree (the K/V of all of P), the whole tensor;
* an op is a **culprit** when its inputs are bit-equal on both sides and its output is not (that
  kernel is not invariant), and **inherited** when an input already differed. An op with a
  differing output and an input that cannot be compared (shapes differing in more than one
  dimension; or the KV cache of earlier positions, which side a built in earlier decode steps and
  side b builds in the same call) is **unverified**.

Only the comparisons are kept, not the tensors, so a prefill of any length fits in memory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.cache import _ordered, bits_equal
from harness.decode import Runner, as_batch, new_cache
from harness.protocol import parse_construction, run_live


@dataclass
class Side:
    """One traced op's tensors on one side: float inputs and outputs, moved to the CPU."""

    shapes_in: list[tuple]
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


@dataclass
class OpVerdict:
    """One aligned op: where, what, shapes on both sides, and how its boundary slices compare."""

    index: int
    module: str
    op: str
    shapes_a: list[tuple]
    shapes_b: list[tuple]
    inputs: str  # "equal", "differ" or "unknown" (an input pair not comparable)
    output_equal: bool
    n_diff: int = 0
    max_abs: float = 0.0
    max_ulp: int = 0

    @property
    def kind(self) -> str:
        if self.output_equal:
            return "equal"
        return {"equal": "culprit", "differ": "inherited", "unknown": "unverified"}[self.inputs]


@dataclass
class BlameResult:
    """The aligned op list of two constructions of the boundary position."""

    a: str
    b: str
    prefix_length: int
    ops: list[OpVerdict] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)

    @property
    def culprits(self) -> list[OpVerdict]:
        return [o for o in self.ops if o.kind == "culprit"]

    def to_json(self) -> dict:
        culprits = self.culprits
        return {"a": self.a, "b": self.b, "prefix_length": self.prefix_length,
                "ops_aligned": len(self.ops), "ops_differing": sum(o.kind != "equal" for o in self.ops),
                "first_culprit": _op_json(culprits[0]) if culprits else None,
                "culprits": [_op_json(o) for o in culprits],
                "only_a": self.only_a, "only_b": self.only_b}


def _op_json(op: OpVerdict) -> dict:
    return {**asdict(op), "kind": op.kind}


class _Tracer(TorchDispatchMode):
    """Records (module path, op name, float inputs, float outputs) of every aten op."""

    def __init__(self, where: list[str], on_op):
        super().__init__()
        self.where, self.on_op = where, on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in _SKIPPED and not _is_view(func):
            self.on_op(self.where[-1] if self.where else "", str(func.overloadpacket.__name__),
                       _floats(tree_flatten((args, kwargs or {}))[0]), _floats(tree_flatten(out)[0]))
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


def _trace(module: torch.nn.Module, run, on_op) -> None:
    """Run `run()` (one forward) with every aten op reported to on_op(module, op, inputs, outputs)."""
    where: list[str] = []
    handles = _module_hooks(module, where)
    try:
        with _Tracer(where, on_op):
            run()
    finally:
        for handle in handles:
            handle.remove()


def _boundary(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The boundary position's slices of two corresponding tensors, or None when their shapes
    differ in more than one dimension (not comparable)."""
    if a.dim() != b.dim():
        return None
    differing = [d for d in range(a.dim()) if a.shape[d] != b.shape[d]]
    if not differing:
        return a, b
    if len(differing) > 1:
        return None
    d = differing[0]
    return a.select(d, a.shape[d] - 1), b.select(d, b.shape[d] - 1)


def _compare(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> str:
    """"equal" when every pair's boundary slices have the same bits, "differ" when one does not,
    "unknown" when none differs but some pair cannot be compared."""
    if len(xs) != len(ys):
        return "unknown"
    verdict = "equal"
    for x, y in zip(xs, ys):
        pair = _boundary(x, y)
        if pair is None or pair[0].dtype != pair[1].dtype:
            verdict = "unknown"
        elif not bits_equal(*pair):
            return "differ"
    return verdict


def _diff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> tuple[int, float, int]:
    """Elements differing, max |diff| and max ULP over the comparable output slices."""
    n, worst, ulp = 0, 0.0, 0
    for x, y in zip(xs, ys):
        pair = _boundary(x, y)
        if pair is None or pair[0].dtype != pair[1].dtype or bits_equal(*pair):
            continue
        x, y = (p.contiguous() for p in pair)
        n += int((x != y).sum()) or 1
        worst = max(worst, float((x.double() - y.double()).abs().max()))
        ulp = max(ulp, int((_ordered(x) - _ordered(y)).abs().max()))
    return n, worst, ulp


def blame(module: torch.nn.Module, prefix: list[int], prompt_length: int,
          against: str = "prefill") -> BlameResult:
    """Trace the step that feeds P's last token over an incrementally built cache (side a) and
    the `against` construction's call that computes P's last position (side b); classify each op.
    `module` is a model prepared by a stack (`Stack.activate`)."""
    construction = parse_construction(against)
    if construction.kind not in ("prefill", "chunked"):
        raise ValueError(f"blame compares the decode step with `prefill` or `chunked:N`; got {against!r}")
    if len(prefix) < 2:
        raise ValueError("blame needs a boundary prefix of at least 2 tokens")
    runner = Runner(module)
    # Side a: the cache over P[:-1] as live decoding builds it (prompt, then one token at a time).
    cache_a = new_cache(module)
    runner.forward(as_batch(prefix[:prompt_length]), cache_a)
    for token in prefix[prompt_length:-1]:
        runner.forward(as_batch([token]), cache_a)
    # Side b: everything before the chunk that holds P's last position, then that chunk.
    sizes = construction.chunk_sizes(prompt_length, len(prefix))
    cache_b, start = new_cache(module), 0
    for size in sizes[:-1]:
        runner.forward(as_batch(prefix[start:start + size]), cache_b)
        start += size

    side_a: dict[tuple, Side] = {}
    order_a: list[tuple] = []
    seen: Counter = Counter()

    def record_a(where, op, inputs, outputs):
        key = (where, op, seen[(where, op)])
        seen[(where, op)] += 1
        side_a[key] = Side([tuple(t.shape) for t in inputs], inputs, outputs)
        order_a.append(key)

    _trace(module, lambda: runner.forward(as_batch(prefix[-1:]), cache_a), record_a)

    result = BlameResult("incremental (decode step)", construction.label, len(prefix))
    seen_b: Counter = Counter()
    matched: set[tuple] = set()

    def record_b(where, op, inputs, outputs):
        key = (where, op, seen_b[(where, op)])
        seen_b[(where, op)] += 1
        a = side_a.get(key)
        if a is None:
            result.only_b.append(f"{where} {op}")
            return
        matched.add(key)
        verdict = OpVerdict(len(result.ops), where, op, a.shapes_in, [tuple(t.shape) for t in inputs],
                            _compare(a.inputs, inputs), _compare(a.outputs, outputs) == "equal")
        if not verdict.output_equal:
            verdict.n_diff, verdict.max_abs, verdict.max_ulp = _diff(a.outputs, outputs)
        result.ops.append(verdict)

    _trace(module, lambda: runner.forward(as_batch(prefix[start:]), cache_b), record_b)
    result.only_a = [f"{w} {o}" for (w, o, _) in order_a if (w, o, _) not in matched]
    return result


def blame_item(model, stack, prompt: list[int], boundary: int, against: str = "prefill") -> BlameResult:
    """Generate P live (the prompt and `boundary` greedy tokens) on `stack`, then `blame()` the
    computation of P's last position there."""
    with stack.activate(model) as module:
        live = run_live(module, prompt, boundary, 0, model.codec.eos_ids)
        if live.state is None:
            raise ValueError(f"the live run met the end-of-turn token after {len(live.generated.tokens)} "
                             f"of B={boundary} tokens: lower -B")
        return blame(module, list(live.state.prefix), len(prompt), against)


def render(result: BlameResult, stack_label: str, limit: int = 10) -> str:
    """The blame as text: the first culprit in full, then the other culprits."""
    culprits = result.culprits
    lines = [f"kvfid blame  stack {stack_label}  |P| = {result.prefix_length}",
             f"a: {result.a}   b: {result.b}",
             f"{len(result.ops)} ops aligned, {sum(o.kind != 'equal' for o in result.ops)} with a "
             f"differing boundary slice, {len(culprits)} culprit(s)"]
    unverified = [o for o in result.ops if o.kind == "unverified"]
    if not culprits and all(o.kind == "equal" for o in result.ops):
        lines.append("no culprit: every op gave the boundary position the same bits on both sides")
    elif not culprits and unverified:
        first = unverified[0]
        lines.append(f"no culprit: the difference first shows at {first.op} in {first.module} (op "
                     f"#{first.index}), an op with an input that cannot be compared (e.g. the cache of "
                     "earlier positions); blame a shorter prefix (-B) to trace where it starts")
    elif not culprits:
        lines.append("no culprit among aligned ops (the difference enters through an unaligned op)")
    for i, op in enumerate(culprits[:limit]):
        head = "first culprit" if i == 0 else "culprit"
        lines.append(f"{head}: {op.op} in {op.module or '(model)'} (op #{op.index})")
        lines.append(f"  input shapes  a {op.shapes_a}  b {op.shapes_b}")
        lines.append(f"  output: {op.n_diff} element(s) differ, max |diff| {op.max_abs:.3g}, "
                     f"max ULP {op.max_ulp} (through zero)")
    if len(culprits) > limit:
        lines.append(f"... {len(culprits) - limit} more culprit(s) (--format json lists all)")
    if result.only_a or result.only_b:
        lines.append(f"unaligned ops: {len(result.only_a)} only in a, {len(result.only_b)} only in b")
    return "\n".join(lines)
