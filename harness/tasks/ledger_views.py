"""What the reading commands show of a ledger: `runs`, `show`, `report`. Each opens the ledger
read-only (kvfid.ledger.opening), so reading a ledger never changes its bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfid.errors import BadInput
from kvfid.ledger.lease import shown_status
from kvfid.ledger.store import Ledger, default_db_path
from kvfid.reports import report
from kvfid.reports.document import text_table
from kvfid.reports.index import update_index
from kvfid.runs.case import stored_case
from kvfid.tasks.publish import publish, publish_run


def db_path(db: str | Path | None) -> Path:
    """The ledger a command uses: `--db`, else $KVFID_DB, else reports/ledger.sqlite."""
    return Path(db) if db else default_db_path()


def list_runs(db: str | Path | None) -> list[dict]:
    """Every run with its unit counts; `status` is `died` for a run whose processes are gone."""
    with Ledger(db_path(db), readonly=True) as ledger:
        return [{"id": r.id, "case": r.case_name, "status": shown_status(r.status,
                                                                        ledger.leases(r.id)),
                 "units": n, "planned": r.design["units"], "environment": r.environment_key,
                 "git": r.git_revision, "started": r.started, "finished": r.finished}
                for r, n in ledger.runs()]


def runs_text(rows: list[dict]) -> str:
    """`kvfid runs` as a table."""
    return text_table(["run", "case", "status", "units", "started", "environment"],
                      [[r["id"], r["case"], r["status"], f"{r['units']}/{r['planned']}",
                        r["started"], r["environment"]] for r in rows])


def headline(db: str | Path | None, run_id: str) -> str:
    """The headline table of a run (what `kvfid run` prints when it ends)."""
    with Ledger(db_path(db), readonly=True) as ledger:
        stored = ledger.run(run_id)
        return report.headline(report.aggregate(ledger.units(stored.id), stored.design))


def show_run(db: str | Path | None, run_id: str, fmt: str = "text") -> str:
    """A run's aggregates: JSON, or the Markdown document `kvfid show` prints."""
    with Ledger(db_path(db), readonly=True) as ledger:
        stored = ledger.run(run_id)
        units = ledger.units(stored.id)
    summary = report.aggregate(units, stored.design)
    if fmt == "json":
        return json.dumps(summary.to_plain(), indent=1)
    doc = report.document(stored, stored_case(stored), summary, units, raw_environment=False)
    return report.markdown(doc)


def merge_runs(db: str | Path | None, run_ids: list[str], into: str | None):
    """`Ledger.merge` in an existing ledger: (merged run, units copied, conflicts)."""
    path = db_path(db)
    if not path.is_file():
        raise BadInput(f"no ledger at {path} (run `kvfid run CASE` first, or give --db)")
    with Ledger(path) as ledger:
        return ledger.merge(run_ids, into)


def report_run(db: str | Path | None, run_id: str, out: str | Path = "reports") -> dict[str, Path]:
    """Write a run's report files and the reports index; {name: path}."""
    with Ledger(db_path(db), readonly=True) as ledger:
        paths = report.write_report(ledger, ledger.run(run_id).id, out)
    return {**paths, "index": update_index(out)}


def run_and_publish(case, db: str | Path | None, *, report: bool = False,
                    out: str | Path = "reports", **options):
    """`kvfid run CASE [--report]`: the case run into the ledger (opened once), aggregated once,
    and with `report` its report and the index written (kvfid.tasks.publish.Published: `.result`,
    `.headline()`, `.files`). `options`: items, run_id, resume, shard, model, progress."""
    return publish(case, db_path(db), reports=out, report=report, **options)


def publish_result(db: str | Path | None, result, *, report: bool = False,
                   out: str | Path = "reports"):
    """Rank 0 of a torchrun launch: the run the ranks measured (`result`, a RunResult),
    aggregated once and, with `report`, reported and indexed, on one open ledger."""
    with Ledger(db_path(db)) as ledger:
        return publish_run(ledger, result, reports=out, report=report)
