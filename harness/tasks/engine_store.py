"""What `kvfid engine-check --db/--report`, `kvfid engine-load` and `kvfid engine-report` run: an
engine check or a load run measured, stored in the ledger under this environment's key with the
engine's version (kvfid.ledger.engine_checks), its report written (kvfid.reports.engine_report,
kvfid.reports.engine_load_report; a load run's report updates the index); and a stored one read
back, listed or reported again.

The ledger is opened for writing only once the check has been measured, so a check vLLM refuses
(exit 3) or a bad option (exit 2) leaves no ledger behind; a ledger kvfid cannot write is
refused before compute like `kvfid run` refuses it.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfid.engines import check as engine_check
from kvfid.engines.load_plan import LoadShape
from kvfid.engines.registry import engine_for
from kvfid.engines.seam import EngineConfig
from kvfid.environment import envinfo
from kvfid.ledger.engine_checks import check, checks, write_check
from kvfid.ledger.opening import probe
from kvfid.ledger.store import Ledger
from kvfid.records.engine import from_result
from kvfid.records.engine_load import EngineLoadRecord
from kvfid.records.record import to_json
from kvfid.reports.document import text_table
from kvfid.reports.engine_load_report import text
from kvfid.reports.engine_report import write_report
from kvfid.reports.index import update_index
from kvfid.tasks.ledger_views import db_path


def check_and_store(fmt: str = "text", db: str | Path | None = None, report: bool = False,
                    out: str | Path = "reports", progress=None, **options) -> tuple[str, dict]:
    """Measure an engine check (kvfid.engines.check); with `db` or `report`, store it
    (in `db`, else the default ledger) and with `report` write its report under `out`. Returns
    what to print and {name: path} of what was written (`ledger`, `id`, the report's files)."""
    store = db is not None or report
    path = db_path(db)
    if store:
        probe(path)                         # refused (read-only, not a ledger) before compute
    result = engine_check.engine_check(progress=progress, **options)
    text = result.to_json(indent=1) if fmt == "json" else engine_check.render(result)
    if not store:
        return text, {}
    stored = store_result(path, result)
    written = {"ledger": path, "id": stored.id}
    if report:
        written.update(write_report(stored, out))
    return text, written


def load_and_store(fmt: str = "text", db: str | Path | None = None, report: bool = False,
                   out: str | Path = "reports", progress=None, **options) -> tuple[str, dict, object]:
    """Measure a load run (kvfid.engines.load_run) and store it (in `db`, else the default
    ledger; an incomplete run is stored as incomplete, never with a verdict); with `report`,
    write its report under `out` and update the index there. Returns what to print,
    {name: path} of what was written, and the stored run."""
    path = db_path(db)
    probe(path)                             # refused (read-only, not a ledger) before compute
    engine = engine_for(options.pop("engine", "vllm"))
    load = engine.door("load")
    if options.get("kv_cache_dtype", "auto") != "auto":   # refused before compute (exit 2 or 3)
        engine.checked(EngineConfig(options["model_name"], options["dtype"],
                                    kv_cache_dtype=options["kv_cache_dtype"]))
    else:
        options.pop("kv_cache_dtype", None)
    if options.get("server"):
        engine.door("serve_load")
    record = load(progress=progress, **options)
    stored = store_result(path, record)
    written = {"ledger": path, "id": stored.id}
    if report:
        # lazy: two modules' write_report, one per branch
        from kvfid.reports.engine_load_report import write_report

        written.update(write_report(stored, out))
        written["index"] = update_index(out)
    return _shown(stored, fmt), written, stored


def bench(fmt: str, clients: int | None, kv_blocks: int, progress=None, **options) -> str:
    """`kvfid engine-bench`: the engine's price (its `bench` door), or under load with `clients`
    (its `load_bench` door), as `fmt`."""
    engine = engine_for(options.pop("engine"))
    engine.checked(EngineConfig(options["model_name"], options["dtype"], tp=options.get("tp", 1),
                                kv_cache_dtype=options["kv_cache_dtype"]))   # refused before compute
    if clients is None:
        result, render = engine.door("bench")(progress=progress, **options)
    else:
        shape = LoadShape(requests=options["count"], clients=clients, tokens=options["tokens"],
                          greedy_share=LoadShape.greedy_share if engine.samples else 1.0)
        result, render = engine.door("load_bench")(options["model_name"], options["dtype"], shape,
                                                   kv_blocks=kv_blocks, threads=options["threads"],
                                                   progress=progress,
                                                   kv_cache_dtype=options["kv_cache_dtype"])
    return json.dumps(result, indent=1) if fmt == "json" else render(result)


def _shown(stored, fmt: str) -> str:
    """A stored check or load run as `fmt` (its record as JSON, or its table as text)."""
    if fmt == "json":
        return to_json(stored.record, indent=1)
    if isinstance(stored.record, EngineLoadRecord):
        return text(stored)

    return (f"engine check {stored.id} ({stored.written}, {stored.environment_key})\n"
            + engine_check.render(stored.record))


def store_result(db: str | Path, result, environment: dict | None = None):
    """Store engine_check's `result` (as an EngineCheckRecord), or an EngineLoadRecord, under
    this environment's key."""
    environment = envinfo.collect() if environment is None else environment
    record = from_result(result) if isinstance(result, dict) else result
    with Ledger(db) as ledger:
        return write_check(ledger, record, {**environment, "engine": record.engine},
                           envinfo.environment_key(environment))


def list_checks(db: str | Path | None) -> list[dict]:
    """Every stored engine check, oldest first."""
    with Ledger(db_path(db), readonly=True) as ledger:
        return [{"id": s.id, "kind": s.record.KIND, "engine": s.record.label, "model": s.record.model,
                 "rows": len(s.record.requests if s.record.KIND == "engine-load" else s.record.rows), "exact": s.record.exact,
                 "kv": getattr(s.record, "kv", True), "complete": getattr(s.record, "complete", True),
                 "written": s.written, "environment": s.environment_key}
                for s in checks(ledger)]


def checks_text(rows: list[dict]) -> str:
    """`kvfid engine-report` with no id: the stored checks as a table."""
    return text_table(["engine check", "engine", "model", "verdict", "written", "environment"],
                      [[r["id"], r["engine"], r["model"],
                        ("no verdict (incomplete)" if not r.get("complete", True) else
                         ("bit-exact" if r["exact"] else "differs")
                         + (" (logprobs, KV)" if r["kv"] else " (logprobs)")
                         + (f", {r['rows']} requests under load" if r.get("kind") == "engine-load" else "")),
                        r["written"], r["environment"]] for r in rows])


def report_check(db: str | Path | None, check_id: str, out: str | Path = "reports",
                 fmt: str = "text") -> tuple[str, dict]:
    """A stored engine check or load run read back: its table as the command printed it (or its
    record as JSON) and its report files written under `out`."""
    with Ledger(db_path(db), readonly=True) as ledger:
        stored = check(ledger, check_id)
    if isinstance(stored.record, EngineLoadRecord):
        # lazy: two modules' write_report, one per branch
        from kvfid.reports.engine_load_report import write_report
    else:
        # lazy: two modules' write_report, one per branch
        from kvfid.reports.engine_report import write_report
    return _shown(stored, fmt), write_report(stored, out)
