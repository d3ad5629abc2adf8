"""A program case's aggregates: per stack and layout, the stage program's stages and, per
rebuilt arm over the stack's items, how often its merge-boundary cache is bit-exact with live
and its suffix differs, which segment and layer hold the first differing key or value, the
replicas and the transplant outcomes (kvfid.runs.aggregate puts them under `program`)."""

from __future__ import annotations

import typing
from collections import Counter

from kvfid.runs.summary import (LayoutAggregate, ProgramArmAggregate, ProgramReplicaAggregate,
                                Rate)


def program_stack(records: list, rate) -> dict[str, LayoutAggregate]:
    """One stack's program units (ProgramRecord, in item order), per layout; `rate(k, n)` the
    Wilson rate."""
    return {run.layout: _layout([r.run(run.layout) for r in records], rate)
            for run in records[0].runs}


def _layout(records: list, rate: typing.Callable[[int, int], Rate]) -> LayoutAggregate:
    """One layout's runs (ProgramRun) over the stack's items."""
    first = records[0]
    arms, replicas, transplants = {}, {}, {}
    for arm in (c.arm for c in first.comparisons):
        cs = [c for r in records if (c := r.against_live(arm))]
        arms[arm] = ProgramArmAggregate(
            cache_bit_exact=rate(sum(c.bit_exact for c in cs), len(cs)),
            suffix_disagree=rate(sum(not c.suffix.identical for c in cs), len(cs)),
            logits_bit_exact=sum(bool(c.logits.equal) for c in cs),
            first_bad_segment=_counts(c.first_bad_segment for c in cs),
            first_bad_layer=_counts(None if c.cache.first_bad_layer is None
                                    else f"layer {c.cache.first_bad_layer}" for c in cs),
            segments_differ=dict(Counter(name for c in cs
                                         for name, same in c.segments_exact.items() if not same)))
    for arm in dict.fromkeys(r.arm for record in records for r in record.replicas):
        rs = [r for record in records for r in record.replicas if r.arm == arm]
        replicas[arm] = ProgramReplicaAggregate(rate(sum(r.bit_exact for r in rs), len(rs)),
                                                sum(r.suffix_identical for r in rs))
    for record in records:
        for t in record.transplants:
            transplants.setdefault(t.spelled or t.transplant, Counter())[t.outcome] += 1
    return LayoutAggregate(first.program, len(records), first.S, tuple(first.segments), arms,
                           replicas, {label: dict(c) for label, c in transplants.items()})


def _counts(values) -> dict[str, int]:
    """How many items had each value, `exact` standing for None, exact first."""
    counts = Counter("exact" if v is None else v for v in values)
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] != "exact", kv[0])))
