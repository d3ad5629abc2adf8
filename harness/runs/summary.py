"""The typed aggregates of a run (kvfid.runs.aggregate builds them): per stack and construction,
rates with their Wilson intervals, spreads, first bad layers, d_rel per layer, correctness,
transplant outcomes, and the crossing.

Readers (the run report, `show`, `compare`) use attributes. `RunSummary.to_plain` is the one
edge to JSON: summary.json and the index hold exactly the keys these fields name (NaN written as
null), and a stored rate reads back with `Rate.from_plain`. The replay and program aggregates
(kvfid.diagnoses.replay, kvfid.diagnoses.replay_gaps) are carried as their own plain data.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from kvfid.records.plain import as_plain, from_plain
from kvfid.records.program import Segment
from kvfid.runs.stats import PairedDifference, wilson_interval

# What summary.json says beside every construction's d_rel_per_layer.
D_REL_PER_LAYER = ("median over items of each layer's ||a-b||_F/||a||_F, each part (k, v, "
                   "recurrent, conv, ...) apart; None where a layer lacks it")


def finite(x: float | None) -> float | None:
    """x, or None where it is NaN (an empty median): JSON has no NaN."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


@dataclass(frozen=True)
class Rate:
    """k of n, the rate (None when n is 0) and its 95% Wilson interval."""

    k: int
    n: int
    rate: float | None
    ci: tuple[float, float]

    @classmethod
    def of(cls, k: int, n: int) -> Rate:
        """k of n with its 95% Wilson interval."""
        return cls(k, n, k / n if n else None, wilson_interval(k, n))

    @classmethod
    def from_plain(cls, data: dict | None) -> Rate | None:
        """A rate as summary.json and comparison.json store it (its extra counts left aside)."""
        if not data:
            return None
        return from_plain(cls, {name: data.get(name) for name in ("k", "n", "rate", "ci")})


@dataclass(frozen=True)
class ReplicaFloor(Rate):
    """A construction against its own second run: suffixes that differ, caches bit-exact."""

    cache_bit_exact: int = 0


@dataclass(frozen=True)
class Spread:
    """The median and quartiles of a list (None where it is empty)."""

    n: int
    median: float | None
    q1: float | None
    q3: float | None


@dataclass(frozen=True)
class Divergence(Spread):
    """First-divergence indices: their spread and histogram, (lo, hi, count) rows."""

    histogram: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class ConstructionAggregate:
    """One construction against its reference (live) over a stack's items."""

    kind: str                                  # arm | bridge
    vs: str
    suffix_disagree: Rate
    replica_floor: ReplicaFloor | None
    live_replica_floor: ReplicaFloor | None
    cache_comparable: int
    cache_bit_exact: Rate
    logits_bit_exact: int
    boundary_argmax_differs: int
    first_bad_layer: dict[str, int]            # "exact" or a layer index -> items
    d_rel_median: float | None
    d_rel_per_layer: dict[str, tuple[float | None, ...]]
    first_divergence: Divergence
    margin_at_divergence: Spread
    margin_elsewhere: Spread
    correctness: PairedDifference | None
    differences: dict[str, int] | None = None  # rounding / functional / unsettled (states.scale)


@dataclass(frozen=True)
class TransplantOutcomes:
    """One transplant's rows of one role: how many, and each outcome's rate."""

    n: int
    outcomes: dict[str, Rate]


@dataclass(frozen=True)
class StackAggregate:
    """Every construction, replica, correctness rate and transplant of one stack."""

    items: int
    ok: int
    B: int
    S: int
    short: tuple[str, ...]
    constructions: dict[str, ConstructionAggregate] = field(default_factory=dict)
    replicas: dict[str, ReplicaFloor] = field(default_factory=dict)
    correctness: dict[str, Rate] = field(default_factory=dict)
    transplants: dict[str, dict[str, TransplantOutcomes]] = field(default_factory=dict)
    batched_rows_identical: dict[str, Rate] = field(default_factory=dict)


@dataclass(frozen=True)
class WithinStack:
    """The crossing's two constructions within one stack."""

    pair: str | None
    suffix_disagree: Rate
    cache_bit_exact: int


@dataclass(frozen=True)
class CrossingAggregate:
    """The fixed-prefix precision crossing: per (stack, construction) cell, how often its suffix
    equals the reference live suffix, and the two constructions within each stack."""

    reference: str
    items: int
    ok: int
    short: tuple[str, ...]
    cells: dict[str, dict[str, Rate]] = field(default_factory=dict)
    within: dict[str, WithinStack] = field(default_factory=dict)


@dataclass(frozen=True)
class ProgramArmAggregate:
    """A rebuilt arm of a stage program against live at the merge boundary, over the items."""

    cache_bit_exact: Rate
    suffix_disagree: Rate
    logits_bit_exact: int
    first_bad_segment: dict[str, int]          # "exact" or a segment -> items
    first_bad_layer: dict[str, int]            # "exact" or "layer N" -> items
    segments_differ: dict[str, int]            # segment -> items whose K or V differ there


