"""Run aggregates and run reports: Markdown, one self-contained HTML page, summary.json.

`aggregate(units, design)` turns a run's stored unit records into the per-stack numbers DESIGN.md
lists (disagreement vs live with Wilson intervals and the replica floor beside it, cache
bit-exactness, first bad layer, median d_rel per layer, first-divergence quartiles and histogram,
correctness and flips with a paired interval and exact McNemar p, transplant outcomes per
selection and row role, margins at divergence, the crossing 2x2). `show` and `report` both read
it. The report is one document (headings, tables, figures) rendered twice: Markdown without the
figures, HTML with them as inline SVG drawn here.
"""

from __future__ import annotations

import html
import json
import math
import shlex
from collections import Counter, defaultdict
from pathlib import Path

from harness import stats
from harness.envinfo import describe as describe_environment

OUTCOMES = ("donor", "recipient", "third", "boundary")
ROLES = ("divergent", "control", "unsampled")


# --------------------------------------------------------------------------- aggregates

def _rate(k: int, n: int) -> dict:
    lo, hi = stats.wilson_interval(k, n)
    return {"k": k, "n": n, "rate": k / n if n else None, "ci": [lo, hi]}


def _spread(xs: list[float]) -> dict:
    q1, q2, q3 = stats.quantiles(xs, (0.25, 0.5, 0.75))
    return {"n": len(xs), "median": q2, "q1": q1, "q3": q3}


def aggregate(units, design: dict | None = None) -> dict:
    """Per-stack aggregates (and the crossing) of stored units (`.item_index`, `.stack`,
    `.record`); `design` is the run's design (its transplant control sample)."""
    design = design or {}
    controls = set(design.get("control_indices", []))
    by_stack: dict[str, list] = defaultdict(list)
    for unit in units:
        by_stack[unit.stack].append(unit)
    out = {"stacks": {}, "crossing": None, "control_indices": sorted(controls)}
    for stack, group in by_stack.items():
        group.sort(key=lambda u: u.item_index)
        if stack == "crossing":
            out["crossing"] = _crossing(group)
        else:
            out["stacks"][stack] = _stack(group, controls)
    return _clean(out)


def _stack(units: list, controls: set[int]) -> dict:
    ok = [u for u in units if u.record["status"] == "ok"]
    first = units[0].record
    out = {"items": len(units), "ok": len(ok), "B": first["B"], "S": first["S"],
           "short": [u.record["item"]["id"] for u in units if u.record["status"] == "short"],
           "constructions": {}, "replicas": {}, "correctness": {}, "transplants": {},
           "batched_rows_identical": {}}
    comparisons: dict[tuple[str, str], list] = defaultdict(list)
    for u in ok:
        for c in u.record["comparisons"]:
            comparisons[(c["kind"], c["b"])].append((u, c))
    for (kind, label), rows in comparisons.items():
        if kind == "replica":
            cs = [c for _, c in rows]
            out["replicas"][label.rstrip("'")] = {
                **_rate(sum(not c["suffix"]["identical"] for c in cs), len(cs)),
                "cache_bit_exact": sum(bool((c.get("cache") or {}).get("bit_exact")) for c in cs)}
    for (kind, label), rows in comparisons.items():
        if kind != "replica":
            out["constructions"][label] = _construction(rows, kind, out["replicas"], out["S"])
    for label in (ok[0].record["arms"] if ok else {}):
        marks = [u.record["arms"][label]["correct"] for u in ok]
        scored = [m for m in marks if m is not None]
        out["correctness"][label] = _rate(sum(scored), len(scored))
        rows_identical = [u.record["arms"][label].get("rows_identical") for u in ok]
        if any(r is not None for r in rows_identical):
            out["batched_rows_identical"][label] = _rate(sum(bool(r) for r in rows_identical),
                                                         len(rows_identical))
    out["transplants"] = _transplants(ok, controls)
    return out


