"""Transplants at a stage program's merge boundary (kvfid.stages.program): recipient R's
tokens, mask, positions and boundary logits kept, its state replaced by donor D's (all of it, a
layer range, keys or values only, a position range, or one stage's positions: `segment=NAME`,
NAME one of prompt, branch1 .. branchN, merge), then the suffix decoded in the merge. Outcomes
as the one-stream protocol's: `donor`, `recipient`, `third`, or `boundary` when the two boundary
argmaxes already differ. Here: the selections spelled and checked before compute; the
protocol's transplant runs them (kvfid.stages.program.transplant)."""

from __future__ import annotations

import re

from kvfid.protocol.constructions import ProtocolError, TransplantSpec, parse_transplant


def segment_ranges(prompt_length: int, program, opener_lengths: list[int]) -> dict:
    """Each stage's positions [lo, hi) in the merge boundary, known before compute."""
    ranges, at = {"prompt": (0, prompt_length)}, prompt_length
    lengths = [program.branch_tokens] * program.branches + [program.merge_tokens]
    names = [f"branch{i + 1}" for i in range(program.branches)] + ["merge"]
    for name, opener, length in zip(names, opener_lengths, lengths):
        ranges[name] = (at, at + opener + length)
        at += opener + length
    return ranges


def parse(text: str, ranges: dict, arms: tuple[str, ...]) -> TransplantSpec:
    """`R<-D[:SELECTION]` with `segment=NAME` allowed in the selection; ProtocolError (exit 2)
    naming what is allowed, before compute."""
    def segment(found: re.Match) -> str:
        name = found[1]
        if name not in ranges:
            raise ProtocolError(f"--transplant {text}: segment {name!r}; valid: {', '.join(ranges)}")
        lo, hi = ranges[name]
        return f"positions={lo}-{hi}"

    spec = parse_transplant(re.sub(r"segment=(\w+)", segment, text))
    for side in (spec.recipient, spec.donor):
        if side not in arms:
            raise ProtocolError(f"--transplant {text}: {side} is not among the arms ({', '.join(arms)})")
    return spec
