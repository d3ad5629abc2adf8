"""Run aggregates: the per-stack numbers of a run's stored units.

`aggregate(units, design)` turns a run's stored unit records into the per-stack numbers
docs/protocol.md lists (disagreement vs live with Wilson intervals and the replica floor beside it,
cache bit-exactness, first bad layer, median d_rel per layer, first-divergence quartiles and
histogram, correctness and flips with a paired interval and exact McNemar p, transplant outcomes per
selection and row role, margins at divergence, the crossing 2x2; for replayed trajectories, per
stack and construction the logprob mismatch and its |delta| by decade; per stack the seed paper's
endpoints, kvfid.runs.endpoints) as a `RunSummary`
(kvfid.runs.summary); `show`, `report` (kvfid.reports.report) and `compare` (kvfid.compare.runs)
all read it, summary.json holds its `to_plain()`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict

from kvfid.records.plain import as_plain
from kvfid.records.record import CrossingRecord, ItemRecord
from kvfid.diagnoses.replay import aggregate as replay_aggregate
from kvfid.diagnoses.replay_gaps import ENGINE, STEP, aggregate_gaps
from kvfid.records.program import ProgramRecord
from kvfid.records.replay_record import ReplayRecord
from kvfid.runs import stats
from kvfid.runs.endpoints import stack_endpoints
from kvfid.runs.program_aggregate import program_stack
from kvfid.runs.summary import (ConstructionAggregate, CrossingAggregate, Divergence, Rate,
                                ReplicaFloor, RunSummary, Spread, StackAggregate,
                                TransplantOutcomes, WithinStack, finite)
from kvfid.states import scale

OUTCOMES = ("donor", "recipient", "third", "boundary")
ROLES = ("divergent", "control", "unsampled")


# --------------------------------------------------------------------------- aggregates

rate = Rate.of       # k of n with its 95% Wilson interval


def _spread(xs: list[float]) -> Spread:
    q1, q2, q3 = (finite(q) for q in stats.quantiles(xs, (0.25, 0.5, 0.75)))
    return Spread(len(xs), q2, q1, q3)


def aggregate(units, design: dict | None = None) -> RunSummary:
    """Per-stack aggregates (and the crossing) of stored units (`.item_index`, `.stack`,
    `.record`: kvfid.records.record); `design` is the run's design (its transplant control
    sample)."""
    design = design or {}
    controls = set(design.get("control_indices", []))
    by_stack: dict[str, list] = defaultdict(list)
    crossing, replayed, programs = [], defaultdict(list), defaultdict(list)
    for unit in units:
        if isinstance(unit.record, (ReplayRecord, ProgramRecord)):
            (replayed if isinstance(unit.record, ReplayRecord) else programs)[unit.stack].append(unit)
            continue
        (crossing if isinstance(unit.record, CrossingRecord) else by_stack[unit.stack]).append(unit)
    stacks = {}
    in_fp32 = _fp32_kinds(by_stack)
    for stack, group in by_stack.items():
        group.sort(key=lambda u: u.item_index)
        found = _stack([u.record for u in group], [u.item_index for u in group], controls)
        kinds = _difference_kinds(stack, group, in_fp32)
        stacks[stack] = dataclasses.replace(found, constructions={
            label: dataclasses.replace(c, differences=kinds[label]) if label in kinds else c
            for label, c in found.constructions.items()})
    crossed = _crossing(sorted(crossing, key=lambda u: u.item_index)) if crossing else None
    return RunSummary(
        stacks, crossed, tuple(sorted(controls)),
        {stack: _replay(group) for stack, group in replayed.items()} or None,
        {stack: gaps for stack, group in replayed.items() if (gaps := _replay_engine(group))}
        or None,
        {stack: program_stack([u.record for u in sorted(group, key=lambda u: u.item_index)], rate)
         for stack, group in programs.items()} or None,
        {stack: stack_endpoints(stack, s, [u.record for u in by_stack[stack]], crossed)
         for stack, s in stacks.items()} or None)


def _twin(stack: str) -> str:
    """The label of the same stack in fp32 (a stack label's dtype follows its backend's '/')."""
    backend, _, rest = stack.partition("/")
    for low in ("bf16", "fp16"):
        if rest.startswith(low):
            return f"{backend}/fp32{rest[len(low):]}"
    return stack


def _fp32_kinds(by_stack: dict) -> dict:
    """(stack, item index, construction) -> the kind of its difference with live (None where
    none differs), for the fp32 stacks of the run."""
    return {(stack, u.item_index, c.b): (c.difference.kind if c.difference else None)
            for stack, group in by_stack.items() if "/fp32" in stack
            for u in group if u.record.ok for c in u.record.comparisons
            if c.kind in ("arm", "bridge") and c.prefix_identical}


def _difference_kinds(stack: str, group: list, in_fp32: dict) -> dict[str, dict[str, int]]:
    """Per construction compared with live: how many items differ by rounding, functionally, or
    unsettled (kvfid.states.scale), a below-fp32 stack's unsettled ones settled by the same item
    and construction on its fp32 twin in the same run (where it built the same P)."""
    out: dict[str, Counter] = defaultdict(Counter)
    for unit in (u for u in group if u.record.ok):
        for c in unit.record.comparisons:
            if c.kind not in ("arm", "bridge"):
                continue
            counted = out[c.b]
            if c.difference is None:
                continue
            kind, key = c.difference.kind, (_twin(stack), unit.item_index, c.b)
            if kind == scale.UNSETTLED and key in in_fp32:
                kind = scale.settle(kind, in_fp32[key])
            counted[kind] += 1
    return {label: {k: counted.get(k, 0) for k in scale.DIFFERENCE_KINDS} for label, counted in out.items()}


def _stack(records: list[ItemRecord], indices: list[int], controls: set[int]) -> StackAggregate:
    ok = [(i, r) for i, r in zip(indices, records) if r.ok]
    first = records[0]
    by_arm: dict[str, list] = defaultdict(list)
    for _, r in ok:
        for replica in r.replicas:
            by_arm[replica.construction].append(replica.comparison)
    replicas = {arm: ReplicaFloor(*dataclasses.astuple(rate(sum(not c.suffix.identical for c in cs),
                                                           len(cs))),
                                  cache_bit_exact=sum(c.bit_exact for c in cs))
                for arm, cs in by_arm.items()}
    comparisons: dict[tuple[str, str], list] = defaultdict(list)
    for _, r in ok:
        for c in r.comparisons:
            comparisons[(c.kind, c.b)].append((r, c))
    constructions = {label: _construction(rows, kind, replicas, first.S)
                     for (kind, label), rows in comparisons.items()}
    correctness, batched = {}, {}
    for label in (ok[0][1].arms if ok else {}):
        marks = [r.arms[label].correct for _, r in ok]
        scored = [m for m in marks if m is not None]
        correctness[label] = rate(sum(scored), len(scored))
        rows_identical = [r.arms[label].rows_identical for _, r in ok]
        if any(x is not None for x in rows_identical):
            batched[label] = rate(sum(bool(x) for x in rows_identical), len(rows_identical))
    return StackAggregate(len(records), len(ok), first.B, first.S,
                          tuple(r.item.id for r in records if r.status == "short"),
                          constructions, replicas, correctness, _transplants(ok, controls),
                          batched)


def _construction(rows: list, kind: str, replicas: dict, S: int) -> ConstructionAggregate:
    cs = [c for _, c in rows]
    caches = [c.cache for c in cs if c.cache]
    logits = [c.logits for c in cs if c.logits]
    layers = max((len(c.layers) for c in caches), default=0)
    divergence = [c.suffix.first_divergence for c in cs if not c.suffix.identical]
    at_divergence, elsewhere = [], []
    for r, c in rows:   # margins of the reference (live) suffix
        margins, first = list(r.arms[c.a].suffix_margins), c.suffix.first_divergence
        elsewhere += margins if first is None else margins[:first]
        if first is not None and first < len(margins):
            at_divergence.append(margins[first])
    width = max(1, math.ceil(S / 16))
    edges = list(range(0, S, width)) + [max(S, max(divergence, default=0) + 1)]
    pairs = [(r.arms[c.a].correct, r.arms[c.b].correct) for r, c in rows]
    pairs = [p for p in pairs if None not in p]
    return ConstructionAggregate(
        kind=kind, vs=cs[0].a,
        suffix_disagree=rate(len(divergence), len(cs)),
        replica_floor=replicas.get(cs[0].b), live_replica_floor=replicas.get(cs[0].a),
        cache_comparable=len(caches),
        cache_bit_exact=rate(sum(c.bit_exact for c in caches), len(caches)),
        logits_bit_exact=sum(bool(x.equal) for x in logits),
        boundary_argmax_differs=sum(x.argmax_agree is False for x in logits),
        first_bad_layer=dict(sorted(Counter(
            "exact" if c.first_bad_layer is None else str(c.first_bad_layer)
            for c in caches).items(), key=lambda kv: (kv[0] != "exact", _int(kv[0])))),
        d_rel_median=finite(stats.median([c.d_rel for c in caches])),
        d_rel_per_layer=_d_rel_per_layer(caches, layers),
        first_divergence=Divergence(
            *dataclasses.astuple(_spread(divergence)),
            histogram=tuple(stats.histogram(divergence, edges)) if divergence else ()),
        margin_at_divergence=_spread(at_divergence),
        margin_elsewhere=_spread(elsewhere),
        correctness=stats.paired_difference([a for a, _ in pairs], [b for _, b in pairs])
        if pairs else None)


def _d_rel_per_layer(caches: list, layers: int) -> dict[str, tuple[float | None, ...]]:
    """Per part, per layer: the median d_rel over the items whose layer holds that part."""
    diffs = [[layer.part_diffs() for layer in c.layers] for c in caches]
    names = dict.fromkeys(["k", "v"] + [name for c in diffs for layer in c for name in layer])
    out = {}
    for name in names:
        series = [[c[i][name].d_rel for c in diffs if i < len(c) and name in c[i]] for i in range(layers)]
        if any(series):
            out[name] = tuple(finite(stats.median(xs)) if xs else None for xs in series)
    return out


def _replay(units: list) -> dict:
    """Per construction over the stack's trajectories: kvfid.diagnoses.replay.aggregate."""
    records = [u.record for u in sorted(units, key=lambda u: u.item_index)]
    return {c: replay_aggregate([as_plain(r.constructions[c]) for r in records
                                 if c in r.constructions])
            for c in records[0].constructions}