def _construction(rows: list, kind: str, replicas: dict, S: int) -> dict:
    cs = [c for _, c in rows]
    caches = [c["cache"] for c in cs if c.get("cache")]
    layers = max((len(c["layers"]) for c in caches), default=0)
    divergence = [c["suffix"]["first_divergence"] for c in cs if not c["suffix"]["identical"]]
    at_divergence, elsewhere = [], []
    for u, c in rows:   # margins of the reference (live) suffix
        margins, first = u.record["arms"][c["a"]]["suffix_margins"], c["suffix"]["first_divergence"]
        elsewhere += margins if first is None else margins[:first]
        if first is not None and first < len(margins):
            at_divergence.append(margins[first])
    width = max(1, math.ceil(S / 16))
    edges = list(range(0, S, width)) + [max(S, max(divergence, default=0) + 1)]
    pairs = [(u.record["arms"][c["a"]]["correct"], u.record["arms"][c["b"]]["correct"])
             for u, c in rows]
    pairs = [p for p in pairs if None not in p]
    return {
        "kind": kind, "vs": cs[0]["a"],
        "suffix_disagree": _rate(len(divergence), len(cs)),
        "replica_floor": replicas.get(cs[0]["b"]), "live_replica_floor": replicas.get(cs[0]["a"]),
        "cache_comparable": len(caches),
        "cache_bit_exact": _rate(sum(c["bit_exact"] for c in caches), len(caches)),
        "logits_bit_exact": sum(bool(c["logits"]["equal"]) for c in cs if c.get("logits")),
        "boundary_argmax_differs": sum(c["logits"]["argmax_agree"] is False for c in cs
                                       if c.get("logits")),
        "first_bad_layer": dict(sorted(Counter(
            "exact" if c["first_bad_layer"] is None else str(c["first_bad_layer"])
            for c in caches).items(), key=lambda kv: (kv[0] != "exact", _int(kv[0])))),
        "d_rel_median": stats.median([c["d_rel"] for c in caches]),
        "d_rel_per_layer": {kv: [stats.median([c["layers"][i][kv]["d_rel"] for c in caches
                                               if i < len(c["layers"])]) for i in range(layers)]
                            for kv in ("k", "v")},
        "d_rel_aggregation": "median over items of each layer's ||a-b||_F/||a||_F (K and V apart)",
        "first_divergence": {**_spread(divergence),
                             "histogram": stats.histogram(divergence, edges) if divergence else []},
        "margin_at_divergence": _spread(at_divergence),
        "margin_elsewhere": _spread(elsewhere),
        "correctness": stats.paired_difference([a for a, _ in pairs], [b for _, b in pairs])
        if pairs else None,
    }


def _int(text: str) -> int:
    return int(text) if text.isdigit() else -1


def _transplants(ok: list, controls: set[int]) -> dict:
    out: dict[str, dict] = {}
    for u in ok:
        for t in u.record["transplants"]:
            role = ("divergent" if not t.get("recipient_equals_donor", t.get("control")) else
                    "control" if u.item_index in controls else "unsampled")
            entry = out.setdefault(t["label"], {r: Counter() for r in ROLES})
            entry[role][t["outcome"]] += 1
    summary = lambda counts: {"n": sum(counts.values()), "outcomes": {
        o: _rate(counts[o], sum(counts.values())) for o in OUTCOMES}}
    return {label: {role: summary(counts) for role, counts in roles.items()}
            for label, roles in out.items()}


def _crossing(units: list) -> dict:
    ok = [u.record for u in units if u.record["status"] == "ok"]
    out = {"reference": units[0].record["reference"]["label"], "items": len(units),
           "ok": len(ok), "short": [u.record["item"]["id"] for u in units
                                    if u.record["status"] == "short"],
           "cells": {}, "within": {}}
    keys = list(ok[0]["cells"]) if ok else []
    for key in keys:
        stack, construction = key.split("|")
        same = [r["cells"][key]["same_as_reference_live"] for r in ok]
        out["cells"].setdefault(stack, {})[construction] = _rate(sum(same), len(same))
    for stack in out["cells"]:
        cs = [c for r in ok for c in r["comparisons"] if c["stack"] == stack]
        out["within"][stack] = {
            "pair": f"{cs[0]['a']}~{cs[0]['b']}" if cs else None,
            "suffix_disagree": _rate(sum(not c["suffix"]["identical"] for c in cs), len(cs)),
            "cache_bit_exact": sum(bool((c.get("cache") or {}).get("bit_exact")) for c in cs)}
    return out


