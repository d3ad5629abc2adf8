"""Run reports: Markdown, one self-contained HTML page, summary.json.

The report is one document (headings, tables, figures) built from a run's aggregates
(kvfid.runs.aggregate) and rendered twice: Markdown without the figures, HTML with them as inline SVG
(kvfid.reports.figures). This module owns that document, its two renderers, the headline table that
`show` prints, the `kvfid repro` command of a unit, and `write_report`. `aggregate`, `svg_lines`
and `svg_bars` are re-exported here for callers that reach them as `report.X`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from kvfid.runs.aggregate import OUTCOMES, ROLES, aggregate  # noqa: F401 (re-exported)
from kvfid.environment.envinfo import describe as describe_environment
from kvfid.reports.figures import PALETTE, svg_bars, svg_lines  # noqa: F401 (re-exported)
from kvfid.outputs import write_files
from kvfid.reports.paper_report import endpoint_blocks, side_by_side_blocks
from kvfid.reports.program_report import program_blocks, program_command, program_rows
from kvfid.reports.replay_report import replay_blocks, replay_command, replay_rows
from kvfid.reports.document import (interval_text, markdown, number, percent,  # noqa: F401
                                      text_table, to_html)
from kvfid.runs.summary import (ConstructionAggregate, CrossingAggregate, RunSummary, Spread,
                                StackAggregate)
from kvfid.runs.case import stored_case


def headline_rows(summary: RunSummary) -> tuple[list[str], list[list[str]]]:
    """The headline table: one row per (stack, construction) compared with live."""
    head = ["stack", "construction", "ok/short", "suffix ≠ live [95% CI]", "replica floor",
            "cache bit-exact", "accuracy live → arm", "McNemar p"]
    rows = []
    for stack, s in summary.stacks.items():
        for label, c in s.constructions.items():
            paired = c.correctness
            accuracy = "-" if not paired else (f"{percent(paired.accuracy_a)} → "
                                               f"{percent(paired.accuracy_b)}")
            floor = c.replica_floor
            rows.append([stack, label + (" (bridge)" if c.kind == "bridge" else ""),
                         f"{s.ok}/{len(s.short)}", interval_text(c.suffix_disagree),
                         "-" if not floor else f"{floor.k}/{floor.n}",
                         f"{c.cache_bit_exact.k}/{c.cache_bit_exact.n}", accuracy,
                         "-" if not paired else number(paired.mcnemar_p)])
    return head, rows


def headline(summary: RunSummary) -> str:
    """The headline table, the crossing's 2x2 under it when the run has one, and the replay's
    rows when it replayed trajectories."""
    text = text_table(*headline_rows(summary)) if summary.stacks else ""
    if summary.replay:
        text += ("\n\n" if text else "") + ("replayed trajectories against step-by-step "
                                             "generation\n" + text_table(*replay_rows(summary.replay)))
    if summary.program:
        text += ("\n\n" if text else "") + ("stage program, arms against live at the merge "
                                             "boundary\n" + text_table(*program_rows(summary.program)))
    x = summary.crossing
    if x and x.cells:
        constructions = list(next(iter(x.cells.values())))
        rows = [[stack] + [interval_text(cells.get(c)) for c in constructions]
                for stack, cells in x.cells.items()]
        text += (f"\n\nprecision crossing, P frozen from {x.reference} live "
                 f"({x.ok} items; cells: suffix equals the reference live suffix)\n"
                 + text_table(["precision"] + constructions, rows))
    return text


def repro_command(case, stack_label: str, item_index: int, prompt: str) -> str:
    """The `kvfid repro` command that measures one unit of `case` again."""
    return _repro(case, case.stack(stack_label), item_index, prompt, crossing=False)


def crossing_repro_command(case, item_index: int, prompt: str) -> str:
    """The `kvfid repro --cross` command that measures one item's precision crossing again."""
    return _repro(case, case.crossing.reference, item_index, prompt, crossing=True)


