"""The precision crossing at a stage program's merge boundary (kvfid.stages.program): the
program's integers frozen from one stack's live run (tokens, segments, positions, so the same
mask), then in each crossed stack both `incremental` and `prefill` rebuilt over them and their
suffixes compared with the reference live suffix. Every cell starts from the same integers, so a
difference between cells is the precision's or the construction's, never another history."""

from __future__ import annotations

from dataclasses import dataclass

from kvfid.states import cache as kv
from kvfid.stages.program import Measured, cache_exact, rebuild

CONSTRUCTIONS = ("incremental", "prefill")


@dataclass(frozen=True)
class CrossedArm:
    """One construction on one crossed stack over the frozen program."""

    stack: str
    arm: str
    cache_sha: str
    suffix: tuple[int, ...]
    suffix_equals_reference: bool


@dataclass(frozen=True)
class CrossedStack:
    """Whether a crossed stack's two constructions gave the merge boundary one state."""

    stack: str
    bit_exact: bool


@dataclass(frozen=True)
class ProgramCrossing:
    """The crossing of one measured program: the reference stack's label, the cells, and each
    crossed stack's two constructions against each other."""

    reference: str
    cells: tuple[CrossedArm, ...]
    within: tuple[CrossedStack, ...]


def run_program_crossing(model, measured: Measured, reference: str, stacks, S: int,
                 eos_ids) -> ProgramCrossing:
    """Per crossed stack: both constructions' suffixes against the reference live suffix (the
    program `measured` on the stack labelled `reference`), and whether the two constructions'
    caches have the same bits."""
    layout, run = measured.layout, measured.run
    expected = run.arms["live"].suffix
    cells, within = [], []
    for stack in stacks:
        with stack.activate(model) as module:
            built = {label: rebuild(module, layout, label, run.prompt_length, S, eos_ids)
                     for label in CONSTRUCTIONS}
        within.append(CrossedStack(stack.label, cache_exact(*built.values())))
        cells += [CrossedArm(stack.label, label, kv.sha_cache(arm.state), tuple(arm.suffix.tokens),
                             tuple(arm.suffix.tokens) == tuple(expected))
                  for label, arm in built.items()]
    return ProgramCrossing(reference, tuple(cells), tuple(within))