def _clean(value):
    """NaN -> None and tuples -> lists, so the summary is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# --------------------------------------------------------------------------- formatting

def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _count(r: dict | None) -> str:
    """`k/n (rate) [lo, hi]`."""
    if not r:
        return "-"
    return f"{r['k']}/{r['n']} ({_pct(r['rate'])}) [{_pct(r['ci'][0])}, {_pct(r['ci'][1])}]"


def _num(x, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def headline_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """The headline table: one row per (stack, construction) compared with live."""
    head = ["stack", "construction", "ok/short", "suffix ≠ live [95% CI]", "replica floor",
            "cache bit-exact", "accuracy live → arm", "McNemar p"]
    rows = []
    for stack, s in summary["stacks"].items():
        for label, c in s["constructions"].items():
            paired = c["correctness"]
            accuracy = "-" if not paired else (f"{_pct(paired['accuracy_a'])} → "
                                               f"{_pct(paired['accuracy_b'])}")
            floor = c["replica_floor"]
            rows.append([stack, label + (" (bridge)" if c["kind"] == "bridge" else ""),
                         f"{s['ok']}/{len(s['short'])}", _count(c["suffix_disagree"]),
                         "-" if not floor else f"{floor['k']}/{floor['n']}",
                         f"{c['cache_bit_exact']['k']}/{c['cache_bit_exact']['n']}", accuracy,
                         "-" if not paired else _num(paired["mcnemar_p"])])
    return head, rows


def text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def headline(summary: dict) -> str:
    """The headline table, and the crossing's 2x2 under it when the run has one."""
    text = text_table(*headline_rows(summary))
    x = summary["crossing"]
    if x and x["cells"]:
        constructions = list(next(iter(x["cells"].values())))
        rows = [[stack] + [_count(cells.get(c)) for c in constructions]
                for stack, cells in x["cells"].items()]
        text += (f"\n\nprecision crossing, P frozen from {x['reference']} live "
                 f"({x['ok']} items; cells: suffix equals the reference live suffix)\n"
                 + text_table(["precision"] + constructions, rows))
    return text


def repro_command(case, stack_label: str, item_index: int, prompt: str) -> str:
    """The `kvfid repro` command that measures one unit of `case` again."""
    crossing = stack_label == "crossing"
    stack = case.crossing.reference if crossing else next(s for s in case.stacks
                                                          if s.label == stack_label)
    plan = case.plan(item_index)
    args = ["kvfid", "repro", "--model", case.model]
    if case.items.seed == 0:
        args += ["--item-set", case.items.set, "--item", str(item_index)]
    else:   # `repro --item-set` draws with seed 0 only; give the prompt itself
        args += ["--prompt", prompt]
    args += ["--backend", stack.backend, "--dtype", stack.dtype]
    args += ["--batch-invariant"] if stack.batch_invariant else []
    args += ["--device", stack.device]
    args += ["--threads", str(stack.threads)] if stack.threads else []
    args += ["-B", str(case.B), "-S", str(case.S), "--arms", ",".join(case.constructions)]
    args += ["--replicas", ",".join(plan.replicas)] if plan.replicas else []
    for spec in plan.transplants:
        args += ["--transplant", spec.label]
    args += ["--cross", ",".join(case.crossing.dtypes)] if crossing else []
    return shlex.join(args)


def repro_template(case, stack_label: str) -> str:
    """`repro_command` with the item left open: `--item <INDEX>` (or `--prompt <PROMPT>`)."""
    return repro_command(case, stack_label, 0, "<PROMPT>").replace("--item 0", "--item <INDEX>")


# --------------------------------------------------------------------------- the document

def _table(head, rows) -> tuple:
    return ("table", [str(h) for h in head], [[str(c) for c in r] for r in rows])


