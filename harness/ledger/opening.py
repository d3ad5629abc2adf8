"""Opening a ledger file: read-only for reads, refusal of what is not ours, schema and migration.

A read (`runs`, `show`, `report`, `compare`, audit's reading) opens the file read-only and
writes nothing: not the header, not a `-wal`/`-shm` file beside it. When no `-wal` file exists
(no connection is open on the file) or the file cannot be written, it is opened `immutable=1`;
otherwise `mode=ro`, which shares the running writer's WAL index. A write (`run`, `merge`)
creates the schema only in a new or empty file and migrates only a kvfid ledger of a known older
version (1 -> 2: record checksums and leases; 2 -> 3: the `engine_checks` table, stored
`kvfid engine-check` results). Anything else (a newer schema, a foreign database, a file that
is not SQLite, one that fails `pragma quick_check`) is refused with `LedgerRefused` (exit 3) before a byte is written,
and so is a file or folder kvfid cannot write (`ReadOnly`). Every write is one `Transaction`; one
that a full disk refuses is `DiskFull` (exit 3), rolled back.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

from kvfid.errors import BadInput, ReadOnly, Unavailable, write_failure

SCHEMA_VERSION = 3
SQLITE_MAGIC = b"SQLite format 3\x00"

_TABLES_V1 = {
    "runs": ["id", "case_name", "case_source", "case_text", "case_sha", "item_count", "design",
             "environment", "environment_key", "git_revision", "started", "finished", "status",
             "error"],
    "units": ["run_id", "item_index", "item_id", "stack", "status", "record", "environment_key",
              "written"],
    "rows": ["run_id", "item_index", "item_id", "stack", "kind", "label", "metrics",
             "fingerprints"],
}
_TABLES = {1: _TABLES_V1,
           2: {**_TABLES_V1, "units": _TABLES_V1["units"] + ["record_sha"],
               "leases": ["run_id", "host", "pid", "process", "heartbeat"]}}
_TABLES[3] = {**_TABLES[2], "engine_checks": ["id", "environment_key", "engine", "environment",
                                              "git_revision", "written", "record", "record_sha"]}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  id TEXT PRIMARY KEY, case_name TEXT NOT NULL, case_source TEXT NOT NULL,
  case_text TEXT NOT NULL, case_sha TEXT NOT NULL, item_count INTEGER NOT NULL,
  design TEXT NOT NULL, environment TEXT NOT NULL, environment_key TEXT NOT NULL,
  git_revision TEXT, started TEXT NOT NULL, finished TEXT, status TEXT NOT NULL, error TEXT);
CREATE TABLE IF NOT EXISTS units (
  run_id TEXT NOT NULL REFERENCES runs(id), item_index INTEGER NOT NULL, item_id TEXT NOT NULL,
  stack TEXT NOT NULL, status TEXT NOT NULL, record TEXT NOT NULL,
  environment_key TEXT NOT NULL, written TEXT NOT NULL, record_sha TEXT,
  PRIMARY KEY (run_id, item_index, stack));
CREATE TABLE IF NOT EXISTS rows (
  run_id TEXT NOT NULL, item_index INTEGER NOT NULL, item_id TEXT NOT NULL, stack TEXT NOT NULL,
  kind TEXT NOT NULL, label TEXT NOT NULL, metrics TEXT NOT NULL, fingerprints TEXT NOT NULL,
  PRIMARY KEY (run_id, item_index, stack, kind, label),
  FOREIGN KEY (run_id, item_index, stack) REFERENCES units(run_id, item_index, stack));
"""
_LEASES = """
CREATE TABLE IF NOT EXISTS leases (
  run_id TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, process TEXT,
  heartbeat TEXT NOT NULL, PRIMARY KEY (run_id, host, pid));
"""
_ENGINE_CHECKS = """
CREATE TABLE IF NOT EXISTS engine_checks (
  id TEXT PRIMARY KEY, environment_key TEXT NOT NULL, engine TEXT NOT NULL,
  environment TEXT NOT NULL, git_revision TEXT, written TEXT NOT NULL, record TEXT NOT NULL,
  record_sha TEXT NOT NULL);
"""


