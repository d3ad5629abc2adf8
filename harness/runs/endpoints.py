"""The seed paper's endpoints per stack, as the paper reports them.

The paper's question is live against prefill over the same boundary prefix P. Its endpoints: the
suffix disagreement with its Wilson interval, the replica floors of both constructions, the
correctness labels that flip with the paired accuracy difference, where suffixes first diverge
(median, quartiles, range, a small histogram, on the suffix horizon the run affords), the
fixed-prefix crossing, the bridge (incremental against live), per transplant direction the share
of divergent rows that follow the cache donor beside the exact-control stratum, and d_rel per layer.
Most are read from the stack's aggregate (kvfid.runs.aggregate) so both say the same; what the
aggregate does not keep (the range of first divergences, incremental against prefill over the
stack's own P) is read from the records.
"""

from __future__ import annotations

import math

from kvfid.records.record import ItemRecord
from kvfid.runs import stats
from kvfid.runs.summary import (Bridge, CrossingAggregate, DonorFollowing, FirstDivergence,
                                FixedPrefix, Rate, StackAggregate, StackEndpoints, finite)

HISTOGRAM_BINS = 8          # "a small histogram": at most this many bins over the horizon
LIVE, REBUILT, BRIDGE = "live", "prefill", "incremental"


def stack_endpoints(label: str, s: StackAggregate, records: list[ItemRecord],
                    crossing: CrossingAggregate | None) -> StackEndpoints:
    """One stack's endpoints from its aggregate `s`, its item records and the run's crossing."""
    ok = [r for r in records if r.ok]
    prefill = s.constructions.get(REBUILT)
    bridge = s.constructions.get(BRIDGE)
    within = crossing.within.get(label) if crossing else None
    return StackEndpoints(
        items=s.items,
        batch_invariant=any(r.stack.get("batch_invariant") for r in records),
        disagreement=prefill.suffix_disagree if prefill else None,
        replicas={arm: s.replicas[arm] for arm in (LIVE, REBUILT) if arm in s.replicas},
        correctness=prefill.correctness if prefill else None,
        first_divergence=first_divergence(ok, s.S) if prefill else None,
        crossing=FixedPrefix(crossing.reference, within.suffix_disagree, within.cache_bit_exact)
        if within else None,
        own_prefix=own_prefix(label, ok),
        bridge=Bridge(bridge.cache_bit_exact, bridge.suffix_disagree)
        if bridge and bridge.kind == "bridge" else None,
        transplants=tuple(donor_following(t, roles) for t, roles in s.transplants.items()),
        d_rel_per_layer={part: series for part, series in prefill.d_rel_per_layer.items()
                         if part in ("k", "v")} if prefill else {})


def first_divergence(records: list[ItemRecord], horizon: int) -> FirstDivergence:
    """The first-divergence index of every live ~ prefill suffix that differs."""
    found = [c.suffix.first_divergence for r in records for c in r.comparisons
             if c.kind == "arm" and c.a == LIVE and c.b == REBUILT and not c.suffix.identical]
    q1, q2, q3 = (finite(q) for q in stats.quantiles(found, (0.25, 0.5, 0.75)))
    width = max(1, math.ceil(horizon / HISTOGRAM_BINS))
    edges = list(range(0, horizon, width)) + [max(horizon, max(found, default=0) + 1)]
    return FirstDivergence(horizon, len(found), q2, q1, q3, min(found, default=None),
                           max(found, default=None),
                           tuple(stats.histogram(found, edges)) if found else ())


def own_prefix(label: str, records: list[ItemRecord]) -> FixedPrefix | None:
    """incremental ~ prefill over the stack's own live P (both arms build over it): suffixes
    compared token by token, caches by their SHA-256 fingerprints."""
    pairs = [(r.arms[BRIDGE], r.arms[REBUILT]) for r in records
             if BRIDGE in r.arms and REBUILT in r.arms]
    if not pairs:
        return None
    return FixedPrefix(label, Rate.of(sum(a.suffix != b.suffix for a, b in pairs), len(pairs)),
                       sum(a.cache_sha is not None and a.cache_sha == b.cache_sha
                           for a, b in pairs))


def donor_following(transplant: str, roles: dict) -> DonorFollowing:
    """Of a transplant's divergent rows, those that decode a suffix (not `boundary`) and follow
    the donor; of its control rows, those whose suffix is not the recipient's (= the donor's)."""
    divergent, control = roles["divergent"], roles["control"]
    count = lambda role, outcome: role.outcomes[outcome].k if role.n else 0
    boundary = count(divergent, "boundary")
    return DonorFollowing(transplant, divergent.n, boundary,
                          Rate.of(count(divergent, "donor"), divergent.n - boundary),
                          Rate.of(control.n - count(control, "recipient"), control.n))
