"""A case's stage program (`[program]`, kvfid.stages.program): read and checked on load.

A program case's units are (stack, item) like any case's, but each unit measures the item's
stage program at its merge boundary: `constructions` are the arms (live and those that rebuild
it), `S` the merge's suffix, `[replicas]` arms built twice, `[transplants]` pairs and selections
at the merge boundary (`segment=NAME` names one stage's positions). B (the program's stages are
its boundary) and `[crossing]` do not apply. What depends on the item's prompt (the stages'
positions, the model's context) is checked per item by kvfid.runs.program_matrix, still before
any compute.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace

from kvfid.protocol.constructions import ProtocolError, parse_transplant
from kvfid.stages.program import LAYOUTS, POSITIONS, Program, parse_program
from kvfid.stages.checks import check_arms, parse_sees, stage_names
from kvfid.runs.case_fields import CaseError

KEYS = {"layout", "branches", "branch_tokens", "merge_tokens", "positions", "sees"}
NOT_PROGRAM = ("B", "crossing")


@dataclass(frozen=True)
class ProgramCase:
    """The program every item runs, once per layout, and its transplants as `R<-D:SELECTION`
    texts (a `segment=NAME` selection becomes positions once the item's prompt is known)."""

    programs: tuple[Program, ...]
    transplants: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The program as `repro --program` spells it, its layouts joined by `|`."""
        return " | ".join(p.label for p in self.programs)


def read_program(v, data: dict, constructions: tuple[str, ...], replicas: tuple[str, ...]):
    """`[program]` and what a program case's other keys may say; CaseError (exit 2) naming the
    file and key."""
    for key in NOT_PROGRAM:
        if key in data:
            raise CaseError(f"{v.source}: key {key!r} does not apply to a program case (one with "
                            f"[program]); its boundary is the program's merge boundary")
    t = v.table(data, "program")
    if isinstance(t.get("layout"), str):     # one layout, or a list of them
        layouts = (t["layout"],)
    else:
        layouts = v.choices(t, "program", "layout", list(LAYOUTS), None)
    for layout in layouts:
        if layout not in LAYOUTS:
            v.fail("program", "layout", layout, ", ".join(LAYOUTS))
    positions = v.optional(t, "program", "positions", str, "continuing")
    if positions not in POSITIONS:
        v.fail("program", "positions", positions, ", ".join(POSITIONS))
    counts = ("branches", "branch_tokens", "merge_tokens")
    for key in counts:
        v.required(t, "program", key, int)
    sizes = [v.integer(t, "program", key, 0, minimum=0) for key in counts]
    sees = v.optional(t, "program", "sees", dict, {})
    for stage, seen in sees.items():
        if not isinstance(seen, list) or not all(isinstance(x, str) for x in seen):
            v.fail("program", f"sees.{stage}", seen, "a list of stage names")
    programs = []
    try:
        for layout in layouts:
            program = parse_program(f"{layout}:{sizes[0]}x{sizes[1]}+{sizes[2]}:{positions}")
            programs.append(replace(program, sees=parse_sees(program, sees) if sees else ()))
        if "live" not in constructions:
            raise ProtocolError("constructions: a stage program's arms are compared with live; "
                                "include it")
        check_arms(constructions)
    except ProtocolError as err:
        said = str(err).replace("--program ", "[program] ").replace("--constructions ", "constructions: ")
        raise CaseError(f"{v.source}: {said}") from None
    for arm in replicas:
        if arm not in constructions:
            v.fail("replicas", "arms", arm, f"one of the constructions ({', '.join(constructions)})")
    moves = (_transplants(v, data["transplants"], programs[0], constructions)
             if "transplants" in data else ())
    return ProgramCase(tuple(programs), moves)


def _transplants(v, t: dict, program: Program, arms: tuple[str, ...]) -> tuple[str, ...]:
    """Every pair with every selection, each checked with a stage's name in place of its
    positions (which need the item's prompt)."""
    for key in ("controls", "seed"):
        if key in t:
            raise CaseError(f"{v.source}: [transplants] {key} does not apply to a program case: "
                            f"every item's transplants are measured and counted")
    pairs = v.strings(t, "transplants", "pairs", None)
    selections = v.strings(t, "transplants", "selections", ["all"])
    names = stage_names(program)
    for selection in selections:
        for name in re.findall(r"segment=(\w+)", selection):
            if name not in names:
                v.fail("transplants", "selections", selection,
                       f"segment=NAME with NAME one of {', '.join(names)}")
        try:
            parse_transplant("live<-prefill:" + re.sub(r"segment=\w+", "positions=0-1", selection))
        except ProtocolError as err:
            v.fail("transplants", "selections", selection, str(err))
    for pair in pairs:
        try:
            spec = parse_transplant(f"{pair}:all")
        except ProtocolError as err:
            v.fail("transplants", "pairs", pair, f"RECIPIENT<-DONOR ({err})")
        for arm in (spec.recipient, spec.donor):
            if arm not in arms:
                v.fail("transplants", "pairs", pair, f"arms among the constructions "
                       f"({', '.join(arms)})")
    return tuple(dict.fromkeys(f"{p}:{s}" for p, s in itertools.product(pairs, selections)))
