"""The kernel invariance table: kvfid.environment.invariance's result as a document.

One row per op x implementation x dtype with both bitwise checks and the verdict, then the stock
probes (kvfid.environment.probes), the implementations not run here, and the result line.
`write_result` files it as <reports>/<environment key>/kernels.json, kernels.md and kernels.html.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfid.kernels.invariant.route import Route
from kvfid.outputs import write_files
from kvfid.reports.document import (Bullets, Heading, Paragraph, Table, markdown, number,
                                      to_html)


def _claims(claims: dict) -> str:
    return "+".join(name for name in ("batch", "sequence") if claims[name]) or "none"


def _verdict(row: dict) -> str:
    if row.get("control"):
        return "control caught" if row["ok"] else "**CONTROL MISSED**"
    if not row["ok"]:
        return "**FAIL**"
    if row["claims"]["batch"] or row["claims"]["sequence"]:
        return "ok"
    return ("stock invariant here" if row["batch"]["invariant"] and row["sequence"]["invariant"]
            else "-")


def _versions(record: dict) -> str:
    v, git = record.get("versions", {}), record.get("git")
    revision = "no git checkout" if git is None else \
        f"git {git['revision'][:12]}{' (dirty)' if git['dirty'] else ''}"
    return (f"torch {v.get('torch')}, triton {v.get('triton')}, transformers "
            f"{v.get('transformers')}, Python {v.get('python')}, {revision}")


def _row(row: dict) -> list:
    b, s = row["batch"], row["sequence"]
    position = s["first_differing_position"]
    return [row["op"], row["impl"], row["dtype"], _claims(row["claims"]),
            "yes" if b["invariant"] else "NO", b["first_failing_batch"] or "-",
            number(b["max_abs_diff"]), s["kind"], "yes" if s["invariant"] else "NO",
            "-" if position is None else position, number(s["max_abs_diff"]), _verdict(row)]


def probe_blocks(rows: list[dict]) -> list:
    """The stock probes: per op, dtype and check, the first witness or "stock invariant here"."""
    items = []
    for row in rows:
        w = row["witness"]
        if w is None:
            found = "stock invariant here (no witness in the grid)"
        else:
            where = f"batch {w['batch']}" if "batch" in w else f"position {w['position']}"
            found = (f"varies: {w['shape']}, first at {where}, max abs diff "
                     f"{number(w['max_abs_diff'])}")
        items.append(f"{row['op']} / {row['dtype']} / {row['check']}: {found}")
    return [Paragraph("Stock probes (a fixed grid of shapes searched for a witness; findings of "
                      "this machine):"), Bullets(items)]


def route_lines(routes: dict[str, dict]) -> list[str]:
    """The tiled mode's route per dtype (kvfid.kernels.invariant.route) and the timings it was chosen by."""
    lines = []
    for name, r in sorted(routes.items()):
        route, stock = Route(**r["route"]), r.get("stock_ms")
        text, spec = f"{name}: {route.text()}", route.spec()
        if stock and isinstance(r.get("costs_ms", {}).get(spec), list):
            decode, prefill = r["costs_ms"][spec]
            text += (f" ({r['product']}, 1 row / {r['prefill_rows']} rows: stock {stock['decode']:.3g} / "
                     f"{stock['prefill']:.3g} ms, this route {decode:.3g} / {prefill:.3g} ms)")
        lines.append(f"{text}; {r.get('source', '')}")
    return lines


def tiled_blocks(probes: list[dict], routes: dict[str, dict] | None = None) -> list:
    """The tiled mode's routes and probes of this run: how many call shapes were trusted, and a
    line for each that runs row by row instead (a row's bits depended on its place in the tile)."""
    failed = [p for p in probes if p["failed"]]
    lines = [f"{p['call']} at {p['threads']} thread(s): {p['failed']}; rowwise there" for p in failed]
    head = ([Paragraph("Tiled mode routes (timed on this machine, kept per machine; "
                       "`KVFID_TILED_ROUTE` pins them):"), Bullets(route_lines(routes))] if routes else [])
    return head + [Paragraph(f"Tiled mode probes (each stock call shape checked on this machine before "
                      f"its tiles are trusted): {len(probes) - len(failed)} of {len(probes)} "
                      f"trusted" + (", the others run row by row:" if failed else ".")),
            *([Bullets(lines)] if lines else [])]


def invariance_document(result: dict) -> list:
    """The comparison as blocks of kvfid.reports.document."""
    shapes = result["shapes"]
    doc = [Heading(f"Kernel invariance ({'quick' if result['quick'] else 'full'}, "
                   f"{result['device']}, {result['threads']} torch threads)"),
           Paragraph(f"Environment: `{result['environment_key']}`; "
                     f"{_versions(result['environment'])}"),
           Paragraph(f"Batch sizes: {', '.join(map(str, result['batch_sizes']))}. Bits compared; "
                     "`yes` = bit-identical everywhere checked."),
           Paragraph("Rows checked alone: every row, except for Triton rows in the interpreter "
                     f"(a sample: rows 0-{shapes['alone_first'] - 1} for row ops, "
                     f"0-{shapes['attention_alone_first'] - 1} for attention, and each batch's "
                     "last row)."),
           Paragraph("`twin` rows are deliberately variant controls (reduction split chosen from "
                     "the shape): each check must catch them. A stock row that passes both checks "
                     "is marked \"stock invariant here\": stock numerics differ between machines, "
                     "so that is a finding."),
           Table(["op", "impl", "dtype", "claims", "batch-invariant", "first failing batch",
                  "max abs diff", "sequence check", "sequence-invariant",
                  "first differing position", "max abs diff", "verdict"],
                 [_row(r) for r in result["rows"]])]
    if result.get("stock_probes"):
        doc += probe_blocks(result["stock_probes"])
    if result.get("tiled_probes") is not None:
        doc += tiled_blocks(result["tiled_probes"], result.get("tiled_routes") or {})
    if result["skipped"]:
        doc.append(Bullets([f"Not run here: {i['op']} / {i['impl']} ({i['why']})."
                            for i in result["skipped"]]))
    failed = "; ".join(f"{r['op']} / {r['impl']} / {r['dtype']}"
                       for r in result["rows"] if not r["ok"])
    verdict = ("ok: every implementation that claims invariance is invariant, and every variant "
               "twin was caught." if result["ok"] else
               f"FAILED (claimed invariance broken, or a twin not caught): {failed}")
    return doc + [Paragraph(f"Result: {verdict}"),
                  Paragraph(f"Duration: {result['duration_s']:.1f} s.")]


def render_table(result: dict) -> str:
    """The comparison as Markdown (`kvfid kernels`, kernels.md)."""
    return markdown(invariance_document(result))


def write_result(result: dict, reports) -> Path:
    """File a comparison as <reports>/<environment key>/kernels.json, kernels.md and kernels.html;
    returns the .md path."""
    folder = Path(reports) / result["environment_key"]
    doc = invariance_document(result)
    return write_files({"json": (folder / "kernels.json", json.dumps(result, indent=1)),
                        "markdown": (folder / "kernels.md", markdown(doc)),
                        "html": (folder / "kernels.html", to_html(doc))})["markdown"]
