"""The ledger: an SQLite file (WAL) of runs, measured units, comparison rows and fingerprints.

A run stores its case (text and hash), what it fixed before any result (`design`), its
environment record and key, the git revision, its times and status. A unit is one (item, stack)
measurement, or one item's precision crossing, stored with its full record (kvfid.records.record,
as its JSON text with a checksum) so reports and audits can recompute everything; the ledger
never looks inside a record beyond its status and its rows (kvfid.ledger.rows). Each unit's rows (one per arm, comparison,
transplant, crossing cell) carry metrics and fingerprints, and are written with the unit in ONE
transaction: an interrupted run loses nothing it has written, and never half a unit.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from kvfid.errors import BadInput
from kvfid.records.record import CrossingRecord, RecordRefused, to_json
from kvfid.records.read import from_json
from kvfid.ledger.lease import Lease, this_process
from kvfid.ledger.opening import LedgerRefused, Transaction, connect, record_sha
from kvfid.ledger.rows import fingerprints, record_rows

DEFAULT_DB = Path("reports") / "ledger.sqlite"


class LedgerError(BadInput, LookupError):
    """No such run, an ambiguous run id, or runs that cannot be combined."""


def default_db_path() -> Path:
    """$KVFID_DB, else reports/ledger.sqlite."""
    return Path(os.environ.get("KVFID_DB") or DEFAULT_DB)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


@dataclass(frozen=True)
class Run:
    """One run as stored."""

    id: str
    case_name: str
    case_source: str
    case_text: str
    case_sha: str
    item_count: int
    design: dict
    environment: dict
    environment_key: str
    git_revision: str | None
    started: str
    finished: str | None
    status: str
    error: str | None


@dataclass(frozen=True)
class StoredUnit:
    item_index: int
    item_id: str
    stack: str              # the stack's label; a crossing is stored under CrossingRecord.UNIT
    status: str
    record: object          # an ItemRecord or a CrossingRecord
    environment_key: str

    @property
    def is_crossing(self) -> bool:
        return isinstance(self.record, CrossingRecord)


# --------------------------------------------------------------------------- the store

class Ledger:
    """One SQLite ledger file; safe to share between processes (WAL, busy timeout). Opening
    refuses a file that is not a kvfid ledger (kvfid.ledger.opening)."""

    def __init__(self, path: str | Path, readonly: bool = False) -> None:
        """Open for writing (schema created or migrated), or `readonly` (nothing written)."""
        self.path = Path(path)
        self.readonly = readonly
        self.db, self.version = connect(self.path, write=not readonly)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # runs ------------------------------------------------------------------------------------

    def create_run(self, run_id: str, case, environment: dict, environment_key: str) -> Run:
        """Insert a new run of `case` in status `running`."""
        git = environment.get("git") or {}
        revision = git.get("revision")
        if revision and git.get("dirty"):
            revision += "+dirty"
        self._insert_run(Run(run_id, case.name, case.source, case.text, case.sha, case.items.n,
                             case.design(), environment, environment_key, revision, now(), None,
                             "running", None))
        return self.run(run_id)

    def _insert_run(self, run: Run) -> None:
        with self._transaction():
            self.db.execute(
                "INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run.id, run.case_name, run.case_source, run.case_text, run.case_sha,
                 run.item_count, json.dumps(run.design), json.dumps(run.environment),
                 run.environment_key, run.git_revision, run.started, run.finished, run.status,
                 run.error))

    def complete(self, run_id: str) -> bool:
        """Every unit the run's design asks for is stored."""
        run = self.run(run_id)
        return len(self.stored_units(run.id)) >= run.design["units"]

    def finish(self, run_id: str) -> str:
        """Mark a run `finished` when complete, else `partial` (other shards, or resume)."""
        status = "finished" if self.complete(run_id) else "partial"
        self.set_status(run_id, status)
        return status

    def merge(self, sources: list[str], into: str | None = None) -> tuple[Run, int, list]:
        """A new run holding the union of `sources`' units (same case, same environment key).

        Returns (the new run, units copied, [(source, item_index, stack)] stored in two sources
        with different fingerprints: those are kept from the first source and reported)."""
        runs = [self.run(s) for s in sources]
        if len(runs) < 2:
            raise LedgerError("merge needs at least two runs")
        first = runs[0]
        for other in runs[1:]:
            if (other.case_sha, other.item_count) != (first.case_sha, first.item_count):
                raise LedgerError(f"runs {first.id} and {other.id} ran different cases "
                                  f"(or item counts); only shards of one case merge")
            if other.environment_key != first.environment_key:
                raise LedgerError(f"runs {first.id} and {other.id} were measured in different "
                                  f"environments ({first.environment_key} vs "
                                  f"{other.environment_key}); compare them instead")
        target = into or new_run_id()
        if self.has_run(target):
            raise LedgerError(f"run {target!r} already exists")
        self._insert_run(replace(first, id=target, started=now(), finished=None,
                                 status="running", error=None))
        copied, conflicts = 0, []
        for run in runs:
            n, clashes = self.copy_units(run.id, target)
            copied += n
            conflicts += [(run.id, *c) for c in clashes]
        self.finish(target)
        return self.run(target), copied, conflicts

    def run(self, run_id: str) -> Run:
        """A run by id, unique id prefix, or `latest`."""
        if run_id == "latest":
            row = self.db.execute("SELECT * FROM runs ORDER BY rowid DESC LIMIT 1").fetchone()
            if row is None:
                raise LedgerError(f"{self.path}: no runs yet")
            return _run(row, self.path)
        rows = self.db.execute("SELECT * FROM runs WHERE id = ? OR id LIKE ? ORDER BY id",
                               (run_id, run_id.replace("%", "") + "%")).fetchall()
        exact = [r for r in rows if r[0] == run_id]
        if exact:
            return _run(exact[0], self.path)
        if len(rows) == 1:
            return _run(rows[0], self.path)
        if not rows:
            raise LedgerError(f"{self.path}: no run {run_id!r} (see `kvfid runs`)")
        raise LedgerError(f"{self.path}: {run_id!r} matches {len(rows)} runs: "
                          f"{', '.join(r[0] for r in rows[:5])}")

    def has_run(self, run_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is not None

    def runs(self) -> list[tuple[Run, int]]:
        """Every run with its stored unit count, oldest first."""
        counts = dict(self.db.execute("SELECT run_id, COUNT(*) FROM units GROUP BY run_id"))
        rows = self.db.execute("SELECT * FROM runs ORDER BY rowid").fetchall()
        return [(_run(r, self.path), counts.get(r[0], 0)) for r in rows]

    def set_status(self, run_id: str, status: str, error: str | None = None) -> None:
        finished = None if status == "running" else now()
        with self._transaction():
            self.db.execute("UPDATE runs SET status = ?, finished = ?, error = ? WHERE id = ?",
                            (status, finished, error, run_id))

    def note_environment(self, run_id: str, field: str, value, merge: bool = False) -> None:
        """Set one field of a run's stored environment record (what its processes found while it
        ran, e.g. the whole-call spans; `merge`: a dict added to what the field holds, as another
        process of the run noted it); the environment key is not changed."""
        environment = self.run(run_id).environment
        if merge:
            value = {**(environment.get(field) or {}), **value}
        environment = {**environment, field: value}
        with self._transaction():
            self.db.execute("UPDATE runs SET environment = ? WHERE id = ?",
                            (json.dumps(environment), run_id))

    # units -----------------------------------------------------------------------------------

    def stored_units(self, run_id: str) -> set[tuple[int, str]]:
        return set(self.db.execute("SELECT item_index, stack FROM units WHERE run_id = ?",
                                   (run_id,)))

    def write_unit(self, run_id: str, item_index: int, item_id: str, stack: str, record,
                   environment_key: str) -> bool:
        """Store one unit's record and its rows in one transaction; False if it was already
        stored."""
        text = to_json(record)
        with self._transaction():
            cursor = self.db.execute(
                "INSERT OR IGNORE INTO units VALUES (?,?,?,?,?,?,?,?,?)",
                (run_id, item_index, item_id, stack, record.status, text, environment_key,
                 now(), record_sha(text)))
            if cursor.rowcount == 0:
                return False
            self.db.executemany(
                "INSERT INTO rows VALUES (?,?,?,?,?,?,?,?)",
                [(run_id, item_index, item_id, stack, kind, label, json.dumps(metrics),
                  json.dumps(prints)) for kind, label, metrics, prints in record_rows(record)])
        return True

    def units(self, run_id: str) -> list[StoredUnit]:
        """Every stored unit of a run, in (stack order of storage, item) order."""
        rows = self.db.execute(
            "SELECT item_index, item_id, stack, status, record, environment_key FROM units "
            "WHERE run_id = ? ORDER BY rowid", (run_id,))
        return [StoredUnit(i, item, stack, status,
                           _record(record, f"{self.path}: run {run_id} item #{i} stack {stack}"),
                           key)
                for i, item, stack, status, record, key in rows]

    def stored_fingerprints(self, run_id: str) -> dict[tuple[int, str], dict]:
        """{(item_index, stack): {(kind, label): fingerprints}} as stored in the rows table."""
        out: dict[tuple[int, str], dict] = {}
        for index, stack, kind, label, prints in self.db.execute(
                "SELECT item_index, stack, kind, label, fingerprints FROM rows WHERE run_id = ?",
                (run_id,)):
            out.setdefault((index, stack), {})[(kind, label)] = json.loads(prints)
        return out

    def copy_units(self, source: str, target: str) -> tuple[int, list[tuple[int, str]]]:
        """Copy `source`'s units into `target`; (copied, [units stored in both with different
        fingerprints]). Units stored identically in both are skipped."""
        copied, conflicts = 0, []
        have = self.stored_fingerprints(target)
        for unit in self.units(source):
            key = (unit.item_index, unit.stack)
            if key in have:
                if have[key] != fingerprints(unit.record):
                    conflicts.append(key)
                continue
            copied += self.write_unit(target, unit.item_index, unit.item_id, unit.stack,
                                      unit.record, unit.environment_key)
        return copied, conflicts

    def record_texts(self, run_id: str) -> list[tuple[int, str, str, str | None]]:
        """(item_index, stack, record as stored, its stored SHA-256 or None before schema 2)."""
        sha = "record_sha" if self.version >= 2 else "NULL"
        return self.db.execute(f"SELECT item_index, stack, record, {sha} FROM units "
                               "WHERE run_id = ? ORDER BY rowid", (run_id,)).fetchall()

    def stored_rows(self, run_id: str) -> dict[tuple[int, str], dict]:
        """{(item_index, stack): {(kind, label): (metrics, fingerprints)}} as stored."""
        out: dict[tuple[int, str], dict] = {}
        for index, stack, kind, label, metrics, prints in self.db.execute(
                "SELECT item_index, stack, kind, label, metrics, fingerprints FROM rows "
                "WHERE run_id = ?", (run_id,)):
            out.setdefault((index, stack), {})[(kind, label)] = (json.loads(metrics),
                                                                 json.loads(prints))
        return out

    # leases ----------------------------------------------------------------------------------

    def hold(self, run_id: str) -> None:
        """Take (or renew) this process's lease on a run: its heartbeat."""
        host, pid, process = this_process()
        with self._transaction():
            self.db.execute("INSERT OR REPLACE INTO leases VALUES (?,?,?,?,?)",
                            (run_id, host, pid, process, now()))

    def release(self, run_id: str) -> None:
        """Drop this process's lease on a run (it stopped measuring)."""
        host, pid, _ = this_process()
        with self._transaction():
            self.db.execute("DELETE FROM leases WHERE run_id = ? AND host = ? AND pid = ?",
                            (run_id, host, pid))

    def leases(self, run_id: str) -> list[Lease]:
        """The leases held on a run (none in a ledger older than schema 2)."""
        if self.version < 2:
            return []
        return [Lease(*row) for row in self.db.execute(
            "SELECT run_id, host, pid, process, heartbeat FROM leases WHERE run_id = ?",
            (run_id,))]

    def _transaction(self):
        return Transaction(self.db, self.path)


def _run(row, path: Path) -> Run:
    (run_id, name, source, text, sha, count, design, environment, key, revision, started,
     finished, status, error) = row
    return Run(run_id, name, source, text, sha, count, _loads(design, f"{path}: run {run_id}"),
               _loads(environment, f"{path}: run {run_id}"), key, revision, started, finished,
               status, error)


def _record(text: str, where: str):
    """A stored record, or LedgerRefused (exit 3) naming the unit that cannot be read."""
    try:
        return from_json(text)
    except RecordRefused as err:
        raise LedgerRefused(f"{where}: {err}") from None


def _loads(text: str, where: str):
    """Stored JSON, or LedgerRefused (exit 3) naming where the ledger is damaged."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        raise LedgerRefused(f"{where}: stored JSON is damaged") from None
