"""Run a case and publish it: run -> aggregate (once) -> report -> index, on one open ledger.

`kvfid run --report` and `kvfid bench` both end here, so the two cannot drift apart. The ledger
file is opened once (kvfid.runs.matrix.opened: a new file only after the case's checks
passed), the run's units are read and aggregated once, and the same aggregates feed the headline,
the report files and the index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvfid.errors import BadInput
from kvfid.runs import matrix, shards
from kvfid.runs.summary import RunSummary
from kvfid.ledger.store import Ledger
from kvfid.reports import report as run_report
from kvfid.reports.index import update_index
from kvfid.reports.report import headline
from kvfid.tasks import local_shards


@dataclass
class Published:
    """What `publish` did: the run, its aggregates, and the files written ({} without a report)."""

    result: matrix.RunResult
    summary: RunSummary
    files: dict[str, Path] = field(default_factory=dict)

    def headline(self) -> str:
        return headline(self.summary)


def publish(case, db: str | Path, *, reports: str | Path = "reports", report: bool = True,
            index_ledger: bool = False, items: int | None = None, run_id: str | None = None,
            resume: str | None = None, shard: shards.Shard = shards.Shard(), model=None,
            progress: bool = True, jobs: int = 1) -> Published:
    """Run `case` into the ledger at `db`, aggregate it, and (with `report`) write its report
    under `reports` and update the index; `index_ledger` also lists the ledger's runs that have
    no report in the index (what `kvfid bench` does). `jobs` > 1: over that many processes of
    this machine (kvfid.tasks.local_shards; not with a `shard` of its own)."""
    if jobs > 1 and shard != shards.Shard():
        raise BadInput("--jobs splits the items itself; drop --shard")
    check = lambda ledger: matrix.prepare(case, ledger, items=items, run_id=run_id,
                                          resume=resume, model=model)
    with matrix.opened(db, check) as (ledger, prepared):
        result = (local_shards.measure(prepared, ledger, jobs, progress) if jobs > 1
                  else matrix.measure(prepared, ledger, shard, progress))
        return publish_run(ledger, result, reports=reports, report=report,
                           index_ledger=index_ledger)


def publish_run(ledger: Ledger, result: matrix.RunResult, *, reports: str | Path = "reports",
                report: bool = True, index_ledger: bool = False) -> Published:
    """Aggregate a measured run once; with `report`, write its report and update the index."""
    run = ledger.run(result.run_id)
    units = ledger.units(run.id)
    summary = run_report.aggregate(units, run.design)
    if not report:
        return Published(result, summary)
    files = run_report.write_report(ledger, run.id, reports, units=units, summary=summary)
    files["index"] = update_index(reports, ledgers=[ledger.path] if index_ledger else ())
    return Published(result, summary, files)
