"""The reports index: each environment's newest headline figures, side by side.

`update_index()` reads the `summary.json` of every run report under `reports/<environment
key>/<run id>/` (written by `report.write_report`) and, optionally, the runs of ledger files
(summarised on the fly; nothing is written for them), keeps the newest run per (environment key,
case), and writes `reports/index.md` and `reports/index.html`. Per case, one row per environment
key: GPU, driver, CUDA, torch and triton as columns, then per stack the headline construction's
(prefill's) cache bit-exact rate against live and suffix divergence rate with its 95% Wilson
interval, the replica floor and the bridge's bit-exact count, then the run, its date and git
revision. Reading down a column shows what a driver or CUDA upgrade changed. Each run links its
report (report.md from the Markdown, report.html from the HTML) and each environment key its
kernel table; both pages go through harness.reports.document.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.outputs import write_files
from harness.reports.document import (Heading, Link, Paragraph, Table, fraction, interval_text,
                                      markdown, to_html)
from harness.runs.aggregate import aggregate
from harness.runs.ledger import Ledger, LedgerError

HEADLINE = "prefill"    # the construction whose figures a row shows (else the case's first one)


def update_index(reports_dir="reports", ledgers=()) -> Path:
    """Write <reports_dir>/index.md and index.html; returns the Markdown file's path."""
    root = Path(reports_dir)
    entries = newest(collect_entries(root, ledgers))
    doc = index_document(entries)
    return write_files({"html": (root / "index.html", to_html(doc)),
                        "markdown": (root / "index.md", markdown(doc))})["markdown"]


# --------------------------------------------------------------------------- gathering runs

def collect_entries(root: Path, ledgers=()) -> list[dict]:
    """One entry per run: from each summary.json under `root`, and each run in `ledgers` (its
    aggregates are computed later, and only if it is the newest of its environment and case)."""
    entries = []
    for path in sorted(Path(root).rglob("summary.json")):
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(summary, dict) or not {"run", "environment_key",
                                                 "stacks"} <= set(summary):
            continue    # another JSON file called summary.json, not a run report's
        entries.append({**_meta(summary), "stacks": summary["stacks"],
                        "report": _beside(path, "report.md", root),
                        "report_html": _beside(path, "report.html", root)})
    for db in ledgers:
        if not Path(db).is_file():
            raise LedgerError(f"{db}: no ledger file")
        with Ledger(db, readonly=True) as ledger:
            for run, _ in ledger.runs():
                entries.append({**_meta({"run": run.id, "case": run.case_name,
                                         "status": run.status,
                                         "environment_key": run.environment_key,
                                         "environment": run.environment,
                                         "git_revision": run.git_revision,
                                         "started": run.started}),
                                "stacks": None, "report": None, "report_html": None,
                                "ledger": str(db)})
    for entry in entries:
        key_dir = root / entry["environment_key"]
        entry["kernels"] = _beside(key_dir / "kernels.json", "kernels.md", root)
        entry["kernels_html"] = _beside(key_dir / "kernels.json", "kernels.html", root)
    return entries


def _beside(path: Path, name: str, root: Path) -> str | None:
    """`name` in `path`'s folder, relative to `root` (a link from the index), if it exists."""
    found = Path(path).parent / name
    return found.relative_to(root).as_posix() if found.is_file() else None


def _meta(summary: dict) -> dict:
    return {"run": summary["run"], "case": summary.get("case") or "?",
            "status": summary.get("status"), "environment_key": summary["environment_key"],
            "environment": summary.get("environment") or {},
            "git_revision": summary.get("git_revision"),
            # When the run started: ledger runs and (newer) summaries say; a run id starts with it.
            "date": _seconds(summary.get("started")) or _date_of(summary["run"])}


def _seconds(stamp: str | None) -> str | None:
    """An ISO UTC time to the second, so a report's and a ledger's copy of one run tie."""
    return f"{stamp[:19]}Z" if stamp and len(stamp) >= 19 else None


def _date_of(run_id: str) -> str | None:
    """The UTC start time a run id begins with (YYYYmmdd-HHMMSS), ISO-formatted."""
    m = re.match(r"(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})(\d{2})", run_id)
    return f"{m[1]}-{m[2]}-{m[3]}T{m[4]}:{m[5]}:{m[6]}Z" if m else None


def newest(entries: list[dict]) -> list[dict]:
    """The newest run per (environment key, case), finished runs before any other status; a run
    found both as a report and in a ledger is taken from its report."""
    reported = {e["run"] for e in entries if e["stacks"] is not None}
    best: dict[tuple[str, str], dict] = {}
    rank = lambda e: (e["status"] == "finished", e["date"] or "", e["run"])
    for entry in entries:
        if entry["stacks"] is None and entry["run"] in reported:
            continue
        key = (entry["environment_key"], entry["case"])
        if key not in best or rank(entry) > rank(best[key]):
            best[key] = entry
    out = list(best.values())
    for entry in out:
        if entry["stacks"] is None:
            with Ledger(entry["ledger"], readonly=True) as ledger:
                run = ledger.run(entry["run"])
                try:
                    entry["stacks"] = aggregate(ledger.units(run.id), run.design)["stacks"]
                except (KeyError, TypeError, ValueError) as err:   # an older record format
                    entry["stacks"] = {}
                    entry["status"] = f"{entry['status']} (not aggregated: {err!r})"
    return out


