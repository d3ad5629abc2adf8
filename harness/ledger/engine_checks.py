"""Engine checks in the ledger: each `kvfid engine-check` and `kvfid engine-load` result stored
as one typed record.

A stored check (the `engine_checks` table, ledger schema 3) carries its id (`engine-` and a run
id's time and suffix; `load-` for a load run), the environment record and its key, the engine
and its version (`vllm 0.32.0`), the git revision, when it was written, and its record
(`EngineCheckRecord`, kvfid.records.engine, or `EngineLoadRecord`, kvfid.records.engine_load:
the record's own `kind` tells them apart, so the table and the schema are unchanged) as JSON with
its SHA-256, written in one transaction. Ledgers older than schema 3 hold none and read as
holding none; reading never writes (a read-only ledger is opened as every reading command opens it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvfid.records.engine import EngineCheckRecord
from kvfid.records.engine_load import EngineLoadRecord
from kvfid.records.record import to_json
from kvfid.ledger.store import Ledger, LedgerError, _loads, _record, new_run_id, now
from kvfid.ledger.opening import LedgerRefused, Transaction, record_sha

PREFIX = "engine-"
LOAD_PREFIX = "load-"
ENGINE_RECORDS = (EngineCheckRecord, EngineLoadRecord)


@dataclass(frozen=True)
class StoredCheck:
    """One engine check as stored."""

    id: str
    environment_key: str
    engine: str
    environment: dict
    git_revision: str | None
    written: str
    record: EngineCheckRecord | EngineLoadRecord


def write_check(ledger: Ledger, record: EngineCheckRecord | EngineLoadRecord, environment: dict,
                environment_key: str, check_id: str | None = None) -> StoredCheck:
    """Store one engine check (its record, checksum, environment and key) in one transaction."""
    git = environment.get("git") or {}
    revision = git.get("revision")
    if revision and git.get("dirty"):
        revision += "+dirty"
    if not isinstance(record, ENGINE_RECORDS):
        raise LedgerError(f"{ledger.path}: a {type(record).__name__} is not an engine check")
    check_id = check_id or (LOAD_PREFIX if isinstance(record, EngineLoadRecord) else PREFIX) + new_run_id()
    text = to_json(record)
    with Transaction(ledger.db, ledger.path):
        if ledger.db.execute("SELECT 1 FROM engine_checks WHERE id = ?", (check_id,)).fetchone():
            raise LedgerError(f"{ledger.path}: engine check {check_id!r} already exists")
        ledger.db.execute("INSERT INTO engine_checks VALUES (?,?,?,?,?,?,?,?)",
                          (check_id, environment_key, record.engine, json.dumps(environment),
                           revision, now(), text, record_sha(text)))
    return check(ledger, check_id)


def checks(ledger: Ledger) -> list[StoredCheck]:
    """Every stored engine check, oldest first (none in a ledger older than schema 3)."""
    if ledger.version < 3:
        return []
    return [_stored(row, ledger) for row in
            ledger.db.execute(f"SELECT {_COLUMNS} FROM engine_checks ORDER BY rowid")]


def check(ledger: Ledger, check_id: str) -> StoredCheck:
    """One stored engine check by id, unique id prefix, or `latest`; its checksum verified."""
    stored = checks(ledger)
    if not stored:
        raise LedgerError(f"{ledger.path}: no engine checks stored (run `kvfid engine-check "
                          "--db PATH`)")
    if check_id == "latest":
        return stored[-1]
    exact = [s for s in stored if s.id == check_id]
    found = exact or [s for s in stored if s.id.startswith(check_id)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise LedgerError(f"{ledger.path}: no engine check {check_id!r} (stored: "
                          f"{', '.join(s.id for s in stored[-5:])})")
    raise LedgerError(f"{ledger.path}: {check_id!r} matches {len(found)} engine checks: "
                      f"{', '.join(s.id for s in found[:5])}")


_COLUMNS = "id, environment_key, engine, environment, git_revision, written, record, record_sha"


def _stored(row, ledger: Ledger) -> StoredCheck:
    check_id, key, engine, environment, revision, written, text, sha = row
    where = f"{ledger.path}: engine check {check_id}"
    if record_sha(text) != sha:
        raise LedgerRefused(f"{where}: its record does not have the SHA-256 it was written with")
    record = _record(text, where)
    if not isinstance(record, ENGINE_RECORDS):
        raise LedgerRefused(f"{where}: holds a {record.KIND} record, not an engine check or load run")
    return StoredCheck(check_id, key, engine, _loads(environment, where), revision, written,
                       record)