def _replay_engine(units: list) -> dict:
    """With an engine reference on every trajectory: per gap (engine~step-by-step, then
    step-by-step~C and engine~C per construction C), kvfid.diagnoses.replay_gaps.aggregate_gaps."""
    records = [u.record for u in sorted(units, key=lambda u: u.item_index)]
    if not records or any(r.engine is None for r in records):
        return {}
    out = {f"{ENGINE}~{STEP}": aggregate_gaps([as_plain(r.engine) for r in records])}
    for c in records[0].constructions:
        out[f"{STEP}~{c}"] = replay_aggregate([as_plain(r.constructions[c]) for r in records])
        out[f"{ENGINE}~{c}"] = aggregate_gaps([as_plain(r.engine_constructions[c]) for r in records])
    return out


def _int(text: str) -> int:
    return int(text) if text.isdigit() else -1


def _transplants(ok: list, controls: set[int]) -> dict[str, dict[str, TransplantOutcomes]]:
    out: dict[str, dict] = {}
    for index, r in ok:
        for t in r.transplants:
            role = ("divergent" if not t.recipient_equals_donor else
                    "control" if index in controls else "unsampled")
            entry = out.setdefault(t.label, {name: Counter() for name in ROLES})
            entry[role][t.outcome] += 1
    summary = lambda counts: TransplantOutcomes(sum(counts.values()), {
        o: rate(counts[o], sum(counts.values())) for o in OUTCOMES})
    return {label: {role: summary(counts) for role, counts in roles.items()}
            for label, roles in out.items()}


def _crossing(units: list) -> CrossingAggregate:
    records: list[CrossingRecord] = [u.record for u in units]
    ok = [r for r in records if r.status == "ok"]
    cells: dict[str, dict] = {}
    for cell in (ok[0].cells if ok else ()):
        same = [r.cell(cell.stack, cell.construction).same_as_reference_live for r in ok]
        cells.setdefault(cell.stack, {})[cell.construction] = rate(sum(same), len(same))
    within = {}
    for stack in cells:
        cs = [w.comparison for r in ok for w in r.within if w.stack == stack]
        within[stack] = WithinStack(f"{cs[0].a}~{cs[0].b}" if cs else None,
                                    rate(sum(not c.suffix.identical for c in cs), len(cs)),
                                    sum(c.bit_exact for c in cs))
    return CrossingAggregate(records[0].reference_label, len(records), len(ok),
                             tuple(r.item.id for r in records if r.status == "short"), cells,
                             within)
