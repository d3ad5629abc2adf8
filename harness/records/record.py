"""The records the protocol produces and the ledger stores: typed, frozen, with a JSON round trip.

A unit of a run is one `ItemRecord` (one item on one stack: its arms, their comparisons against
live, replicas, transplants) or one `CrossingRecord` (one item's fixed-prefix precision
crossing: a cell per (stack, construction) and a comparison within each stack). Every field name
is spelled here only; readers use attributes. `to_json` here and `from_json`
(kvfid.records.read) are the one serialization: `{"schema": SCHEMA_VERSION, "kind": ...,
fields...}`, decoded field by field from the type hints (kvfid.records.plain), so a new record
kind is a frozen dataclass with a `KIND` added to `RECORD_KINDS`.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field

from kvfid.errors import Unavailable
from kvfid.records.plain import as_plain

SCHEMA_VERSION = 3


class RecordRefused(Unavailable, ValueError):
    """A stored record this kvfid cannot read (another schema, or not a record)."""


# --------------------------------------------------------------------------- comparisons

@dataclass(frozen=True)
class TensorDiff:
    """One tensor against another, bit for bit (kvfid.states.cache.tensor_diff)."""

    equal: bool = True
    n_diff: int = 0
    max_abs: float = 0.0
    max_ulp: int = 0
    max_abs_rel: float = 0.0
    d_rel: float = 0.0
    first_position: int | None = None


@dataclass(frozen=True)
class LayerDiff:
    """One layer: K/V (empty defaults where a recurrent layer has none), kind (full, window,
    latent, recurrent, ...), the positions [start, end) its K/V cover, other parts, gaps."""

    layer: int
    k: TensorDiff = TensorDiff()
    v: TensorDiff = TensorDiff()
    kind: str = "full"
    span: tuple[int, ...] | None = None
    parts: dict[str, TensorDiff] = field(default_factory=dict)
    uncompared: tuple[str, ...] = ()

    def part_diffs(self) -> dict[str, TensorDiff]:
        """Every part this layer holds, by name: K and V (not for a recurrent layer, whose K/V
        are only defaults; records without spans hold them), then its other parts."""
        kv = {} if self.span is None and self.kind.startswith("recurrent") else {"k": self.k, "v": self.v}
        return {**kv, **self.parts}


@dataclass(frozen=True)
class CacheDiff:
    """Two boundary caches over one P, per layer and part (k, v, recurrent, conv: first_bad_kv)
    (kvfid.states.cache.compare_states). `d_rel` is the Frobenius norm of the difference over
    every compared float part of every layer, concatenated, over that of the reference's."""

    # Records written before this class held it stored that sentence as a field.
    RETIRED: typing.ClassVar[frozenset[str]] = frozenset({"d_rel_aggregation"})

    bit_exact: bool = True
    first_bad_layer: int | None = None
    first_bad_kv: str | None = None
    bad_layers: tuple[int, ...] = ()
    n_diff: int = 0
    max_abs: float = 0.0
    max_ulp: int = 0
    max_abs_rel: float = 0.0
    d_rel: float = 0.0
    first_position: int | None = None
    layers: tuple[LayerDiff, ...] = ()
    uncompared: tuple[str, ...] = ()   # parts not compared: then not bit-exact


@dataclass(frozen=True)
class LogitsDiff:
    """Two boundary logits (kvfid.states.cache.compare_logits)."""

    equal: bool = True
    max_abs: float = 0.0
    d_rel: float = 0.0              # ||a - b|| / ||a|| in fp64 (0 in records written before it)
    argmax_a: int | None = None
    argmax_b: int | None = None
    argmax_agree: bool = True
    margin_a: float | None = None
    margin_b: float | None = None


@dataclass(frozen=True)
class SuffixDiff:
    """Two greedy suffixes (kvfid.states.cache.compare_suffixes)."""

    identical: bool = True
    first_divergence: int | None = None
    common_prefix: int = 0
    len_a: int = 0
    len_b: int = 0
    margin_a_at_divergence: float | None = None
    margin_b_at_divergence: float | None = None


@dataclass(frozen=True)
class Difference:
    """The kind of a difference between two states over one prefix (kvfid.states.scale):
    rounding, functional (the two paths compute different functions: never numerics), or
    unsettled (below fp32 and not yet compared in fp32). `d_rel` is the larger of the state's
    and the boundary logits'; `settled_by` says what the fp32 comparison found, when one ran."""

    kind: str
    d_rel: float
    epsilon: float
    dtype: str
    settled_by: str | None = None


@dataclass(frozen=True)
class Comparison:
    """Arm `b` against arm `a` (the reference). kind: arm | bridge (b against live), replica (an
    arm against its own second run), crossing (two constructions within one crossing stack).
    `cache` and `logits` are None when the two prefixes differ; `difference` is None where
    nothing differs (or nothing was compared; records before it hold None too)."""

    a: str
    b: str
    kind: str
    suffix: SuffixDiff
    prefix_identical: bool = True
    cache: CacheDiff | None = None
    logits: LogitsDiff | None = None
    difference: Difference | None = None

    @property
    def bit_exact(self) -> bool:
        return bool(self.cache and self.cache.bit_exact)


# --------------------------------------------------------------------------- what an item yields

@dataclass(frozen=True)
class Fingerprints:
    """SHA-256 of a state's cache, boundary logits, suffix and prefix."""

    cache_sha: str | None = None
    logits_sha: str | None = None
    suffix_sha: str | None = None
    prefix_sha: str | None = None


