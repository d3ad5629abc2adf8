"""Blame: which operation first makes the boundary position's bits depend on the construction.

Two constructions compute a position of P in different calls: incremental decoding (the prompt
in one call, then one token at a time: what live decoding does) and one call over all of P
(prefill) or the chunk that holds it. `first_differing_position()` finds the lowest position
whose keys or values differ in some layer; `blame()` traces every aten op of the two calls that
compute that position (a TorchDispatchMode; the module path of each op comes from forward
hooks), aligns the two sequences by (module path, op, occurrence), and for each aligned pair
compares the position's slice of every float input and output bit by bit:

* a dimension whose size is each call's length is a query dimension (the position's row is
  taken); one whose size is each side's cache length is a key dimension (keys up to the position
  are kept); equal sizes are compared whole;
* an op is a **culprit** when its inputs are bit-equal on both sides and its output is not (that
  kernel is not invariant), and **inherited** when an input already differed. An op with a
  differing output and an input that cannot be compared (shapes differing in more than one
  dimension; or the KV cache of earlier positions, which side a built in earlier decode steps and
  side b builds in the same call) is **unverified**; one whose output (or every input) cannot be
  sliced at the position (MoE rows sorted by expert) is **uncompared**, not a difference.
Stepped recurrent layers and layers running different algorithms: see kvfid.tracing.align. Only the
comparisons are kept, not the tensors, so a prefill of any length fits in memory.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import torch

from kvfid.tracing import align
from kvfid.tracing.slices import Spans, boundary as _boundary, compare as _compare, diff as _diff
from kvfid.records.record import CacheDiff
from kvfid.states.cache import bits_equal
from kvfid.protocol.decode import Runner, as_batch, new_cache
from kvfid.tracing.optrace import trace
from kvfid.protocol.protocol import parse_construction
from kvfid.states import cache as kv


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
    output_comparable: bool = True  # False: e.g. MoE rows sorted by expert, sized T x top-k
    n_diff: int = 0
    max_abs: float = 0.0
    max_ulp: int = 0

    @property
    def kind(self) -> str:
        verdicts = {"equal": "culprit", "differ": "inherited", "unknown": "unverified"}
        return "equal" if self.output_equal else verdicts[self.inputs] if self.output_comparable else "uncompared"


@dataclass
class BlameResult:
    """The aligned op list of two constructions of the boundary position."""

    a: str
    b: str
    prefix_length: int
    position: int
    ops: list[OpVerdict] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    # A compiled stack whose units, each compiled alone, show no culprit: the decoder layer whose
    # state first differs when the forward is compiled whole, and which part.
    whole_forward: dict | None = None

    @property
    def culprits(self) -> list[OpVerdict]:
        return [o for o in self.ops if o.kind == "culprit"]

    def to_json(self) -> dict:
        culprits = self.culprits
        return {"a": self.a, "b": self.b, "prefix_length": self.prefix_length, "position": self.position,
                "ops_aligned": len(self.ops), "ops_differing": sum(o.kind in align.DIFFER for o in self.ops),
                "first_culprit": _op_json(culprits[0]) if culprits else None,
                "culprits": [_op_json(o) for o in culprits],
                "only_a": self.only_a, "only_b": self.only_b,
                "diverging_modules": align.diverging_modules(self.only_a, self.only_b),
                "whole_forward": self.whole_forward}


def _op_json(op: OpVerdict) -> dict:
    return {**asdict(op), "kind": op.kind}


def _spans(sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def _constructions(prefix: list[int], prompt_length: int, against: str) -> tuple[list, list]:
    """The calls (position spans) of side a (incremental: the prompt, then one token at a time,
    as live decoding runs) and of side b (`against`: prefill or chunked:N)."""
    construction = parse_construction(against)
    if construction.kind not in ("prefill", "chunked"):
        raise ValueError(f"blame compares incremental decoding with `prefill` or `chunked:N`; got {against!r}")
    if len(prefix) < 2 or not 0 < prompt_length <= len(prefix):
        raise ValueError("blame needs a boundary prefix of at least 2 tokens that holds the prompt")
    side_a = _spans(parse_construction("incremental").chunk_sizes(prompt_length, len(prefix)))
    return side_a, _spans(construction.chunk_sizes(prompt_length, len(prefix)))


def _build(module, runner: Runner, prefix: list[int], spans: list[tuple[int, int]]):
    """A cache fed the calls of `spans` in order (kvfid.protocol.decode.Cached); the last call's
    logits [1, V]."""
    cached, logits = new_cache(module), None
    for start, end in spans:
        logits, cached = runner.forward(as_batch(prefix[start:end]), cached)
    return cached, logits


def first_differing_position(module, prefix: list[int], prompt_length: int, against: str = "prefill",
                             side_b=contextlib.nullcontext):
    """The lowest position whose keys or values differ in some layer between the two sides'
    caches over all of P (None when they are bit-exact, the logits included; P's last position
    when only a state without positions, recurrent or conv, differs). `side_b()`: the context
    side b is built in (an arm at another TP size)."""
    diff, logits_equal = _states_compared(module, prefix, prompt_length, against, side_b)
    if diff.bit_exact:
        return None if logits_equal else len(prefix) - 1
    if diff.first_position is None:   # only a recurrent or conv state differs: it has no
        return len(prefix) - 1           # positions, so P's last is the first one we can name
    return diff.first_position


def _states_compared(module, prefix: list[int], prompt_length: int, against: str,
                     side_b=contextlib.nullcontext) -> tuple[CacheDiff, bool]:
    """The two sides' boundary states over all of P compared (cache.compare_states), and
    whether their last logits are bit-equal."""
    spans_a, spans_b = _constructions(prefix, prompt_length, against)
    runner = Runner(module)
    cache_a, logits_a = _build(module, runner, prefix, spans_a)
    state_a = kv.snapshot(cache_a.cache, prefix, logits_a, config=module.config)
    with side_b():
        cache_b, logits_b = _build(module, runner, prefix, spans_b)
        state_b = kv.snapshot(cache_b.cache, prefix, logits_b, config=module.config)
    diff = kv.compare_states(state_a, state_b)
    return diff, bits_equal(logits_a, logits_b)


def whole_forward_difference(module, prefix: list[int], prompt_length: int,
                             against: str) -> dict | None:
    """Under a compiled stack: the decoder layer (module path) whose state first differs between
    the two sides with the forward compiled whole, and its part; None when none differs."""
    diff, _ = _states_compared(module, prefix, prompt_length, against)
    layer, count = diff.first_bad_layer, module.config.get_text_config().num_hidden_layers
    if layer is None:
        return None
    stack = next((name for name, sub in module.named_modules()
                  if isinstance(sub, torch.nn.ModuleList) and len(sub) == count), "layers")
    return {"layer": layer, "part": diff.first_bad_kv, "module": f"{stack}.{layer}",
            "first_position": diff.first_position}


def blame(module: torch.nn.Module, prefix: list[int], prompt_length: int,
          against: str = "prefill", position: int | None = None, tracer=trace,
          side_b=contextlib.nullcontext) -> BlameResult:
    """Trace the call that computes `position` (default: P's last) in incremental decoding (side
    a: the prompt's prefill, or the decode step of that token) and in the `against`
    construction (side b), each over the cache its earlier calls built; classify each op by the
    bits of that position's slices. `module` is a model prepared by a stack (`Stack.activate`).
    `tracer`: `optrace.trace` (every aten op) or, for a compiled stack, `compiled.trace_units`
    (each compiled unit: compiled code runs no aten op one by one) or, across TP sizes,
    `tp_units.trace`; `side_b()`: the context side b runs in (an arm at another TP size)."""
    spans_a, spans_b = _constructions(prefix, prompt_length, against)
    p = len(prefix) - 1 if position is None else position
    if not 0 <= p < len(prefix):
        raise ValueError(f"position {p} is outside P (0..{len(prefix) - 1})")
    span_a = next(span for span in spans_a if span[0] <= p < span[1])
    span_b = next(span for span in spans_b if span[0] <= p < span[1])
    spans = Spans(span_a, span_b, p)
    runner = Runner(module)
    cache_a, _ = _build(module, runner, prefix, spans_a[:spans_a.index(span_a)])
    with side_b():
        cache_b, _ = _build(module, runner, prefix, spans_b[:spans_b.index(span_b)])

    side_a: dict[tuple, Side] = {}
    order_a: list[tuple] = []
    tag_a, tag_b = align.Tagger(module, span_a, p), align.Tagger(module, span_b, p)  # stepped recurrent layers

    def record_a(where, op, inputs, outputs):
        if (key := tag_a.key(where, op)) is None:
            return
        side_a[key] = Side([tuple(t.shape) for t in inputs], inputs, outputs)
        order_a.append(key)

    # Every position's logits, so lm_head's row at p is computed on both sides (kept to the last
    # position, each side's lm_head would see its own call's last row, which need not be p).
    tracer(module, lambda: runner.forward_all(as_batch(prefix[span_a[0]:span_a[1]]), cache_a), record_a)

    kind_a = "prompt prefill" if span_a[0] == 0 and span_a[1] > 1 else "decode step"
    result = BlameResult(f"incremental ({kind_a})", parse_construction(against).label, len(prefix), p)
    matched: set[tuple] = set()

    def record_b(where, op, inputs, outputs):
        if (key := tag_b.key(where, op)) is None:
            return
        a = side_a.get(key)
        if a is None:
            result.only_b.append(f"{where} {op}")
            return
        matched.add(key)
        out = _compare(a.outputs, outputs, spans)
        opaque = align.aggregate_of_unknowns(a, inputs, outputs, lambda x, y: _boundary(x, y, spans))
        verdict = OpVerdict(len(result.ops), where, op, a.shapes_in, [tuple(t.shape) for t in inputs],
                            _compare(a.inputs, inputs, spans), out == "equal", out != "unknown" and not opaque)
        if not verdict.output_equal:
            verdict.n_diff, verdict.max_abs, verdict.max_ulp = _diff(a.outputs, outputs, spans)
        result.ops.append(verdict)

    with side_b():
        tracer(module, lambda: runner.forward_all(as_batch(prefix[span_b[0]:span_b[1]]), cache_b),
               record_b)
    result.only_a = [f"{key[0]} {key[2]}" for key in order_a if key not in matched]
    return result


def render(result: BlameResult, stack_label: str, limit: int = 10) -> str:
    """The blame as text: the first culprit in full, then the other culprits."""
    culprits = result.culprits
    lines = [f"kvfid blame  stack {stack_label}  |P| = {result.prefix_length}  position {result.position}",
             f"a: {result.a}   b: {result.b}",
             f"{len(result.ops)} ops aligned, {sum(o.kind in align.DIFFER for o in result.ops)} with a "
             f"differing boundary slice, {len(culprits)} culprit(s)"]
    unverified = [o for o in result.ops if o.kind == "unverified"]
    if not culprits and all(o.kind not in align.DIFFER for o in result.ops):
        lines.append(align.no_culprit_line(result.ops))
    elif not culprits and unverified:
        first = unverified[0]
        lines.append(f"no culprit: the difference first shows at {first.op} in {first.module} (op "
                     f"#{first.index}), an op with an input that cannot be compared (e.g. the cache of "
                     "earlier positions); blame a shorter prefix (-B) to trace where it starts")
    elif not culprits and not result.whole_forward:
        lines.append("no culprit among aligned ops (the difference enters through an unaligned op)")
    if result.whole_forward:
        w = result.whole_forward
        lines.append(f"compiled whole, not alone: each unit compiled alone gives position "
                     f"{result.position} the same bits on both sides (no culprit), but with the "
                     f"forward compiled whole (inductor fusing across units, dynamo's graph "
                     f"breaks) the state first differs in {w['module']} (layer {w['layer']}, "
                     f"{(w['part'] or '?').upper()}, position {w['first_position']})")
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
        lines.extend(align.render_diverging(result.only_a, result.only_b))
    return "\n".join(lines)