@dataclass(frozen=True)
class ProgramReplicaAggregate:
    """An arm of a stage program built twice: caches bit-exact, suffixes identical."""

    cache_bit_exact: Rate
    suffix_identical: int


@dataclass(frozen=True)
class LayoutAggregate:
    """One layout of a stage program over a stack's items (kvfid.runs.program_aggregate)."""

    program: str
    items: int
    S: int
    segments: tuple[Segment, ...]              # the first item's stages
    arms: dict[str, ProgramArmAggregate] = field(default_factory=dict)
    replicas: dict[str, ProgramReplicaAggregate] = field(default_factory=dict)
    transplants: dict[str, dict[str, int]] = field(default_factory=dict)   # label -> outcomes


@dataclass(frozen=True)
class FirstDivergence:
    """Where suffixes that differ from live first differ, as the seed paper reports it: median,
    quartiles, range and a small histogram ((lo, hi, count) rows, lo <= index < hi), seen on a
    suffix of `horizon` tokens (a divergence after it is not seen)."""

    horizon: int
    n: int
    median: float | None
    q1: float | None
    q3: float | None
    low: int | None
    high: int | None
    histogram: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class FixedPrefix:
    """The crossing's two constructions (incremental, prefill) over one P: suffixes that differ,
    caches bit-exact. `prefix`: whose live run froze P (the crossing's reference, or the stack)."""

    prefix: str
    suffix_differs: Rate
    cache_bit_exact: int


@dataclass(frozen=True)
class Bridge:
    """incremental against live over the same P: caches bit-exact, suffixes that differ."""

    cache_bit_exact: Rate
    suffix_differs: Rate


@dataclass(frozen=True)
class DonorFollowing:
    """One transplant direction as the paper reports it: of the divergent rows (recipient and donor
    suffixes differ) that decode a suffix, the share that follows the cache donor; the rows whose
    boundary argmax already differs, apart; of the control rows (exact rows in the seeded sample),
    the share whose suffix the transplant changed."""

    transplant: str
    divergent: int
    boundary: int
    follows_donor: Rate
    controls_changed: Rate


@dataclass(frozen=True)
class StackEndpoints:
    """Every endpoint the seed paper reports, for one stack (kvfid.runs.endpoints builds it):
    live against prefill unless a field says otherwise."""

    items: int
    batch_invariant: bool
    disagreement: Rate | None
    replicas: dict[str, ReplicaFloor]
    correctness: PairedDifference | None
    first_divergence: FirstDivergence | None
    crossing: FixedPrefix | None               # the crossing unit's cell, where it has this stack
    own_prefix: FixedPrefix | None             # over this stack's own live P
    bridge: Bridge | None
    transplants: tuple[DonorFollowing, ...]
    d_rel_per_layer: dict[str, tuple[float | None, ...]]   # D_REL_PER_LAYER, live ~ prefill


@dataclass(frozen=True)
class RunSummary:
    """A run's aggregates: per stack, the crossing, the transplant control sample, and the
    replay aggregates as kvfid.diagnoses.replay gives them, per stack and layout the program's;
    per stack the seed paper's endpoints."""

    stacks: dict[str, StackAggregate]
    crossing: CrossingAggregate | None
    control_indices: tuple[int, ...]
    replay: dict | None = None
    replay_engine: dict | None = None
    program: dict[str, dict[str, LayoutAggregate]] | None = None
    endpoints: dict[str, StackEndpoints] | None = None

    def to_plain(self) -> dict:
        """The summary as strict JSON data: summary.json's keys, NaN as None, D_REL_PER_LAYER
        after each construction's d_rel_per_layer, no `differences` where it has none."""
        out = _clean(as_plain(self))
        for stack in out["stacks"].values():
            stack["constructions"] = {label: _construction_plain(c)
                                      for label, c in stack["constructions"].items()}
        return out

    @classmethod
    def from_plain(cls, data: dict) -> RunSummary:
        """A summary.json read back (its run fields, such as `run` and `status`, left aside; the
        constant `d_rel_aggregation` dropped): `to_plain`'s inverse."""
        names = {f.name for f in dataclasses.fields(cls)}
        data = {key: value for key, value in data.items() if key in names}
        data["stacks"] = {
            label: {**stack, "constructions": {
                name: {k: v for k, v in c.items() if k != "d_rel_aggregation"}
                for name, c in stack.get("constructions", {}).items()}}
            for label, stack in data.get("stacks", {}).items()}
        return from_plain(cls, data)


def _construction_plain(c: dict) -> dict:
    out = {}
    for key, value in c.items():
        if key == "differences" and value is None:
            continue
        out[key] = value
        if key == "d_rel_per_layer":
            out["d_rel_aggregation"] = D_REL_PER_LAYER
    return out


def _clean(value: typing.Any):
    """NaN -> None, so the data is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value