def _repro(case, stack, item_index: int, prompt: str, crossing: bool) -> str:
    plan = case.plan(item_index)
    args = ["kvfid", "repro", "--model", case.model]
    if case.items.seed == 0:
        args += ["--item-set", case.items.set, "--item", str(item_index)]
    else:   # `repro --item-set` draws with seed 0 only; give the prompt itself
        args += ["--prompt", prompt]
    args += ["--stack", stack.label, "--device", stack.device]
    args += ["-B", str(case.B), "-S", str(case.S), "--constructions", ",".join(case.constructions)]
    args += ["--ignore-eos"] if case.ignore_eos else []
    args += ["--replicas", ",".join(plan.replicas)] if plan.replicas else []
    for spec in plan.transplants:
        args += ["--transplant", spec.label]
    args += ["--cross", ",".join(case.crossing.dtypes)] if crossing else []
    return shlex.join(args)


def repro_template(case, stack_label: str) -> str:
    """`repro_command` with the item left open: `--item <INDEX>` (or `--prompt <PROMPT>`)."""
    return _open_item(repro_command(case, stack_label, 0, "<PROMPT>"))


def crossing_repro_template(case) -> str:
    """`crossing_repro_command` with the item left open."""
    return _open_item(crossing_repro_command(case, 0, "<PROMPT>"))


def _open_item(command: str) -> str:
    return command.replace("--item 0", "--item <INDEX>")


# --------------------------------------------------------------------------- the document

def _table(head, rows) -> tuple:
    return ("table", [str(h) for h in head], [[str(c) for c in r] for r in rows])


def document(run, case, summary: RunSummary, units, raw_environment: bool = True) -> list[tuple]:
    """The report as blocks: (h1|h2|h3|p|pre, text), (table, head, rows), (figure, svg, caption),
    (details, title, block): a block the HTML folds away.
    `raw_environment` adds the environment record as JSON after its description."""
    prompts = {u.item_index: u.record.item.prompt for u in units}
    planned = run.design["units"]
    design = ([["trajectories", f"{case.replay.trajectories}, n={run.item_count}"],
               ["replay constructions", ", ".join(case.replay.constructions)]] if case.replay else
              [["items", f"{case.items.set}, n={run.item_count}, seed={case.items.seed}"],
               ["program, S", f"{case.program.label}, {case.S}"] if case.program else
               ["B, S", f"{case.B}, {case.S}"], ["constructions", ", ".join(case.constructions)]])
    doc = [("h1", f"kvfid run {run.id}: {case.name}"),
           ("p", case.description or "(no description)"),
           _table(["run", run.id], [
               ["case", f"{run.case_source} (sha256 {run.case_sha[:16]})"],
               ["model", case.model], *design,
               ["status", f"{run.status}: {len(units)}/{planned} units stored"],
               ["started / finished", f"{run.started} / {run.finished or '-'}"],
               ["environment", run.environment_key],
               ["git revision", run.git_revision or "none"]])]
    if summary.program:
        doc += program_blocks(summary.program, case)
    elif not case.replay:
        doc += [("h2", "Headline"), _table(*headline_rows(summary)),
                ("p", "Rates count items whose boundary state exists (short items, where EOS "
                      "came within the B live tokens, are counted apart). Intervals are 95% "
                      "Wilson; the replica floor is the same construction run twice.")]
        doc += endpoint_blocks(summary) + side_by_side_blocks(summary, case, run)
    for label, s in summary.stacks.items():
        doc += _stack_blocks(label, s, case, units, prompts)
    if summary.crossing:
        doc += _crossing_blocks(summary.crossing, case)
    if summary.replay:
        doc += replay_blocks(summary.replay, case, summary.replay_engine)
    doc += [("h2", "Environment"), ("pre", describe_environment(run.environment))]
    if raw_environment:
        doc.append(("details", "the environment record (JSON)",
                    ("pre", json.dumps(run.environment, indent=1))))
    return doc


def _kinds_text(kinds: dict | None) -> str:
    """`rounding / functional / unsettled` counts (kvfid.states.scale), `-` for older records."""
    if not kinds:
        return "-"
    return " / ".join(str(kinds.get(k, 0)) for k in ("rounding", "functional", "unsettled"))


