"""The record of one stage program (kvfid.stages.program) on one stack: the ledger stores it
like any unit.

Its own module because record.py is full; `ProgramRecord` registers itself in record.RECORD_KINDS, and
kvfid.records.read imports this module, so a stored program unit reads back wherever records
are read.
`stages.run_program` returns a `ProgramRun`; `picture` draws the stages and what each sees.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from kvfid.records.record import (RECORD_KINDS, CacheDiff, ItemRef, LogitsDiff, SuffixDiff, UnitRecord,
                                     to_json)


@dataclass(frozen=True)
class Segment:
    """One stage of the merge boundary: its tokens [start, start + length), its position ids
    [lo, hi], and the stages its queries see."""

    segment: str
    start: int
    length: int
    positions: tuple[int, ...]
    sees: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProgramArm:
    """One arm's merge-boundary state and suffix, with its costs."""

    cache_sha: str
    suffix: tuple[int, ...]
    wall_s: float = 0.0
    forward_calls: int = 0


@dataclass(frozen=True)
class ProgramComparison:
    """A rebuilt arm against live at the merge boundary: the cache per layer, the first bad
    segment (the stage holding the first differing position) and each segment's verdict, the
    boundary logits, the suffix."""

    arm: str
    cache: CacheDiff
    logits: LogitsDiff
    suffix: SuffixDiff
    first_bad_segment: str | None = None
    segments_exact: dict[str, bool] = field(default_factory=dict)

    @property
    def bit_exact(self) -> bool:
        return self.cache.bit_exact


@dataclass(frozen=True)
class ProgramReplica:
    """An arm built again from scratch, against its first build."""

    arm: str
    bit_exact: bool
    suffix_identical: bool


@dataclass(frozen=True)
class ProgramTransplant:
    """recipient <- donor at the merge boundary: donor | recipient | third | boundary;
    `spelled`: as the case wrote it (`segment=NAME`, whose positions vary with the prompt)."""

    transplant: str
    outcome: str
    same_suffixes: bool
    spelled: str | None = None
    suffix: tuple[int, ...] | None = None
    suffix_sha: str | None = None


@dataclass(frozen=True)
class ProgramRun:
    """One layout's program: live and each rebuilt arm at its merge boundary."""

    program: str                              # Program.label
    S: int
    prompt_length: int
    boundary_length: int
    segments: tuple[Segment, ...] = ()
    prefix_sha: str | None = None
    live_margins: tuple[float, ...] = ()
    arms: dict[str, ProgramArm] = field(default_factory=dict)
    comparisons: tuple[ProgramComparison, ...] = ()
    replicas: tuple[ProgramReplica, ...] = ()
    transplants: tuple[ProgramTransplant, ...] = ()

    @property
    def layout(self) -> str:
        return self.program.partition(":")[0]

    def against_live(self, arm: str) -> ProgramComparison | None:
        return next((c for c in self.comparisons if c.arm == arm), None)


@dataclass(frozen=True)
class ProgramRecord(UnitRecord):
    """One item's stage program on one stack, a run per layout (packed, batched)."""

    KIND: typing.ClassVar[str] = "program"

    item: ItemRef
    model: str
    stack: dict                               # Stack.describe()
    status: str = "ok"
    ignore_eos: bool = False
    runs: tuple[ProgramRun, ...] = ()

    def run(self, layout: str) -> ProgramRun | None:
        return next((r for r in self.runs if r.layout == layout), None)

    def to_json(self, indent: int | None = None) -> str:
        return to_json(self, indent)


RECORD_KINDS[ProgramRecord.KIND] = ProgramRecord


def picture(segments) -> list[str]:
    """The stages and what each sees, as text: one row per stage (its tokens and positions),
    one column per stage it may see (`#` seen, `.` not)."""
    names = [s.segment for s in segments]
    short = ["P" if n == "prompt" else "M" if n == "merge" else n.removeprefix("branch ")
             for n in names]
    width = max(len(n) for n in names)
    lines = [f"{'':<{width}}  sees {' '.join(short)}   tokens      positions"]
    for s in segments:
        grid = " ".join("#".rjust(len(c)) if n in s.sees else ".".rjust(len(c))
                        for n, c in zip(names, short))
        tokens = f"{s.start}-{s.start + s.length - 1}"
        lines.append(f"{s.segment:<{width}}       {grid}   {tokens:<11} "
                     f"{s.positions[0]}-{s.positions[-1]}")
    return lines
