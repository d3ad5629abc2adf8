"""The reports index: each environment's newest headline figures, side by side.

`update_index()` reads the `summary.json` of every run report under `reports/<environment
key>/<run id>/` (written by `report.write_report`) and, optionally, the runs of ledger files
(summarised on the fly; nothing is written for them), keeps the newest run per (environment key,
case), and writes `reports/index.md` and `reports/index.html`: per case a grid of environments
and stacks (kvfid.reports.index_page). Each run links its report (report.md from the Markdown,
report.html from the HTML) and each environment key its kernel table; both pages go through
kvfid.reports.document. Engine load runs (`kvfid engine-load --report`) are listed after the
grids, one row per `engine-load.json` found (the newest per environment key and engine label).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvfid.outputs import write_files
from kvfid.reports.document import markdown, to_html
from kvfid.reports.index_page import index_document
from kvfid.runs.aggregate import aggregate
from kvfid.ledger.store import Ledger, LedgerError
from kvfid.records.engine_load import EngineLoadRecord
from kvfid.records.read import from_json


def update_index(reports_dir="reports", ledgers=()) -> Path:
    """Write <reports_dir>/index.md and index.html; returns the Markdown file's path."""
    root = Path(reports_dir)
    entries = newest(collect_entries(root, ledgers))
    doc = index_document(entries, load_entries(root))
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
        entries.append({**_meta(summary), "stacks": grid_stacks(summary),
                        "repro": summary.get("repro") or {},
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


def load_entries(root: Path) -> list[dict]:
    """The newest engine load run per (environment key, engine label) whose report is under
    `root`: its record and the links to its report."""
    best: dict[tuple[str, str], dict] = {}
    for path in sorted(Path(root).rglob("engine-load.json")):
        try:
            record = from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(record, EngineLoadRecord):
            continue
        entry = {"id": path.parent.name, "environment_key": path.parent.parent.relative_to(root).as_posix(),
                 "record": record, "report": _beside(path, "report.md", root),
                 "report_html": _beside(path, "report.html", root)}
        key = (entry["environment_key"], record.label)
        if key not in best or entry["id"] > best[key]["id"]:
            best[key] = entry
    return [best[k] for k in sorted(best)]


def grid_stacks(summary: dict) -> dict:
    """What the grid's columns show of a run: its stacks, or a program run's (stack, layout)
    pairs with their arms against live as constructions."""
    return summary["stacks"] or {f"{stack} {layout}": {"constructions": s["arms"]}
                                 for stack, layouts in (summary.get("program") or {}).items()
                                 for layout, s in layouts.items()}


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
                    entry["stacks"] = grid_stacks(aggregate(ledger.units(run.id),
                                                            run.design).to_plain())
                except (KeyError, TypeError, ValueError) as err:   # an older record format
                    entry["stacks"] = {}
                    entry["status"] = f"{entry['status']} (not aggregated: {err!r})"
    return out