def _stack_blocks(label: str, s: StackAggregate, case, units, prompts: dict) -> list[tuple]:
    cons = s.constructions
    short = f"; short: {', '.join(s.short)}" if s.short else ""
    out = [("h2", f"Stack {label}"), ("p", f"{s.items} item(s), {s.ok} with a boundary "
                                            f"state{short}. B={s.B}, S={s.S}.")]
    out += [("h3", "Suffix and cache against live"), _table(
        ["construction", "suffix ≠ live [95% CI]", "replica floor (arm)", "replica floor (live)",
         "cache bit-exact", "logits bit-exact", "boundary argmax differs", "median d_rel",
         "differs by rounding / functionally / unsettled"],
        [[c, interval_text(x.suffix_disagree), interval_text(x.replica_floor),
          interval_text(x.live_replica_floor), interval_text(x.cache_bit_exact),
          f"{x.logits_bit_exact}/{x.cache_comparable}", x.boundary_argmax_differs,
          number(x.d_rel_median), _kinds_text(x.differences)] for c, x in cons.items()])]
    functional = [c for c, x in cons.items() if (x.differences or {}).get("functional")]
    if functional:
        out.append(("p", f"{', '.join(functional)}: a functional difference from live: the two "
                         "paths compute different functions (the model's code or kvfid's), far "
                         "above rounding in fp32 too. It is not numerics; no kernel or precision "
                         "makes it agree."))
    out += [("h3", "First bad layer"), _table(
        ["construction", "distribution (first layer whose K or V differs)"],
        [[c, ", ".join(f"{k}: {n}" if k == "exact" else f"L{k}: {n}"
                       for k, n in x.first_bad_layer.items()) or "-"]
         for c, x in cons.items()])]
    out += d_rel_blocks(label, cons)
    out += [("h3", "First divergence and margins"), _table(
        ["construction", "diverging", "first divergence median [q1, q3]",
         "live margin at divergence median [q1, q3]", "live margin at other steps median [q1, q3]"],
        [[c, x.first_divergence.n, _quartiles(x.first_divergence),
          _quartiles(x.margin_at_divergence), _quartiles(x.margin_elsewhere)]
         for c, x in cons.items()])]
    if any(x.first_divergence.histogram for x in cons.values()):
        out.append(("figure", svg_bars({c: x.first_divergence.histogram
                                        for c, x in cons.items()}, "first divergence index"),
                    f"First-divergence index of suffixes that differ from live, {label}."))
    out += [("h3", "Correctness"), _table(
        ["arm", "correct [95% CI]"], [[a, interval_text(r)] for a, r in s.correctness.items()])]
    paired = [(c, x.correctness) for c, x in cons.items() if x.correctness]
    if paired:
        out.append(_table(
            ["live vs", "n", "live", "arm", "difference [95% CI]", "live right, arm wrong",
             "live wrong, arm right", "McNemar p"],
            [[c, p.n, percent(p.accuracy_a), percent(p.accuracy_b),
              f"{percent(p.difference)} [{percent(p.ci_low)}, {percent(p.ci_high)}]",
              p.a_right_b_wrong, p.a_wrong_b_right, number(p.mcnemar_p)]
             for c, p in paired]))
    if s.batched_rows_identical:
        out.append(_table(["batched arm", "every row's state equals row 0's"],
                          [[a, interval_text(r)] for a, r in s.batched_rows_identical.items()]))
    if s.transplants:
        out += [("h3", "Transplants"),
                ("p", "Rows: divergent (recipient and donor suffixes differ), control (exact rows "
                      "among the item sample fixed before the run: "
                      f"{_controls(case)}), unsampled (other exact rows, measured but outside "
                      "the design)."),
                _table(["recipient <- donor : selection", "rows", "n"] + list(OUTCOMES),
                       [[t, role, r.n] + [interval_text(r.outcomes[o]) if r.n else "-"
                                          for o in OUTCOMES]
                        for t, roles in s.transplants.items() for role, r in roles.items()])]
    rows = []
    for u in units:
        if u.stack != label or u.is_crossing or not u.record.ok:
            continue
        for c in u.record.comparisons:
            if not c.suffix.identical:
                rows.append([u.record.item.id, c.b, c.suffix.first_divergence,
                             number(c.suffix.margin_a_at_divergence),
                             repro_command(case, label, u.item_index,
                                           prompts.get(u.item_index, ""))])
    out += [("h3", "Reproduce"),
            ("pre", repro_template(case, label))]
    if rows:
        shown = rows[:20]
        out += [("p", f"Rows whose suffix differs from live ({len(rows)}"
                      f"{', first 20 shown' if len(rows) > 20 else ''}):"),
                _table(["item", "construction", "first divergence", "live margin there",
                        "command"], shown)]
    return out