def document(run, case, summary: dict, units, raw_environment: bool = True) -> list[tuple]:
    """The report as blocks: (h1|h2|h3|p|pre, text), (table, head, rows), (figure, svg, caption),
    (details, title, block): a block the HTML folds away.
    `raw_environment` adds the environment record as JSON after its description."""
    prompts = {u.item_index: u.record["item"]["prompt"] for u in units
               if isinstance(u.record.get("item"), dict)}
    planned = run.design["units"]
    doc = [("h1", f"kvfid run {run.id}: {case.name}"),
           ("p", case.description or "(no description)"),
           _table(["run", run.id], [
               ["case", f"{run.case_source} (sha256 {run.case_sha[:16]})"],
               ["model", case.model],
               ["items", f"{case.items.set}, n={run.item_count}, seed={case.items.seed}"],
               ["B, S", f"{case.B}, {case.S}"],
               ["constructions", ", ".join(case.constructions)],
               ["status", f"{run.status}: {len(units)}/{planned} units stored"],
               ["started / finished", f"{run.started} / {run.finished or '-'}"],
               ["environment", run.environment_key],
               ["git revision", run.git_revision or "none"]]),
           ("h2", "Headline"), _table(*headline_rows(summary)),
           ("p", "Rates count items whose boundary state exists (short items, where EOS came "
                 "within the B live tokens, are counted apart). Intervals are 95% Wilson; the "
                 "replica floor is the same construction run twice.")]
    for label, s in summary["stacks"].items():
        doc += _stack_blocks(label, s, case, units, prompts)
    if summary["crossing"]:
        doc += _crossing_blocks(summary["crossing"], case)
    doc += [("h2", "Environment"), ("pre", describe_environment(run.environment))]
    if raw_environment:
        doc.append(("details", "the environment record (JSON)",
                    ("pre", json.dumps(run.environment, indent=1))))
    return doc


