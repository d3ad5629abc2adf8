"""The record of one replayed trajectory on one stack: the ledger stores it like any unit.

Its own module because record.py is full; `ReplayRecord` registers itself in record.RECORD_KINDS, and
kvfid.records.read imports this module, so a stored replay unit reads back wherever records
are read.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from kvfid.records.record import RECORD_KINDS, ItemRef, UnitRecord, to_json


@dataclass(frozen=True)
class LogprobMismatch:
    """One construction's re-scored logprobs against the step-by-step reference (replay.mismatch):
    tokens whose fp32 logprob bits differ, |delta| max and mean, KL(reference || other) in fp64,
    the first differing position, every token's |delta| (the distribution the report draws) and
    the SHA-256 of the picked logprobs' bits (what audit compares); for `spec:k`, its
    acceptance pattern."""

    tokens: int
    differ: int
    fraction: float
    max_abs: float
    mean_abs: float
    kl_mean: float
    kl_max: float
    first_position: int | None = None
    abs_deltas: tuple[float, ...] = ()
    logprobs_sha: str | None = None
    k3_mean: float | None = None        # None in records written before the engine gaps
    ratio_min: float | None = None
    ratio_mean: float | None = None
    ratio_max: float | None = None
    acceptance: tuple[int, ...] | None = None   # spec:k: the accepted draft count of each step

    @property
    def exact(self) -> bool:
        return self.differ == 0


@dataclass(frozen=True)
class PickedGap:
    """The gap between two sets of picked logprobs of the same tokens, as RL frameworks log it
    (replay_gaps.gap): `other` (a trainer's side) against `reference` (the sampler's side).
    Tokens whose fp32 bits differ, |delta| max and mean (mean: slime's
    train_rollout_logprob_abs_diff), the K3 estimate of KL(reference || other) per token
    (r - 1 - log r), the importance ratio r = p_other / p_reference (min, mean, max), the first
    differing position and every token's |delta|."""

    tokens: int
    differ: int
    fraction: float
    max_abs: float
    mean_abs: float
    k3_mean: float
    ratio_min: float
    ratio_mean: float
    ratio_max: float
    first_position: int | None = None
    abs_deltas: tuple[float, ...] = ()

    @property
    def exact(self) -> bool:
        return self.differ == 0


@dataclass(frozen=True)
class ReplayRecord(UnitRecord):
    """A supplied trajectory re-scored on one stack by each construction; `reference_sha`: the
    bits of the reference's picked logprobs; with an engine reference, the engine's gaps."""

    KIND: typing.ClassVar[str] = "replay"

    item: ItemRef
    model: str
    stack: dict                               # Stack.describe()
    prompt_length: int
    tokens: int
    status: str = "ok"
    reference_sha: str | None = None
    constructions: dict[str, LogprobMismatch] = field(default_factory=dict)
    wall_s: float = 0.0
    # With an engine reference (the file's logprobs): engine vs step-by-step, and engine vs each
    # construction (what a trainer sees). Absent in records of files without logprobs.
    engine: PickedGap | None = None
    engine_constructions: dict[str, PickedGap] = field(default_factory=dict)

    def to_json(self, indent: int | None = None) -> str:
        return to_json(self, indent)


RECORD_KINDS[ReplayRecord.KIND] = ReplayRecord