# --------------------------------------------------------------------------- the page

def environment_columns(environment: dict) -> list[str]:
    """GPU, driver, CUDA (runtime), torch, triton of an environment record."""
    gpus, versions = environment.get("gpus") or [], environment.get("versions") or {}
    if gpus:
        gpu = f"{gpus[0].get('name')}" + (f" x{len(gpus)}" if len(gpus) > 1 else "")
    else:
        cpu = environment.get("cpu") or {}
        name = " ".join(str(p) for p in (cpu.get("model"), cpu.get("capability")) if p)
        gpu = f"none (CPU {name})" if name else "none (CPU)"
    driver = gpus[0].get("driver_version") if gpus else None
    return [gpu] + [v or "-" for v in (driver, versions.get("cuda_runtime"),
                                        versions.get("torch"), versions.get("triton"))]


def stack_cells(s: dict | None) -> list[str]:
    """Headline construction bit-exact vs live, its suffix divergence [CI], replica floor,
    bridge bit-exact."""
    if not s:
        return ["-"] * 4
    cons = s.get("constructions") or {}
    arms = [label for label, c in cons.items() if c.get("kind") != "bridge"]
    label = HEADLINE if HEADLINE in cons else (arms[0] if arms else None)
    bridge = next((c for c in cons.values() if c.get("kind") == "bridge"), None)
    if label is None:
        return ["-", "-", "-", fraction(bridge and bridge["cache_bit_exact"])]
    c = cons[label]
    named = "" if label == HEADLINE else f" ({label})"
    floor = c.get("replica_floor") or next(iter((s.get("replicas") or {}).values()), None)
    return [fraction(c["cache_bit_exact"], rate=True) + named, interval_text(c["suffix_disagree"]),
            fraction(floor), fraction(bridge and bridge["cache_bit_exact"])]


def _natural(text: str) -> list:
    """Sort key that orders 535.x before 1000.x (numbers compared as numbers)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", text) if p]


def _git(revision: str | None) -> str:
    if not revision:
        return "-"
    return revision[:12] + ("+dirty" if revision.endswith("+dirty") else "")


def _report_link(entry: dict, text: str | None = None):
    """The run's report as a link (report.md; report.html from the HTML page), else plain text."""
    if not entry["report"]:
        return text or f"not written (from {entry.get('ledger', 'a ledger')})"
    return Link(text or "report", entry["report"], entry.get("report_html"))


def index_document(entries: list[dict]) -> list:
    """The index as blocks of harness.reports.document: one table per case, one row per
    environment key; each run links its report."""
    doc = [Heading("kvfid reports index"),
           Paragraph("The newest run of each case on each environment key (finished runs first). "
                     f"Per stack: the cache bit-exact rate of {HEADLINE} against live, its suffix "
                     "divergence rate with the 95% Wilson interval, the replica floor (the same "
                     "construction run twice: runs whose suffixes differ), and the bridge (live "
                     "vs incremental) cache bit-exact count. A run links its report. "
                     "`kvfid compare KEY_A KEY_B` reports what changed between two rows of one "
                     "case.")]
    if not entries:
        return doc + [Paragraph("No run reports yet: `kvfid report RUN` writes one.")]
    for case in sorted({e["case"] for e in entries}):
        rows = sorted((e for e in entries if e["case"] == case),
                      key=lambda e: [_natural(c) for c in environment_columns(e["environment"])])
        stacks = list(dict.fromkeys(s for e in rows for s in e["stacks"]))
        head = ["GPU", "driver", "CUDA", "torch", "triton"]
        for s in stacks:
            head += [f"{s}: {HEADLINE} bit-exact", f"{s}: suffix ≠ live [95% CI]",
                     f"{s}: replica floor", f"{s}: bridge bit-exact"]
        head += ["run", "started (UTC)", "git", "status"]
        body = []
        for e in rows:
            cells = environment_columns(e["environment"])
            for s in stacks:
                cells += stack_cells(e["stacks"].get(s))
            run = _report_link(e, e["run"]) if e["report"] else e["run"]
            body.append(cells + [run, (e["date"] or "-")[:16].replace("T", " "),
                                 _git(e["git_revision"]), e["status"] or "-"])
        doc += [Heading(f"Case {case}", 2), Table(head, body)]
    shown = sorted(entries, key=lambda e: (e["case"], _natural(e["environment_key"])))
    doc += [Heading("Runs shown", 2),
            Table(["environment key", "case", "run", "report", "kernel table"],
                  [[e["environment_key"], e["case"], e["run"], _report_link(e),
                    Link("kernels", e["kernels"], e["kernels_html"]) if e["kernels"] else "-"]
                   for e in shown])]
    return doc