def _stack_blocks(label: str, s: dict, case, units, prompts: dict) -> list[tuple]:
    cons = s["constructions"]
    short = f"; short: {', '.join(s['short'])}" if s["short"] else ""
    out = [("h2", f"Stack {label}"), ("p", f"{s['items']} item(s), {s['ok']} with a boundary "
                                            f"state{short}. B={s['B']}, S={s['S']}.")]
    out += [("h3", "Suffix and cache against live"), _table(
        ["construction", "suffix ≠ live [95% CI]", "replica floor (arm)", "replica floor (live)",
         "cache bit-exact", "logits bit-exact", "boundary argmax differs", "median d_rel"],
        [[c, _count(x["suffix_disagree"]), _count(x["replica_floor"]),
          _count(x["live_replica_floor"]), _count(x["cache_bit_exact"]),
          f"{x['logits_bit_exact']}/{x['cache_comparable']}", x["boundary_argmax_differs"],
          _num(x["d_rel_median"])] for c, x in cons.items()])]
    out += [("h3", "First bad layer"), _table(
        ["construction", "distribution (first layer whose K or V differs)"],
        [[c, ", ".join(f"{k}: {n}" if k == "exact" else f"L{k}: {n}"
                       for k, n in x["first_bad_layer"].items()) or "-"]
         for c, x in cons.items()])]
    layers = max((len(x["d_rel_per_layer"]["k"]) for x in cons.values()), default=0)
    series = [(f"{c} {kv.upper()}", x["d_rel_per_layer"][kv]) for c, x in cons.items()
              for kv in ("k", "v")]
    if layers and not any(v for _, ys in series for v in ys):
        out += [("h3", "Median d_rel per layer"),
                ("p", "0 at every layer, K and V, for every construction: the median item's "
                      "cache is bit-exact layer by layer.")]
    elif layers:
        out += [("h3", "Median d_rel per layer"),
                ("figure", svg_lines(series, "layer", "median d_rel (log scale)"),
                 f"Median over items of ||a-b||_F/||a||_F per layer, K and V apart, {label}; "
                 f"hollow marks on the 0 line are bit-exact layers."),
                ("details", "the figure's numbers", _table(
                    ["layer"] + [name for name, _ in series],
                    [[i] + [_num(ys[i]) if i < len(ys) else "-" for _, ys in series]
                     for i in range(layers)]))]
    out += [("h3", "First divergence and margins"), _table(
        ["construction", "diverging", "first divergence median [q1, q3]",
         "live margin at divergence median [q1, q3]", "live margin at other steps median [q1, q3]"],
        [[c, x["first_divergence"]["n"], _quartiles(x["first_divergence"]),
          _quartiles(x["margin_at_divergence"]), _quartiles(x["margin_elsewhere"])]
         for c, x in cons.items()])]
    if any(x["first_divergence"]["histogram"] for x in cons.values()):
        out.append(("figure", svg_bars({c: x["first_divergence"]["histogram"]
                                        for c, x in cons.items()}, "first divergence index"),
                    f"First-divergence index of suffixes that differ from live, {label}."))
    out += [("h3", "Correctness"), _table(
        ["arm", "correct [95% CI]"], [[a, _count(r)] for a, r in s["correctness"].items()])]
    paired = [(c, x["correctness"]) for c, x in cons.items() if x["correctness"]]
    if paired:
        out.append(_table(
            ["live vs", "n", "live", "arm", "difference [95% CI]", "live right, arm wrong",
             "live wrong, arm right", "McNemar p"],
            [[c, p["n"], _pct(p["accuracy_a"]), _pct(p["accuracy_b"]),
              f"{_pct(p['difference'])} [{_pct(p['ci_low'])}, {_pct(p['ci_high'])}]",
              p["a_right_b_wrong"], p["a_wrong_b_right"], _num(p["mcnemar_p"])]
             for c, p in paired]))
    if s["batched_rows_identical"]:
        out.append(_table(["batched arm", "every row's state equals row 0's"],
                          [[a, _count(r)] for a, r in s["batched_rows_identical"].items()]))
    if s["transplants"]:
        out += [("h3", "Transplants"),
                ("p", "Rows: divergent (recipient and donor suffixes differ), control (exact rows "
                      "among the item sample fixed before the run: "
                      f"{_controls(case)}), unsampled (other exact rows, measured but outside "
                      "the design)."),
                _table(["recipient <- donor : selection", "rows", "n"] + list(OUTCOMES),
                       [[t, role, r["n"]] + [_count(r["outcomes"][o]) if r["n"] else "-"
                                             for o in OUTCOMES]
                        for t, roles in s["transplants"].items() for role, r in roles.items()])]
    rows = []
    for u in units:
        if u.stack != label or u.record["status"] != "ok":
            continue
        for c in u.record["comparisons"]:
            if c["kind"] != "replica" and not c["suffix"]["identical"]:
                rows.append([u.record["item"]["id"], c["b"], c["suffix"]["first_divergence"],
                             _num(c["suffix"]["margin_a_at_divergence"]),
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


def _controls(case) -> str:
    if not case.transplants:
        return "none"
    return ", ".join(map(str, case.transplants.control_indices(case.items.n))) or "none"


def _quartiles(x: dict) -> str:
    if not x["n"]:
        return "-"
    return f"{_num(x['median'])} [{_num(x['q1'])}, {_num(x['q3'])}] (n={x['n']})"


def _crossing_blocks(x: dict, case) -> list[tuple]:
    constructions = list(case.crossing.constructions)
    rows = []
    for stack, cells in x["cells"].items():
        within = x["within"][stack]
        rows.append([stack] + [_count(cells.get(c)) for c in constructions]
                    + [_count(within["suffix_disagree"]),
                       f"{within['cache_bit_exact']}/{within['suffix_disagree']['n']}"])
    pair = "~".join(constructions)
    return [("h2", "Precision crossing (fixed prefix)"),
            ("p", f"P frozen from the live run of {x['reference']}; every cell builds its state "
                  f"over that same P. {x['ok']} of {x['items']} items have a boundary"
                  f"{' (short: ' + ', '.join(x['short']) + ')' if x['short'] else ''}. Cells: "
                  "suffix equal to the reference live suffix."),
            _table(["precision"] + constructions + [f"{pair} suffix differs", f"{pair} cache "
                                                    "bit-exact"], rows),
            ("pre", repro_template(case, "crossing"))]


# --------------------------------------------------------------------------- figures (SVG)

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#17becf")
_W, _H, _L, _R, _T, _B = 720, 300, 64, 190, 16, 44


def _frame(xlabel: str, ylabel: str, body: list[str], legend: list[tuple[str, str, str]]) -> str:
    parts = [f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect x="{_L}" y="{_T}" width="{_W - _L - _R}" height="{_H - _T - _B}" '
             f'fill="none" stroke="#999"/>', *body,
             f'<text x="{(_L + _W - _R) / 2}" y="{_H - 8}" text-anchor="middle">'
             f'{html.escape(xlabel)}</text>',
             f'<text transform="translate(14 {(_T + _H - _B) / 2}) rotate(-90)" '
             f'text-anchor="middle">{html.escape(ylabel)}</text>']
    for i, (name, color, dash) in enumerate(legend):
        y = _T + 10 + 16 * i
        parts.append(f'<line x1="{_W - _R + 12}" x2="{_W - _R + 36}" y1="{y}" y2="{y}" '
                     f'stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>'
                     f'<text x="{_W - _R + 42}" y="{y + 4}">{html.escape(name)}</text>')
    return "".join(parts) + "</svg>"


def svg_lines(series: list[tuple[str, list]], xlabel: str, ylabel: str) -> str:
    """Lines on a log y axis; zero (bit-exact) values sit on a band below it, marked `0`."""
    values = [y for _, ys in series for y in ys if y]
    n = max((len(ys) for _, ys in series), default=1)
    lo = math.floor(math.log10(min(values))) if values else -8
    hi = max(lo + 1, math.ceil(math.log10(max(values)))) if values else -7
    span, zero = _H - _T - _B - 24, _H - _B - 6          # 24 px below the lowest decade: 0
    x = lambda i: _L + 10 + (_W - _L - _R - 20) * (i / max(1, n - 1))
    y = lambda v: _T + span * (1 - (math.log10(v) - lo) / (hi - lo)) if v else zero
    body = [f'<line x1="{_L}" x2="{_W - _R}" y1="{zero}" y2="{zero}" stroke="#eee"/>'
            f'<text x="{_L - 4}" y="{zero + 4}" text-anchor="end">0</text>']
    for e in range(lo, hi + 1):
        body.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{y(10.0 ** e):.1f}" '
                    f'y2="{y(10.0 ** e):.1f}" stroke="#eee"/><text x="{_L - 4}" '
                    f'y="{y(10.0 ** e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    step = max(1, math.ceil(n / 16))
    for i in range(0, n, step):
        body.append(f'<text x="{x(i):.1f}" y="{_H - _B + 14}" text-anchor="middle">{i}</text>')
    legend = []
    for k, (name, ys) in enumerate(series):
        color, dash = PALETTE[(k // 2) % len(PALETTE)], "" if k % 2 == 0 else "5 3"
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(ys) if v is not None)
        body.append(f'<polyline points="{points}" fill="none" stroke="{color}" '
                    f'stroke-width="1.6" stroke-dasharray="{dash}"/>')
        for i, v in enumerate(ys):
            if v is not None:
                fill = "white" if not v else color
                body.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="2.5" fill="{fill}" '
                            f'stroke="{color}"/>')
        legend.append((name, color, dash))
    return _frame(xlabel, ylabel, body, legend)


def svg_bars(histograms: dict[str, list], xlabel: str) -> str:
    """Grouped bars: one colour per series, bins [lo, hi) shared by all series."""
    edges = next((h for h in histograms.values() if h), [])
    top = max((count for h in histograms.values() for _, _, count in h), default=1) or 1
    width = (_W - _L - _R) / max(1, len(edges))
    bar = width * 0.8 / max(1, len(histograms))
    body = []
    for t in range(0, top + 1, max(1, math.ceil(top / 5))):
        yy = _H - _B - (_H - _T - _B) * t / top
        body.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/>'
                    f'<text x="{_L - 4}" y="{yy + 4:.1f}" text-anchor="end">{t}</text>')
    for b, (lo, hi, _) in enumerate(edges):
        label = str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}"
        body.append(f'<text x="{_L + width * (b + 0.5):.1f}" y="{_H - _B + 14}" '
                    f'text-anchor="middle">{label}</text>')
    legend = []
    for k, (name, h) in enumerate(histograms.items()):
        color = PALETTE[k % len(PALETTE)]
        legend.append((name, color, ""))
        for b, (_, _, count) in enumerate(h):
            height = (_H - _T - _B) * count / top
            body.append(f'<rect x="{_L + width * b + width * 0.1 + bar * k:.1f}" '
                        f'y="{_H - _B - height:.1f}" width="{bar:.1f}" height="{height:.1f}" '
                        f'fill="{color}"><title>{html.escape(name)}: {count}</title></rect>')
    return _frame(xlabel, "suffixes", body, legend)


