"""The run report's Stage program section: the program (a picture of the stages and what each
sees), then per (stack, layout, arm) at the merge boundary the cache verdict against live, how
often the suffix differs, the first bad segment and layer, the replicas and the transplants
(kvfid.runs.aggregate `program`), and the `kvfid repro --program` command of a unit."""

from __future__ import annotations

import shlex

from kvfid.records.program import picture
from kvfid.reports.document import interval_text
from kvfid.runs.summary import LayoutAggregate


def _counted(counts: dict) -> str:
    return ", ".join(f"{name}: {n}" for name, n in counts.items()) or "-"


def _cells(program: dict[str, dict[str, LayoutAggregate]]):
    """(stack, layout, its aggregate) in the summary's order."""
    return [(stack, layout, s) for stack, layouts in program.items()
            for layout, s in layouts.items()]


def program_rows(program: dict[str, dict[str, LayoutAggregate]]
                 ) -> tuple[list[str], list[list[str]]]:
    """One row per (stack, layout, arm): the headline of a program run."""
    head = ["stack", "layout", "arm vs live", "cache bit-exact", "suffix ≠ live [95% CI]",
            "first bad segment", "first bad layer", "replica floor"]
    rows = []
    for stack, layout, s in _cells(program):
        for arm, a in s.arms.items():
            floor = s.replicas.get(arm)
            rows.append([stack, layout, arm, f"{a.cache_bit_exact.k}/{a.cache_bit_exact.n}",
                         interval_text(a.suffix_disagree), _counted(a.first_bad_segment),
                         _counted(a.first_bad_layer),
                         "-" if not floor else f"cache {floor.cache_bit_exact.k}/"
                                               f"{floor.cache_bit_exact.n} bit-exact"])
    return head, rows


def program_blocks(program: dict[str, dict[str, LayoutAggregate]], case) -> list[tuple]:
    """The Stage program section as document blocks."""
    blocks = [("h2", "Stage program"),
              ("p", f"{case.program.label}: every arm compared with live at the merge boundary "
                    f"(S={case.S}). Each picture is its layout's first item: a row is a stage, "
                    "# the stages its queries see.")]
    pictures = {}
    for _, layout, s in _cells(program):
        pictures.setdefault(layout, [s.program, *picture(s.segments)])
    blocks += [("pre", "\n".join(lines)) for lines in pictures.values()]
    blocks.append(("table", *program_rows(program)))
    replicas = [[stack, layout, arm, f"{r.cache_bit_exact.k}/{r.cache_bit_exact.n}",
                 f"{r.suffix_identical}/{r.cache_bit_exact.n}"]
                for stack, layout, s in _cells(program) for arm, r in s.replicas.items()]
    if replicas:
        blocks += [("h3", "Replicas"), ("table", ["stack", "layout", "arm", "cache bit-exact",
                                                  "suffix identical"], replicas)]
    moved = [[stack, layout, label, _counted(outcomes)] for stack, layout, s in _cells(program)
             for label, outcomes in s.transplants.items()]
    if moved:
        blocks += [("h3", "Transplants at the merge boundary"),
                   ("table", ["stack", "layout", "transplant", "outcomes (items)"], moved)]
    differ = [[stack, layout, arm, _counted(a.segments_differ)]
              for stack, layout, s in _cells(program) for arm, a in s.arms.items()
              if a.segments_differ]
    if differ:
        blocks += [("h3", "Segments whose keys or values differ from live"),
                   ("table", ["stack", "layout", "arm", "segment (items)"], differ)]
    blocks.append(("pre", "\n".join(program_command(case, s, p) for s in case.stacks
                                    for p in case.program.programs)))
    return blocks


def program_command(case, stack, program=None) -> str:
    """The `kvfid repro --program` command that measures one unit of a program case again (in
    `program`'s layout; the first layout's by default)."""
    program = program or case.program.programs[0]
    item = (["--item-set", case.items.set, "--item", "<INDEX>"] if case.items.seed == 0 else
            ["--prompt", "<PROMPT>"])    # `repro --item-set` draws with seed 0 only
    args = ["kvfid", "repro", "--model", case.model, *item, "--program", program.label,
            "--stack", stack.label, "--device", stack.device,
            "-S", str(case.S), "--constructions", ",".join(case.constructions)]
    args += ["--ignore-eos"] if case.ignore_eos else []
    args += ["--replicas", ",".join(case.replicas.arms)] if case.replicas.arms else []
    for move in case.program.transplants:
        args += ["--transplant", move]
    return shlex.join(args).replace("'<INDEX>'", "<INDEX>").replace("'<PROMPT>'", "<PROMPT>")