class LedgerRefused(Unavailable):
    """A file kvfid will not read or write as a ledger; its bytes are left as they were."""


def record_sha(text: str) -> str:
    """SHA-256 of a unit's record exactly as stored (what audit re-checks)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def connect(path: Path, *, write: bool) -> tuple[sqlite3.Connection, int]:
    """An open, checked connection to the ledger at `path` and its schema version."""
    _check_file(path, write)
    try:
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(path, timeout=60, isolation_level=None)
        else:
            db = sqlite3.connect(_read_uri(path), uri=True, isolation_level=None)
        db.execute("PRAGMA busy_timeout=60000")
        version = _inspect(db, path, write)
        if write:
            version = _prepare(db, path, version)
            db.execute("PRAGMA foreign_keys=ON")
    except (sqlite3.DatabaseError, OSError) as err:
        failure = write_failure(err, path) if write else None
        if failure is not None:
            raise failure from None
        if isinstance(err, OSError):
            raise LedgerRefused(f"{path}: cannot open the ledger ({err.strerror or err})") from None
        raise LedgerRefused(f"{path}: damaged or unreadable SQLite file ({err})") from None
    return db, version


def probe(path: Path) -> None:
    """Refuse, before any compute, a file that a write could not take as a ledger."""
    _check_file(path, write=True)
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        db = sqlite3.connect(_read_uri(path), uri=True)
        try:
            _inspect(db, path, write=True)
        finally:
            db.close()
    except sqlite3.DatabaseError as err:
        raise LedgerRefused(f"{path}: damaged or unreadable SQLite file ({err})") from None


def _check_file(path: Path, write: bool) -> None:
    if path.is_dir():
        raise BadInput(f"{path}: is a directory, not a ledger file (--db takes a file)")
    if write:
        _check_writable(path)
    if not path.exists():
        if write:
            return
        raise BadInput(f"no ledger at {path} (run `kvfid run CASE` first, or give --db)")
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except OSError as err:
        raise LedgerRefused(f"{path}: cannot read the ledger ({err.strerror})") from None
    if not head:
        if write:
            return
        raise LedgerRefused(f"{path}: empty file, not a kvfid ledger")
    if not head.startswith(SQLITE_MAGIC):
        raise LedgerRefused(f"{path}: not an SQLite file, so not a kvfid ledger")
    if len(head) < 100:
        raise LedgerRefused(f"{path}: truncated SQLite file ({len(head)} bytes)")


def _read_uri(path: Path) -> str:
    """`mode=ro` while a writer may be at work (a -wal file exists), else `immutable=1`: a
    read-only open of a WAL file would otherwise create -wal and -shm files beside it."""
    wal = Path(f"{path}-wal")
    quiet = not wal.exists() or not writable(path)
    return f"file:{quote(str(path.resolve()))}?" + ("immutable=1" if quiet else "mode=ro")


def writable(path: Path) -> bool:
    """Whether this process may write the file (a read-only one is read `immutable=1`), or
    create and remove files in the folder."""
    return os.access(path, os.W_OK | os.X_OK if path.is_dir() else os.W_OK)


def _check_writable(path: Path) -> None:
    """ReadOnly (exit 3) unless the ledger file and its folder (SQLite's -wal and -shm files go
    beside it) can be written, or the nearest existing folder when neither exists yet."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if path.exists() and not writable(path):
        raise ReadOnly(f"{path}: the ledger file is read-only; kvfid cannot write it (give --db "
                       "a writable place)")
    if not writable(folder):
        raise ReadOnly(f"{path}: its folder {folder} is read-only; kvfid cannot write the ledger "
                       "there (give --db a writable place)")


def _inspect(db: sqlite3.Connection, path: Path, write: bool) -> int:
    """The schema version of a kvfid ledger (0: new and empty); refuses anything else. Read in
    one transaction: read apart, another writer's schema (two torchrun ranks opening one new
    file) could land between the version and the tables, a version 0 with tables (seen in a
    fresh `make test`: "not a kvfid ledger (no kvfid schema version)")."""
    db.execute("BEGIN")
    try:
        return _inspect_snapshot(db, path, write)
    finally:
        db.execute("COMMIT")