def d_rel_blocks(label: str, cons: dict[str, ConstructionAggregate]) -> list[tuple]:
    """The median d_rel per layer of each construction, one series per part (k, v, recurrent,
    conv, ...): a figure and its numbers, or one line when every layer is bit-exact."""
    series = [(f"{c} {part.upper()}", ys) for c, x in cons.items()
              for part, ys in x.d_rel_per_layer.items()]
    layers = max((len(ys) for _, ys in series), default=0)
    if not layers:
        return []
    if not any(v for _, ys in series for v in ys):
        return [("h3", "Median d_rel per layer"),
                ("p", "0 at every layer and part, for every construction: the median item's "
                      "cache is bit-exact layer by layer.")]
    return [("h3", "Median d_rel per layer"),
            ("figure", svg_lines(series, "layer", "median d_rel (log scale)"),
             f"Median over items of ||a-b||_F/||a||_F per layer, each part apart, {label}; "
             f"hollow marks on the 0 line are bit-exact layers."),
            ("details", "the figure's numbers", _table(
                ["layer"] + [name for name, _ in series],
                [[i] + [number(ys[i]) if i < len(ys) and ys[i] is not None else "-"   # no such part
                         for _, ys in series] for i in range(layers)]))]


def _controls(case) -> str:
    if not case.transplants:
        return "none"
    return ", ".join(map(str, case.transplants.control_indices(case.items.n))) or "none"


def _quartiles(x: Spread) -> str:
    if not x.n:
        return "-"
    return f"{number(x.median)} [{number(x.q1)}, {number(x.q3)}] (n={x.n})"


def _crossing_blocks(x: CrossingAggregate, case) -> list[tuple]:
    constructions = list(case.crossing.constructions)
    rows = []
    for stack, cells in x.cells.items():
        within = x.within[stack]
        rows.append([stack] + [interval_text(cells.get(c)) for c in constructions]
                    + [interval_text(within.suffix_disagree),
                       f"{within.cache_bit_exact}/{within.suffix_disagree.n}"])
    pair = "~".join(constructions)
    return [("h2", "Precision crossing (fixed prefix)"),
            ("p", f"P frozen from the live run of {x.reference}; every cell builds its state "
                  f"over that same P. {x.ok} of {x.items} items have a boundary"
                  f"{' (short: ' + ', '.join(x.short) + ')' if x.short else ''}. Cells: "
                  "suffix equal to the reference live suffix."),
            _table(["precision"] + constructions + [f"{pair} suffix differs", f"{pair} cache "
                                                    "bit-exact"], rows),
            ("pre", crossing_repro_template(case))]


def write_report(ledger, run_id: str, root: str | Path = "reports", *, units=None,
                 summary: RunSummary | None = None) -> dict[str, Path]:
    """Write report.md, report.html and summary.json to <root>/<environment key>/<run id>/;
    `units` and `summary`, when the caller has them, are the run's stored units and aggregates."""
    run = ledger.run(run_id)
    units = ledger.units(run.id) if units is None else units
    case = stored_case(run)
    summary = aggregate(units, run.design) if summary is None else summary
    doc = document(run, case, summary, units)
    folder = Path(root) / run.environment_key / run.id
    meta = {"run": run.id, "case": run.case_name, "case_sha": run.case_sha,
            "status": run.status, "started": run.started, "finished": run.finished,
            "environment_key": run.environment_key,
            "environment": run.environment, "git_revision": run.git_revision,
            "units": len(units), "planned_units": run.design["units"],
            "repro": {**{s.label: replay_command(case, s) if case.replay else
                         program_command(case, s) if case.program else
                         repro_template(case, s.label) for s in case.stacks},
                      **({"crossing": crossing_repro_template(case)} if case.crossing else {})}}
    return write_files({"markdown": (folder / "report.md", markdown(doc)),
                        "html": (folder / "report.html", to_html(doc)),
                        "summary": (folder / "summary.json",
                                    json.dumps({**meta, **summary.to_plain()}, indent=1))})
