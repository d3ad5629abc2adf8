"""The record of one `kvfid engine-load`: every request under load against itself alone.

An `EngineLoadRecord` holds what ran (the engine, faithful or stock, in process or the engine's own
server, the plan's seed and shape, the KV budget, the chunk budget, what the engine does when its
blocks run out and how often it evicted or offloaded), one `LoadRequest` per
planned request (what load did to it: preemptions, tokens recomputed, prefix-cache hits, the
most co-resident sequences in one of its steps; and how it compares with its alone run: tokens,
logprob bits, the engine state, and each preemption's rebuilt state against the live one),
the throughput, and optionally the sweep (`SweepPoint`s). Requests the run could not complete are
kept with the reason (`missing`), and a record with any is `incomplete`: it states no verdict.
`groups` splits the requests (preempted or not, by co-resident count) for every table.
Registered in record.RECORD_KINDS; stored in the engine checks' table beside `EngineCheckRecord`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from kvfid.records.record import RECORD_KINDS, CacheDiff, to_json


@dataclass(frozen=True)
class StateDiff:
    """Two engine states of one request compared bitwise over their common positions: the
    CacheDiff's verdict and totals with the positions compared, without the per-layer detail
    (a load run holds one per request and preemption)."""

    positions: int
    exact: bool
    first_bad_layer: int | None = None
    first_position: int | None = None
    n_diff: int = 0
    max_ulp: int = 0
    d_rel: float = 0.0

    @classmethod
    def of(cls, diff: CacheDiff, positions: int) -> StateDiff:
        """The totals of `diff` (kvfid.states.cache.compare_states) over `positions`."""
        return cls(positions, diff.bit_exact, diff.first_bad_layer, diff.first_position,
                   diff.n_diff, diff.max_ulp, diff.d_rel)


@dataclass(frozen=True)
class LoadRequest:
    """One request: what load did to it, and it against its alone run."""

    index: int
    client: int
    prompt: int                         # prompt length
    greedy: bool
    prefix: int | None = None           # the shared prefix it starts with
    missing: str | None = None          # why the run has no complete comparison for it
    generated: int = 0                  # tokens under load
    preemptions: int = 0
    recomputed: int = 0                 # tokens computed again after its preemptions
    cache_hits: tuple[int, ...] = ()    # tokens the prefix cache served, per admission
    coresident: int = 0                 # the most sequences sharing one of its steps
    tokens_equal: bool | None = None
    first_token_step: int | None = None     # the first step whose token differs
    logprobs: int = 0                   # logprobs compared (up to the first differing token)
    logprobs_differ: int = 0
    first_logprob_step: int | None = None
    max_abs: float = 0.0
    kv: StateDiff | None = None         # the final engine state against the alone run's
    resumed: tuple[StateDiff, ...] = ()     # per preemption: the rebuilt state against the live one
    token_ids: tuple[int, ...] = ()     # what it got under load: its tokens, their logprobs,
    token_logprobs: tuple[float, ...] = ()
    kv_sha: str | None = None           # and the SHA-256 of its final engine state

    @property
    def differs(self) -> bool:
        """Tokens, logprob bits or the engine state differ from the alone run."""
        return (self.tokens_equal is False or self.logprobs_differ > 0
                or (self.kv is not None and not self.kv.exact))


@dataclass(frozen=True)
class SweepPoint:
    """Co-resident sequences of one prompt length against each one's alone run."""

    coresident: int
    prompt: int
    requests: int
    differ: int                         # requests whose tokens or logprob bits differ
    first_step: int | None = None       # the earliest differing step among them
    observed: int = 0                   # the most sequences one step held (the recording scheduler)


@dataclass(frozen=True)
class LoadGroup:
    """A table row: the requests of one kind and how many differ in each respect."""

    name: str
    requests: int
    differ: int
    tokens_differ: int
    logprobs_differ: int
    kv_differ: int
    kv_read: int
    first_token_step: int | None
    first_bad_layer: int | None


@dataclass(frozen=True)
class EngineLoadRecord:
    """One `kvfid engine-load`: what ran, each request against its alone run, the price."""

    KIND: typing.ClassVar[str] = "engine-load"

    model: str
    dtype: str
    engine: str                              # the engine and its version: "vllm <version>"
    faithful: bool
    mode: str                                # "in-process" or "server"
    seed: int
    clients: int
    tokens: int
    kv_blocks: int | None
    chunk: int | None
    prefix_caching: bool
    requests: tuple[LoadRequest, ...] = ()
    wall_s: float = 0.0
    load_wall_s: float = 0.0                 # the load run alone, for throughput
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    threads: int | None = None
    sweep: tuple[SweepPoint, ...] = ()
    notes: tuple[str, ...] = ()
    status: str = "ok"                       # "incomplete": some request is missing
    folder: str = ""
    greedy_share: float = 0.5                # the plan's share of greedy requests
    kv_cache_dtype: str = "auto"             # the paged cache's stored format (auto: the model's dtype)
    engine_name: str = "vllm"                # the engine's name in kvfid.engines.registry
    block_size: int = 32                     # the paged cache's block in tokens
    pressure: str = ""                       # what the engine does when its blocks run out (its words)
    evictions: int = 0                       # times it evicted its cached (prefix) blocks to make room
    offloads: int = 0                        # preemptions whose blocks it copied to host memory (not recomputed)

    @property
    def missing(self) -> tuple[LoadRequest, ...]:
        return tuple(r for r in self.requests if r.missing)

    @property
    def complete(self) -> bool:
        return self.status == "ok" and not self.missing

    @property
    def exact(self) -> bool:
        """Every request equals its alone run (no verdict on an incomplete run: False)."""
        return self.complete and not any(r.differs for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.load_wall_s if self.load_wall_s else 0.0

    @property
    def label(self) -> str:
        return (f"{self.engine}/{self.dtype}" + ("+faithful" if self.faithful else "")
                + (" (server)" if self.mode == "server" else ""))

    def to_json(self, indent: int | None = None) -> str:
        return to_json(self, indent)


BINS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, None))


def groups(requests: typing.Iterable[LoadRequest]) -> list[LoadGroup]:
    """All compared requests, preempted / not, and by co-resident count (the bins that occur)."""
    done = [r for r in requests if not r.missing]
    split = [("all requests", done), ("preempted", [r for r in done if r.preemptions]),
             ("not preempted", [r for r in done if not r.preemptions])]
    for lo, hi in BINS:
        chosen = [r for r in done if lo <= r.coresident and (hi is None or r.coresident <= hi)]
        name = f"co-resident {lo}" if lo == hi else f"co-resident {lo}-{hi}" if hi else f"co-resident {lo}+"
        if chosen:
            split.append((name, chosen))
    return [_group(name, rows) for name, rows in split]


def _group(name: str, rows: list[LoadRequest]) -> LoadGroup:
    firsts = [r.first_token_step for r in rows if r.first_token_step is not None]
    layers = [r.kv.first_bad_layer for r in rows if r.kv is not None and r.kv.first_bad_layer is not None]
    return LoadGroup(name, len(rows), sum(r.differs for r in rows),
                     sum(r.tokens_equal is False for r in rows), sum(r.logprobs_differ > 0 for r in rows),
                     sum(r.kv is not None and not r.kv.exact for r in rows),
                     sum(r.kv is not None for r in rows), min(firsts, default=None), min(layers, default=None))


RECORD_KINDS[EngineLoadRecord.KIND] = EngineLoadRecord