# --------------------------------------------------------------------------- renderers

def markdown(doc: list[tuple]) -> str:
    """Markdown for terminals and pull requests (figures are in the HTML; their data is here)."""
    cell = lambda text: text.replace("|", "\\|").replace("\n", " ")
    out = []
    for block in doc:
        if block[0] == "details":
            block = block[2]
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + block[1])
        elif kind == "p":
            out.append(block[1])
        elif kind == "pre":
            out.append("```\n" + block[1] + "\n```")
        elif kind == "table":
            head, rows = block[1], block[2]
            out.append("\n".join(["| " + " | ".join(map(cell, head)) + " |",
                                  "|" + "---|" * len(head)]
                                 + ["| " + " | ".join(map(cell, r)) + " |" for r in rows]))
    return "\n\n".join(out) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;
color:#222}table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3}pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px;
white-space:pre-wrap;word-break:break-all}h2{border-bottom:1px solid #ddd;margin-top:32px}
figure{margin:8px 0 16px}figcaption{font-size:12px;color:#555}
summary{cursor:pointer;color:#555;font-size:13px;margin:4px 0}"""


def to_html(doc: list[tuple]) -> str:
    """One self-contained page: inline CSS and SVG, no external resource."""
    title = next((b[1] for b in doc if b[0] == "h1"), "kvfid report")
    out = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>"
           f"{html.escape(title)}</title><style>{_CSS}</style></head><body>"]
    for block in doc:
        out.append(_html_block(block))
    return "\n".join(out) + "\n</body></html>\n"


def _html_block(block: tuple) -> str:
    kind = block[0]
    if kind == "details":
        return (f"<details><summary>{html.escape(block[1])}</summary>{_html_block(block[2])}"
                f"</details>")
    if kind in ("h1", "h2", "h3", "p"):
        return f"<{kind}>{html.escape(block[1])}</{kind}>"
    if kind == "pre":
        return f"<pre>{html.escape(block[1])}</pre>"
    if kind == "table":
        head = "".join(f"<th>{html.escape(h)}</th>" for h in block[1])
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                       for r in block[2])
        return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
    if kind == "figure":
        return f"<figure>{block[1]}<figcaption>{html.escape(block[2])}</figcaption></figure>"
    raise ValueError(f"unknown report block {kind!r}")


def write_report(ledger, run_id: str, root: str | Path = "reports") -> dict[str, Path]:
    """Write report.md, report.html and summary.json to <root>/<environment key>/<run id>/."""
    from harness.case import stored_case

    run = ledger.run(run_id)
    units = ledger.units(run.id)
    case = stored_case(run)
    summary = aggregate(units, run.design)
    doc = document(run, case, summary, units)
    folder = Path(root) / run.environment_key / run.id
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / "report.md", "html": folder / "report.html",
             "summary": folder / "summary.json"}
    paths["markdown"].write_text(markdown(doc), encoding="utf-8")
    paths["html"].write_text(to_html(doc), encoding="utf-8")
    meta = {"run": run.id, "case": run.case_name, "case_sha": run.case_sha,
            "status": run.status, "started": run.started, "finished": run.finished,
            "environment_key": run.environment_key,
            "environment": run.environment, "git_revision": run.git_revision,
            "units": len(units), "planned_units": run.design["units"],
            "repro": {label: repro_template(case, label) for label in case.unit_labels}}
    paths["summary"].write_text(json.dumps({**meta, **summary}, indent=1), encoding="utf-8")
    return paths
