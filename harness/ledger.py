"""The ledger: an SQLite file (WAL) of runs, measured units, comparison rows and fingerprints.

A run stores its case (text and hash), what it fixed before any result (`design`), its
environment record and key, the git revision, its times and status. A unit is one (item, stack)
measurement, or one item's precision crossing (stack `crossing`), stored with its full record
JSON so reports and audits can recompute everything. Each unit's rows (one per arm, comparison,
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

from harness.cache import sha_ids

DEFAULT_DB = Path("reports") / "ledger.sqlite"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  id TEXT PRIMARY KEY, case_name TEXT NOT NULL, case_source TEXT NOT NULL,
  case_text TEXT NOT NULL, case_sha TEXT NOT NULL, item_count INTEGER NOT NULL,
  design TEXT NOT NULL, environment TEXT NOT NULL, environment_key TEXT NOT NULL,
  git_revision TEXT, started TEXT NOT NULL, finished TEXT, status TEXT NOT NULL, error TEXT);
CREATE TABLE IF NOT EXISTS units (
  run_id TEXT NOT NULL REFERENCES runs(id), item_index INTEGER NOT NULL, item_id TEXT NOT NULL,
  stack TEXT NOT NULL, status TEXT NOT NULL, record TEXT NOT NULL,
  environment_key TEXT NOT NULL, written TEXT NOT NULL,
  PRIMARY KEY (run_id, item_index, stack));
CREATE TABLE IF NOT EXISTS rows (
  run_id TEXT NOT NULL, item_index INTEGER NOT NULL, item_id TEXT NOT NULL, stack TEXT NOT NULL,
  kind TEXT NOT NULL, label TEXT NOT NULL, metrics TEXT NOT NULL, fingerprints TEXT NOT NULL,
  PRIMARY KEY (run_id, item_index, stack, kind, label),
  FOREIGN KEY (run_id, item_index, stack) REFERENCES units(run_id, item_index, stack));
"""


class LedgerError(LookupError):
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
    stack: str
    status: str
    record: dict
    environment_key: str


# --------------------------------------------------------------------------- rows of a record

def record_rows(record: dict) -> list[tuple[str, str, dict, dict]]:
    """(kind, label, metrics, fingerprints) for each arm, comparison, transplant, crossing cell."""
    if "cells" in record:
        return _crossing_rows(record)
    if record["status"] == "short":
        generated = record["arms"]["live"]["generated"]
        return [("short", "live", {"generated": len(generated), "note": record.get("note")},
                 {"generated_sha": sha_ids(generated)})]
    rows = [("prefix", "P", {"length": len(record["prefix"]),
                             "prompt_length": record["prompt_length"]},
             {"prefix_sha": record["prefix_sha"]})]
    for label, arm in record["arms"].items():
        metrics = {"correct": arm["correct"], "suffix_length": len(arm["suffix"]),
                   "suffix_eos": arm["suffix_eos"], "wall_s": arm["wall_s"],
                   "forward_calls": arm["forward_calls"]}
        if "rows_identical" in arm:
            metrics["rows_identical"] = arm["rows_identical"]
        rows.append(("boundary", label, metrics, {k: arm[k] for k in
                                                  ("cache_sha", "logits_sha", "suffix_sha")}))
    for c in record["comparisons"]:
        prints = {}
        if c["kind"] == "replica":   # the replica's own state, and its verdict vs the first run
            prints = {"verdict": _verdict(c), **c.get("replica_fingerprints", {})}
        rows.append((c["kind"], f"{c['a']}~{c['b']}", _comparison_metrics(c), prints))
    for t in record["transplants"]:
        rows.append(("transplant", t["label"],
                     {"outcome": t["outcome"],
                      "recipient_equals_donor": t["recipient_equals_donor"]},
                     {"suffix_sha": t.get("suffix_sha"), "outcome": t["outcome"]}))
    return rows


