"""Presenting a regression comparison: report blocks, Markdown, one HTML page, files.

`document(result)` turns kvfid.compare.runs's result into blocks of the document engine
(kvfid.reports.document: headings, tables, the interval figure `svg_intervals` draws as inline
SVG); `render_markdown`, `render_html` and `write_comparison` (comparison.md, comparison.html,
comparison.json) present it. What makes A and B unlike runs leads the page when the comparison
was allowed anyway.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from kvfid.outputs import write_files
from kvfid.reports.document import (Code, Figure, Heading, Paragraph, Table, interval_text,
                                      markdown, ratio, seconds, to_html)
from kvfid.runs.summary import Rate

SHOWN = 40          # rows of a long list shown in the Markdown (the JSON has them all)


def _items(flips: list[dict]) -> str:
    shown = "; ".join(f"{f['item']} (A: {f['a']}; B: {f['b']})" for f in flips[:5])
    return shown + (f"; {len(flips) - 5} more" if len(flips) > 5 else "")


def document(result: dict) -> list:
    """The comparison as blocks of kvfid.reports.document."""
    a, b = result["a"], result["b"]
    verdict = (f"**REGRESSED**: {len(result['regressions'])} regression(s)."
               if result["regressed"] else "No regression.")
    doc = [Heading(f"kvfid compare: A {a['run']} vs B {b['run']}"), Paragraph(verdict)]
    doc += _unlike_blocks(result.get("differences") or [])
    doc += [Table(["", "A", "B"], [
                ["given as"] + [f"{s['spec']} ({s['resolved_by']})" for s in (a, b)],
                ["run", a["run"], b["run"]], ["ledger", a["ledger"], b["ledger"]],
                ["case"] + [f"{s['case']} ({s['case_sha'][:12]})" for s in (a, b)],
                ["model", a["model"] or "unknown", b["model"] or "unknown"],
                ["status", f"{a['status']}: {a['units']}/{a['planned_units']} units",
                 f"{b['status']}: {b['units']}/{b['planned_units']} units"],
                ["finished", a["finished"] or "-", b["finished"] or "-"],
                ["environment key", a["environment_key"], b["environment_key"]]]),
            Heading("Environment", 2),
            Paragraph("Environment variables that change numerics (which kernels run, with how "
                      "many threads, in what precision) have a row each, `env NAME`, where either "
                      "run set one; otherwise the row `numerics env` says none was set."),
            Table(["", "A", "B", "changed"],
                  [[p["part"], _none(p["a"]), _none(p["b"]), "**CHANGED**" if p["changed"] else ""]
                   for p in result["environment"]])]
    if result["regressions"]:
        doc += [Heading("Regressions", 2), Code("\n".join(result["regressions"]))]
    doc += [Heading("Rules", 2), Paragraph(result["rules"]["invariance"]),
            Paragraph(result["rules"]["intervals"]), Paragraph(result["rules"]["fingerprints"])]
    if result["notes"]:
        doc += [Heading("Notes", 2), Code("\n".join(result["notes"]))]
    for label, entry in result["stacks"].items():
        doc += _stack_blocks(label, entry)
    if result["only_a"] or result["only_b"]:
        doc += [Heading("Stacks in one run only (not compared)", 2),
                Table(["run", "stacks"], [["A", ", ".join(result["only_a"]) or "-"],
                                          ["B", ", ".join(result["only_b"]) or "-"]])]
    doc += (_kernel_blocks(result["kernels"], result["inputs"])
            + _bench_blocks(result["bench"], result["inputs"]))
    return doc


def _unlike_blocks(differences: list[dict]) -> list:
    """What makes A and B unlike runs, first on the page (they were compared anyway)."""
    if not differences:
        return []
    return [Heading("A and B are not like runs", 2),
            Paragraph("**Compared although they differ** (`--allow-different`) in "
                      f"{', '.join(d['what'] for d in differences)}: a verdict below compares "
                      "unlike things, and items or stacks the runs do not share are not compared."),
            Table(["differs", "A", "B"], [[d["what"], d["a"], d["b"]] for d in differences])]


def _none(x) -> str:
    return "n/a" if x is None else str(x)


def _stack_blocks(label: str, entry: dict) -> list:
    items = entry["items"]
    out = [Heading(f"Stack {label}" + (" (regressed)" if entry["regressed"] else ""), 2),
           Paragraph(f"{len(items['compared'])} item(s) with a boundary state in both runs."
                     + "".join(f" {name.replace('_', ' ')}: {', '.join(map(str, ids))}."
                               for name, ids in (("only in A", items["only_a"]),
                                                 ("only in B", items["only_b"]),
                                                 ("not comparable", items["not_comparable"]))
                               if ids)
                     + "".join(f" {s['item']}: {s['a']} in A, {s['b']} in B."
                               for s in items["status_changed"]))]
    if entry["verdicts"]:
        out += [Heading("Bit-exact verdicts, item by item", 3), Table(
            ["check", "construction", "A", "B", "status", "items that flipped"],
            [[v["check"], v["construction"], f"{v['a']['k']}/{v['a']['n']}",
              f"{v['b']['k']}/{v['b']['n']}", _status(v["status"], "regression"),
              _items(v["broke"] + v["fixed"]) or "-"] for v in entry["verdicts"]])]
    if entry["rates"]:
        out += [Heading("Rates with 95% Wilson intervals", 3), Table(
            ["measure", "construction", "A", "B", "change"],
            [[r["measure"], r["construction"], interval_text(Rate.from_plain(r["a"])),
              interval_text(Rate.from_plain(r["b"])),
              _status(r["status"], "worse")] for r in entry["rates"]]),
            Figure(svg_intervals(entry["rates"]),
                   f"Rates of {label}, A above B on each line, with 95% Wilson intervals.")]
    prints = entry["fingerprints"]
    out.append(Heading("Fingerprints", 3))
    if not entry["fingerprints_compared"]:
        out.append(Paragraph("not compared (the runs measured different models)."))
    elif not prints:
        out.append(Paragraph("identical on every item stored in both runs."))
    else:
        items_hit = sorted({d["item"] for d in prints})
        out += [Paragraph(f"{len(prints)} row(s) on {len(items_hit)} item(s) differ"
                          f"{f' (first {SHOWN} shown)' if len(prints) > SHOWN else ''}."),
                Table(["item", "row", "fields that differ", "what the records say"],
                      [[d["item"], f"{d['kind']} {d['label']}", ", ".join(d["fields"]),
                        d["detail"] or "-"] for d in prints[:SHOWN]])]
    return out


def _status(status: str, bad: str) -> str:
    """A status word, shouted when it is the bad one."""
    return f"**{status.upper()}**" if status == bad else status


def _kernel_blocks(kernels: dict | None, inputs: dict) -> list:
    if kernels is None:
        return []
    out = [Heading("Kernel invariance", 2),
           Paragraph(f"A: {inputs['kernels_a'] or 'none'}; B: {inputs['kernels_b'] or 'none'}.")]
    if "note" in kernels:
        return out + [Paragraph(kernels["note"])]
    changed = [r for r in kernels["rows"] if r["status"] != "same"]
    out.append(Paragraph(
        f"A measured on {kernels['a_environment_key']}, B on {kernels['b_environment_key']}; "
        f"{len(kernels['rows'])} verdicts compared, {len(changed)} changed. A claimed invariance "
        f"that held in A and fails in B is a regression; an unclaimed one (a stock path) that "
        f"changes is listed."))
    if changed:
        out.append(Table(["op", "impl", "dtype", "check", "claimed", "A", "B", "status",
                          "B's failure"],
                         [[r["op"], r["impl"], r["dtype"], r["check"], r["claimed"],
                           "invariant" if r["a"] else "NOT", "invariant" if r["b"] else "NOT",
                           _status(r["status"], "regression"), r["detail"] or "-"]
                          for r in changed]))
    for name, rows in (("A", kernels["only_a"]), ("B", kernels["only_b"])):
        if rows:
            out.append(Paragraph(f"Only in {name}: {', '.join(rows)}."))
    return out


def _bench_blocks(bench: dict | None, inputs: dict) -> list:
    if bench is None:
        return []
    out = [Heading("Kernel time", 2),
           Paragraph(f"A: {inputs['bench_a'] or 'none'}; B: {inputs['bench_b'] or 'none'}.")]
    if "note" in bench:
        return out + [Paragraph(bench["note"])]
    out += [Paragraph(f"Median of each benchmark, B against A; slower by more than "
                      f"{bench['threshold']:.0%} is a regression."),
            Table(["benchmark", "A median", "B median", "B / A", "status"],
                  [[r["name"], seconds(r["previous_median_s"]), seconds(r["median_s"]),
                    ratio(r["ratio"]), _status(r["status"], "regression")]
                   for r in bench["rows"]])]
    if bench.get("removed"):
        out.append(Paragraph(f"Only in A: {', '.join(bench['removed'])}."))
    return out


def svg_intervals(rates: list[dict]) -> str:
    """One line per rate: A's and B's point and 95% interval on a 0-100% axis."""
    left, width, line, top = 300, 380, 26, 18
    height = top + line * len(rates) + 30
    x = lambda v: left + width * v
    parts = [f'<svg viewBox="0 0 {left + width + 20} {height}" width="{left + width + 20}" '
             f'height="{height}" role="img" font-family="sans-serif" font-size="11">']
    for tick in (0, 0.25, 0.5, 0.75, 1):
        parts.append(f'<line x1="{x(tick):.1f}" x2="{x(tick):.1f}" y1="{top - 6}" '
                     f'y2="{height - 24}" stroke="#eee"/><text x="{x(tick):.1f}" '
                     f'y="{height - 10}" text-anchor="middle">{int(tick * 100)}%</text>')
    for i, r in enumerate(rates):
        y = top + line * i
        name = html.escape(f"{r['measure']}: {r['construction']}")
        color = "#d62728" if r["status"] == "worse" else "#222"
        parts.append(f'<text x="{left - 8}" y="{y + 9}" text-anchor="end" fill="{color}">'
                     f'{name}</text>')
        for offset, side, stroke in ((0, "a", "#1f77b4"), (10, "b", "#ff7f0e")):
            rate = Rate.from_plain(r[side])
            lo, hi = rate.ci
            yy = y + offset + 1
            parts.append(f'<line x1="{x(lo):.1f}" x2="{x(hi):.1f}" y1="{yy}" y2="{yy}" '
                         f'stroke="{stroke}" stroke-width="2"><title>{side.upper()}: '
                         f'{html.escape(interval_text(rate))}</title></line>')
            if rate.rate is not None:
                parts.append(f'<circle cx="{x(rate.rate):.1f}" cy="{yy}" r="3" '
                             f'fill="{stroke}"/>')
    parts.append(f'<text x="{left}" y="{top - 8}" fill="#1f77b4">A</text>'
                 f'<text x="{left + 14}" y="{top - 8}" fill="#ff7f0e">B</text>')
    return "".join(parts) + "</svg>"


def render_markdown(result: dict) -> str:
    """The comparison as Markdown (the interval figures are in the HTML)."""
    return markdown(document(result))


def render_html(result: dict) -> str:
    """The comparison as one self-contained HTML page (inline CSS and SVG)."""
    return to_html(document(result))


def write_comparison(result: dict, out_dir) -> dict[str, Path]:
    """Write comparison.md, comparison.html and comparison.json to `out_dir`."""
    folder = Path(out_dir)
    return write_files({"markdown": (folder / "comparison.md", render_markdown(result)),
                        "html": (folder / "comparison.html", render_html(result)),
                        "json": (folder / "comparison.json", json.dumps(result, indent=1))})
