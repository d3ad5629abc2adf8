"""The price table as a document (kvfid.reports.document): one row per row of work, each arm's
median, faithful over stock, the TP-invariant products' own share, the floor beside a decode row;
the run's environment above it. Stored as `reports/<environment key>/price/<UTC stamp>.json`
(kvfid.records.price's JSON) and `.md` beside it, both rewritten after every row.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvfid.outputs import write_files
from kvfid.records.price import FAITHFUL, SPANS, TP_PRODUCTS, STOCK, PriceRow, PriceTable, over, to_json
from kvfid.reports.document import Heading, Paragraph, Table, markdown, seconds


def new_price_path(reports, environment_key: str) -> Path:
    """A free name for a new table of this key: `<reports>/<key>/price/<UTC stamp>[-N].json`."""
    folder = Path(reports) / environment_key / "price"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = folder / f"{stamp}.json", 1
    while target.exists() or target.with_suffix(".md").exists():
        n += 1
        target = folder / f"{stamp}-{n}.json"
    return target


def write_table(table: PriceTable, path: Path) -> dict[str, Path]:
    """The table's JSON at `path` and its Markdown beside it, both or neither."""
    return write_files({"json": (path, to_json(table) + "\n"),
                        "markdown": (path.with_suffix(".md"), render_markdown(table))})


def _times(row: PriceRow, name: str) -> str:
    arm = row.arm(name)
    return seconds(arm.median_s) if arm and arm.median_s is not None else "-"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _floor(row: PriceRow) -> str:
    f = row.floor
    if f is None:
        return "-"
    if f.route == SPANS:        # each product by its own key's span (kvfid.tasks.price.floor)
        return (f"{_x(f.ratio)}: {f.products} products by the faithful mode's calls (each "
                f"product's span) {seconds(f.padded.median_s)}, against one stock call of {f.rows} "
                f"row(s) {seconds(f.own.median_s)}; {f.rounds} round(s)")
    tile = f.route.split(":")[-1]
    calls = "one call" if "whole:" in f.route else f"calls of {tile}"
    return (f"{_x(f.ratio)}: {f.products} products by route {f.route} ({f.padded_rows} rows in "
            f"{calls}) {seconds(f.padded.median_s)}, against one stock call of {f.rows} "
            f"row(s) {seconds(f.own.median_s)}; {f.rounds} round(s)")


def _cells(row: PriceRow) -> list[str]:
    if row.skipped:
        return [row.model, row.work, "-", "-", "-", "-", "-", "-", "-", "0", f"skipped: {row.skipped}"]
    tp = row.arm(TP_PRODUCTS)
    note = "; ".join(filter(None, [row.note, "" if row.order == "interleaved" else row.order]))
    return [row.model, row.work, _times(row, STOCK), _times(row, FAITHFUL), _x(row.ratio),
            _x(row.cpu_ratio), f"{_times(row, TP_PRODUCTS)} ({_x(over(tp, row.arm(STOCK)))})" if tp else "-",
            _x(over(tp, row.arm(FAITHFUL))) if tp else "-", _floor(row), str(row.rounds), note]


def _labels(table: PriceTable) -> str:
    seen = {}
    for row in table.rows:
        for arm in row.arms:
            if row.order == "interleaved":
                seen.setdefault(arm.name, arm.stack)
    return "; ".join(f"{name}: `{label}`" for name, label in seen.items()) or "-"


def price_document(table: PriceTable) -> list:
    """The table as document blocks."""
    env = table.environment
    cpu, git = env.get("cpu") or {}, env.get("git") or {}
    versions = env.get("versions") or {}
    routes = ", ".join(f"{k} {'widen:' if r.get('widen') else ''}{'whole:' if r.get('whole') else ''}"
                       f"{r.get('tile')}" for k, r in sorted((env.get("tiled_routes") or {}).items())) \
        or "none kept"
    revision = (git.get("revision") or "-")[:7] + ("+dirty" if git.get("dirty") else "")
    plan = table.plan
    return [
        Heading("Price: faithful against stock", level=1),
        Paragraph(f"Environment `{table.environment_key}`: {cpu.get('model', '-')} "
                  f"({cpu.get('capability', '-')}), torch {versions.get('torch', '-')}, "
                  f"transformers {versions.get('transformers', '-')}, revision {revision}; "
                  f"{table.threads} torch thread(s); tiled routes kept: {routes}. Started "
                  f"{table.started}, {table.status}"
                  + (f" {table.finished}" if table.finished else "") + "."),
        Paragraph(f"Stacks: {_labels(table)}. Each row's arms were timed in one interleaved run "
                  "(an untimed warm-up round, then rounds calling every arm once, the order "
                  "rotated each round); a figure is the median of its arm's timed calls, the "
                  "ratio faithful median / stock median, and beside it the same ratio of this "
                  "thread's CPU time per call (on a shared machine other jobs stretch wall time "
                  "much more; an engine row has none). Decode rows: one step of the sequences "
                  f"after a cache of that many keys each (seeded random keys and values; "
                  f"{plan.get('context')} keys at "
                  f"{', '.join(map(str, plan.get('sequences') or ())) or 'no'} sequences). The TP-product "
                  "column is the faithful stack at @tp1 (its row-parallel products in fixed "
                  "segments added in an fp32 tree, as TP=N against TP=1 needs) against the "
                  "faithful stack without them. The floor: "
                  "the step's products at the rows the faithful route pads them to, against "
                  "one call at the step's own rows, stock kernels, interleaved."),
        Table(["model", "work", "stock", "faithful", "faithful / stock", "in CPU time",
               "at @tp1 (/ stock)", "TP products", "floor", "rounds", "note"],
              [_cells(row) for row in table.rows]),
    ]


def render_markdown(table: PriceTable) -> str:
    return markdown(price_document(table))