def _crossing_rows(record: dict) -> list[tuple[str, str, dict, dict]]:
    if record["status"] == "short":
        return [("short", "reference", {}, {})]
    rows = [("prefix", "P", {}, {"prefix_sha": record["prefix_sha"]}),
            ("reference", "live", {}, {"suffix_sha": sha_ids(record["reference_suffix"])})]
    for key, cell in record["cells"].items():
        rows.append(("crossing-cell", key, {"same_as_reference_live":
                                            cell["same_as_reference_live"]},
                     {k: cell[k] for k in ("prefix_sha", "cache_sha", "logits_sha",
                                           "suffix_sha") if k in cell}))
    for c in record["comparisons"]:
        rows.append(("crossing", f"{c['stack']}|{c['a']}~{c['b']}", _comparison_metrics(c), {}))
    return rows


def _comparison_metrics(c: dict) -> dict:
    cache, logits, suffix = c.get("cache") or {}, c.get("logits") or {}, c["suffix"]
    return {"prefix_identical": c["prefix_identical"], "cache_bit_exact": cache.get("bit_exact"),
            "first_bad_layer": cache.get("first_bad_layer"), "d_rel": cache.get("d_rel"),
            "max_ulp": cache.get("max_ulp"), "logits_equal": logits.get("equal"),
            "argmax_agree": logits.get("argmax_agree"), "suffix_identical": suffix["identical"],
            "first_divergence": suffix["first_divergence"],
            "margin_at_divergence": suffix["margin_a_at_divergence"]}


def _verdict(c: dict) -> str:
    cache = c.get("cache")
    cache_text = "n/a" if cache is None else "exact" if cache["bit_exact"] else "differs"
    logits = c.get("logits")
    logits_text = "n/a" if logits is None else "exact" if logits["equal"] else "differs"
    suffix = c["suffix"]
    suffix_text = "identical" if suffix["identical"] else f"diverges@{suffix['first_divergence']}"
    return f"cache {cache_text}, logits {logits_text}, suffix {suffix_text}"


def fingerprints(record: dict) -> dict[tuple[str, str], dict]:
    """{(kind, label): fingerprints} of one unit's record (what `audit` compares)."""
    return {(kind, label): prints for kind, label, _, prints in record_rows(record)}


# --------------------------------------------------------------------------- the store

class Ledger:
    """One SQLite ledger file; safe to share between processes (WAL, busy timeout)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA busy_timeout=60000")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(_SCHEMA)
        self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

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
            return _run(row)
        rows = self.db.execute("SELECT * FROM runs WHERE id = ? OR id LIKE ? ORDER BY id",
                               (run_id, run_id.replace("%", "") + "%")).fetchall()
        exact = [r for r in rows if r[0] == run_id]
        if exact:
            return _run(exact[0])
        if len(rows) == 1:
            return _run(rows[0])
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
        return [(_run(r), counts.get(r[0], 0)) for r in rows]

    def set_status(self, run_id: str, status: str, error: str | None = None) -> None:
        finished = None if status == "running" else now()
        with self._transaction():
            self.db.execute("UPDATE runs SET status = ?, finished = ?, error = ? WHERE id = ?",
                            (status, finished, error, run_id))

    # units -----------------------------------------------------------------------------------

    def stored_units(self, run_id: str) -> set[tuple[int, str]]:
        return set(self.db.execute("SELECT item_index, stack FROM units WHERE run_id = ?",
                                   (run_id,)))

    def write_unit(self, run_id: str, item_index: int, item_id: str, stack: str, record: dict,
                   environment_key: str) -> bool:
        """Store one unit and its rows in one transaction; False if it was already stored."""
        with self._transaction():
            cursor = self.db.execute(
                "INSERT OR IGNORE INTO units VALUES (?,?,?,?,?,?,?,?)",
                (run_id, item_index, item_id, stack, record["status"],
                 json.dumps(record, separators=(",", ":")), environment_key, now()))
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
        return [StoredUnit(i, item, stack, status, json.loads(record), key)
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

    def _transaction(self):
        return _Transaction(self.db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): writers queue instead of failing."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, *exc) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def _run(row) -> Run:
    (run_id, name, source, text, sha, count, design, environment, key, revision, started,
     finished, status, error) = row
    return Run(run_id, name, source, text, sha, count, json.loads(design),
               json.loads(environment), key, revision, started, finished, status, error)