@dataclass(frozen=True)
class ArmRecord:
    """One construction's boundary state and suffix, with its costs. A live arm of a short item
    has only `generated` and its costs."""

    construction: str
    suffix: tuple[int, ...] = ()
    suffix_margins: tuple[float, ...] = ()
    suffix_eos: bool = False
    suffix_sha: str | None = None
    cache_sha: str | None = None
    logits_sha: str | None = None
    answer_text: str | None = None
    correct: bool | None = None
    wall_s: float = 0.0
    forward_calls: int = 0
    forward_s: float = 0.0
    generated: tuple[int, ...] | None = None       # live of a short item: the tokens before EOS
    live_margins: tuple[float, ...] | None = None  # live: the margins of the B generated tokens
    rows_identical: bool | None = None             # batched: every row's state equals row 0's
    cobatch: dict | None = None                    # cobatched: kvfid.protocol.cobatch describe()
    acceptance: tuple[int, ...] | None = None      # spec:k: accepted drafts per verification step


@dataclass(frozen=True)
class Replica:
    """An arm built again from scratch: its own fingerprints and its comparison with the first
    run (kind `replica`, a = b = the construction)."""

    construction: str
    fingerprints: Fingerprints
    comparison: Comparison


@dataclass(frozen=True)
class TransplantRecord:
    """recipient <- donor: the recipient's suffix decoded over (a selection of) the donor's
    cache. outcome: donor | recipient | third | boundary (argmax already differs: not decoded)."""

    label: str
    recipient: str
    donor: str
    selection: str
    recipient_equals_donor: bool
    outcome: str
    suffix: tuple[int, ...] | None = None
    suffix_sha: str | None = None
    forward_calls: int = 0
    forward_s: float = 0.0


@dataclass(frozen=True)
class Timing:
    wall_s: float = 0.0
    forward_calls: int = 0
    forward_s: float = 0.0
    overhead: float | None = None


@dataclass(frozen=True)
class ItemRef:
    id: str
    prompt: str | None = None
    answer: str | None = None


# --------------------------------------------------------------------------- the crossing

@dataclass(frozen=True)
class CrossingCell:
    """One (stack, construction) cell: the state built over the reference's P in that stack."""

    stack: str
    construction: str
    fingerprints: Fingerprints
    suffix: tuple[int, ...] = ()
    same_as_reference_live: bool = False
    forward_calls: int = 0
    wall_s: float = 0.0


@dataclass(frozen=True)
class StackComparison:
    """The crossing's two constructions compared within one stack."""

    stack: str
    comparison: Comparison


@dataclass(frozen=True)
class CrossingRecord:
    """One item's fixed-prefix precision crossing: P frozen from the reference stack's live run,
    every construction built over it in every stack."""

    KIND: typing.ClassVar[str] = "crossing"
    UNIT: typing.ClassVar[str] = "crossing"   # the name the ledger stores a crossing unit under

    item: ItemRef
    reference: dict                           # the reference stack (Stack.describe())
    B: int
    S: int
    status: str
    prefix_sha: str | None = None
    reference_suffix: tuple[int, ...] = ()
    cells: tuple[CrossingCell, ...] = ()
    within: tuple[StackComparison, ...] = ()

    @property
    def reference_label(self) -> str:
        return self.reference.get("label", "?")

    def cell(self, stack: str, construction: str) -> CrossingCell | None:
        return next((c for c in self.cells if (c.stack, c.construction) == (stack, construction)),
                    None)

    def to_json(self, indent: int | None = None) -> str:
        return to_json(self, indent)


# --------------------------------------------------------------------------- one item

class UnitRecord:
    """What every unit's record (an item's, a replay's, a program's) says alike: whether it ran
    (`status`) and on which stack (`stack`, Stack.describe())."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def stack_label(self) -> str:
        return self.stack.get("label", "?")


@dataclass(frozen=True)
class ItemRecord(UnitRecord):
    """One item on one stack: every arm, each compared with live (the `incremental` one is the
    bridge), replicas, transplants; `status` short when EOS came within the B live tokens."""

    KIND: typing.ClassVar[str] = "item"

    item: ItemRef
    model: str
    stack: dict                               # Stack.describe()
    B: int
    S: int
    status: str
    prompt_length: int = 0
    ignore_eos: bool = False
    setup_s: float = 0.0
    warmup_s: float = 0.0                     # the untimed warm-up forward before the arms
    arms: dict[str, ArmRecord] = field(default_factory=dict)
    comparisons: tuple[Comparison, ...] = ()
    replicas: tuple[Replica, ...] = ()
    transplants: tuple[TransplantRecord, ...] = ()
    prefix: tuple[int, ...] = ()
    prefix_sha: str | None = None
    note: str | None = None
    timing: Timing = Timing()
    crossing: CrossingRecord | None = None    # `kvfid repro --cross`: this item's crossing
    environment: dict | None = None           # `kvfid repro`: where it ran (a run's units: None,
                                              # the run carries it)

    @property
    def device(self) -> str:
        return self.stack.get("device", "?")

    @property
    def bridge(self) -> Comparison | None:
        return next((c for c in self.comparisons if c.kind == "bridge"), None)

    def against_live(self, arm: str) -> Comparison | None:
        """The comparison of `arm` with live (None for live itself)."""
        return next((c for c in self.comparisons if c.b == arm), None)

    def to_json(self, indent: int | None = None) -> str:
        return to_json(self, indent)


RECORD_KINDS: dict[str, type] = {ItemRecord.KIND: ItemRecord, CrossingRecord.KIND: CrossingRecord}


# --------------------------------------------------------------------------- JSON

def to_dict(record) -> dict:
    """The record as plain JSON-able data, tagged with its schema and kind."""
    return {"schema": SCHEMA_VERSION, "kind": record.KIND, **as_plain(record)}


def to_json(record, indent: int | None = None) -> str:
    separators = None if indent is not None else (",", ":")
    return json.dumps(to_dict(record), indent=indent, separators=separators)