def _inspect_snapshot(db: sqlite3.Connection, path: Path, write: bool) -> int:
    (version,) = db.execute("PRAGMA user_version").fetchone()
    tables = {name: [c for (c,) in db.execute("SELECT name FROM pragma_table_info(?)", (name,))]
              for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if version > SCHEMA_VERSION:
        raise LedgerRefused(f"{path}: ledger schema version {version} is newer than this kvfid's "
                            f"({SCHEMA_VERSION}); use a newer kvfid")
    if version == 0 and not tables:
        if write:
            return 0
        raise LedgerRefused(f"{path}: an empty SQLite database, not a kvfid ledger")
    if version == 1 and tables == _TABLES[2]:
        version = 2     # a kvfid older than schema 2 stamped a schema 2 ledger (and wrote nothing)
    expected = _TABLES.get(version)
    if expected is None or tables != expected:
        why = "no kvfid schema version" if expected is None else _difference(tables, expected)
        raise LedgerRefused(f"{path}: not a kvfid ledger ({why})")
    check = [row[0] for row in db.execute("PRAGMA quick_check")]
    if check != ["ok"]:
        raise LedgerRefused(f"{path}: fails pragma quick_check ({check[0]})")
    return version


def _difference(tables: dict, expected: dict) -> str:
    foreign = sorted(set(tables) - set(expected))
    if foreign:
        return f"foreign table(s) {', '.join(foreign[:3])}"
    missing = sorted(set(expected) - set(tables))
    if missing:
        return f"missing table(s) {', '.join(missing)}"
    changed = sorted(t for t in expected if tables[t] != expected[t])
    return f"table(s) {', '.join(changed)} have other columns"


def _prepare(db: sqlite3.Connection, path: Path, version: int) -> int:
    """Create the schema in a new file, or migrate a known older kvfid ledger; in WAL mode."""
    if version < SCHEMA_VERSION:
        db.execute("BEGIN IMMEDIATE")
        try:
            (version,) = db.execute("PRAGMA user_version").fetchone()   # another writer's?
            if version == 0:
                for statement in filter(str.strip, (_SCHEMA + _LEASES).split(";")):
                    db.execute(statement)
            elif version == 1 and "record_sha" not in _columns(db, "units"):   # not a stamped 2
                _migrate_1_to_2(db)
            if version < SCHEMA_VERSION:
                db.execute(_ENGINE_CHECKS)                  # 2 -> 3 (a new file too)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        db.execute("PRAGMA journal_mode=WAL")
    return SCHEMA_VERSION


def _columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [c for (c,) in db.execute("SELECT name FROM pragma_table_info(?)", (table,))]


def _migrate_1_to_2(db: sqlite3.Connection) -> None:
    """Version 2 adds each unit's record checksum and the process leases of running runs."""
    db.execute("ALTER TABLE units ADD COLUMN record_sha TEXT")
    rows = db.execute("SELECT rowid, record FROM units").fetchall()
    db.executemany("UPDATE units SET record_sha = ? WHERE rowid = ?",
                   [(record_sha(text), rowid) for rowid, text in rows])
    db.execute(_LEASES)


class Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): writers queue instead of failing. A write
    that a full disk or a read-only file refuses is DiskFull / ReadOnly (exit 3), rolled back."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self.db, self.path = db, path

    def __enter__(self) -> None:
        self._do("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, _tb) -> None:
        if exc_type is None:
            self._do("COMMIT")
            return
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
        failure = write_failure(exc, self.path) if isinstance(exc, sqlite3.Error) else None
        if failure is not None:
            raise failure from None

    def _do(self, statement: str) -> None:
        try:
            self.db.execute(statement)
        except sqlite3.OperationalError as err:
            failure = write_failure(err, self.path)
            if failure is None:
                raise
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise failure from None
