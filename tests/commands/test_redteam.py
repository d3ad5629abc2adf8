"""The red-team's checks as tests: fuzzed case files, damaged ledgers x every command, bad
`repro` inputs, the audit tamper matrix, reads that change no byte, bad output places.

Every command here runs in-process (click's runner) under a time limit; a traceback, an
`internal error` line or a hang fails the test. The corpora live in tests/support/redteam.py and
tests/support/redteam_table.py counts them for the closing note.
"""

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

from kvfid.ledger import opening as ledger_file
from kvfid import outputs
from kvfid.ledger.lease import this_process
from redteam_ledger import ledger_full_after, read_only_cases, read_only_folder
from redteam import (BASELINE, SMOKE, case_variants, damaged_ledgers, invoke, ledger_commands,
                     repro_inputs, run_case_variant, runs_left)


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def good(smoke_run):
    """A schema-2 ledger holding the session's finished smoke run (read only; copy to change)."""
    return smoke_run[0]


def test_fuzzed_case_files_run_or_are_refused_naming_the_file(tmp_path):
    """Exit 0 with a finished run, or exit 2 (3: environment) in one line naming the case file;
    never a traceback, a hang, or a run left unfinished in the ledger."""
    failures, codes = [], []
    for n, (what, data) in enumerate(case_variants()):
        folder = tmp_path / f"{n:03d}"
        folder.mkdir()
        outcome = run_case_variant(folder, what, data)
        codes.append(outcome.exit_code)
        unfinished = [r for r in runs_left(folder / "ledger.sqlite") if r[1] != "finished"]
        ran = outcome.exit_code == 0 and not outcome.traceback and not unfinished
        if not (ran or outcome.clean_refusal(folder / "case.toml")):
            failures.append((what, outcome.exit_code, unfinished, outcome.output[-300:]))
    assert not failures
    assert codes.count(0) >= 10 and codes.count(2) >= 150   # the corpus exercises both sides


def test_damaged_ledgers_x_every_command(good, tmp_path):
    """Refused in one line naming the file (exit 3), bytes unchanged; a missing file or a
    directory is a usage error; a kvfid ledger of schema 1 or 2 works for every command."""
    failures = []
    for what, path, expected in damaged_ledgers(good, tmp_path / "ledgers"):
        for command, args in ledger_commands(path, tmp_path / "out"):
            before, files = sha(path), listing(path.parent)
            outcome = invoke(*args)
            want = expected[command]
            if want == "ok":
                fine = outcome.exit_code == 0 and not outcome.traceback
            else:
                fine = outcome.clean_refusal(path, codes=(3,) if want == "refused" else (2,))
            writes = command == "run" and want == "ok"
            if not writes and (sha(path) != before or listing(path.parent) != files):
                fine = False            # a read, or a refusal, changed the file or its folder
            if not fine:
                failures.append((what, command, want, outcome.exit_code, outcome.output[-300:]))
    assert not failures


def test_bad_repro_inputs_are_refused_in_one_line(tmp_path):
    failures = []
    for what, args, codes in repro_inputs(tmp_path):
        outcome = invoke(*args)
        fine = (outcome.exit_code == 0 and not outcome.traceback) if codes == (0,) else \
            outcome.clean_refusal(codes=codes)
        if not fine:
            failures.append((what, outcome.exit_code, outcome.output[-300:]))
    assert not failures


@pytest.mark.parametrize("option,value,named", [
    ("--device", "mps", "allowed: cpu, cuda, cuda:<index>"),
    ("--threads", str(2 ** 40), "allowed: an integer from 1 to 1024"),
    ("--transplant", "live<-prefill:layers=0-99", "0 <= A < B <= 4"),
    ("--prompt", "", "allowed: a non-empty text"),
])
def test_a_bad_option_is_named_with_its_allowed_values(option, value, named):
    args = ["repro", "--model", "tiny-llama", "-B", "2", "-S", "2", option, value]
    if option != "--prompt":
        args += ["--prompt", "x"]
    outcome = invoke(*args)
    assert outcome.clean_refusal(option, named, codes=(2,)), outcome.output


# --------------------------------------------------------------------------- audit

def _tampered(good, tmp_path, sql=None, record=None):
    copy = tmp_path / "tampered.sqlite"
    shutil.copy(good, copy)
    with contextlib.closing(sqlite3.connect(copy)) as conn, conn:
        if sql:
            conn.executescript(sql)
        if record:
            rowid, text = conn.execute("SELECT rowid, record FROM units WHERE stack = "
                                       "'sdpa/bf16@t1' AND item_index = 1").fetchone()
            conn.execute("UPDATE units SET record = ? WHERE rowid = ?",
                         (json.dumps(record(json.loads(text)), separators=(",", ":")), rowid))
    return copy


def _flip_live_prefill(record):
    for c in record["comparisons"]:
        if (c["a"], c["b"]) == ("live", "prefill"):
            c["suffix"].update(identical=not c["suffix"]["identical"], first_divergence=0)
    return record


@pytest.mark.parametrize("tamper,sql,record,named", [
    ("control", None, None, None),
    ("deleted unit", "DELETE FROM rows WHERE stack = 'eager/bf16@t1' AND item_index = 1; "
                     "DELETE FROM units WHERE stack = 'eager/bf16@t1' AND item_index = 1;", None,
     "item arith-0001 (#1) stack eager/bf16@t1 unit (planned) stored: stored 'yes' now 'missing'"),
    ("flipped record verdict", None, _flip_live_prefill,
     "stack sdpa/bf16@t1 arm live~prefill suffix_identical (row metrics vs record)"),
    ("changed fingerprint", "UPDATE rows SET fingerprints = json_set(fingerprints, "
                            "'$.cache_sha', 'x') WHERE stack = 'sdpa/bf16@t1' AND item_index = 1 "
                            "AND label = 'prefill';",
     None, "stack sdpa/bf16@t1 boundary prefill cache_sha: stored 'x'"),
])
def test_audit_catches_each_tamper_and_names_it(good, tmp_path, tamper, sql, record, named):
    outcome = invoke("audit", "latest", "--db", _tampered(good, tmp_path, sql, record), "--quiet")
    assert not outcome.traceback
    if named is None:
        assert outcome.exit_code == 0 and "PASS" in outcome.output, outcome.output
    else:
        assert outcome.exit_code == 1 and named in outcome.output, outcome.output
        if record:
            assert "record (whole) sha256" in outcome.output   # the checksum caught it too


# --------------------------------------------------------------------------- reads

def test_reads_leave_the_baseline_byte_identical(tmp_path):
    """runs, show, report and compare on a copy of the committed baseline: same bytes, and no
    -wal or -shm file left beside it."""
    copy = tmp_path / "ledger" / "baseline.sqlite"
    copy.parent.mkdir()
    shutil.copy(BASELINE, copy)
    before = sha(copy)
    key = json.loads(invoke("runs", "--db", copy, "--format", "json").output)[-1]["environment"]
    for args in (["runs", "--db", copy], ["show", "latest", "--db", copy],
                 ["report", "latest", "--db", copy, "--out", tmp_path / "out"],
                 ["compare", key, "latest", "--db-a", copy, "--db-b", copy, "--reports",
                  tmp_path / "out"]):
        outcome = invoke(*args)
        assert outcome.exit_code == 0 and not outcome.traceback, outcome.output
    assert sha(copy) == before and listing(copy.parent) == ["baseline.sqlite"]


def test_reads_work_beside_a_writer_and_on_a_read_only_file(good, tmp_path, monkeypatch):
    copy = tmp_path / "ledger.sqlite"
    shutil.copy(good, copy)
    writer = sqlite3.connect(copy)              # a writer at work: a -wal file exists
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("UPDATE runs SET case_name = 'renamed'")
    writer.commit()                             # committed, and still only in the -wal
    try:
        listed = invoke("runs", "--db", copy, "--format", "json")
        assert listed.exit_code == 0 and json.loads(listed.output)[0]["case"] == "renamed"
    finally:
        writer.close()
    copy.chmod(0o444)
    monkeypatch.setattr(ledger_file, "writable", lambda path: False)   # as if not root
    before = sha(copy)
    shown = invoke("show", "latest", "--db", copy)
    assert shown.exit_code == 0 and sha(copy) == before, shown.output


# --------------------------------------------------------------------------- leases

def test_a_killed_run_shows_as_died_and_a_live_one_cannot_be_resumed(good, tmp_path):
    copy = tmp_path / "ledger.sqlite"
    shutil.copy(good, copy)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    host, pid, process = this_process()
    with contextlib.closing(sqlite3.connect(copy)) as conn, conn:
        (run_id,) = conn.execute("SELECT id FROM runs").fetchone()
        conn.execute("UPDATE runs SET status = 'running'")
        conn.execute("INSERT INTO leases VALUES (?, ?, ?, NULL, '2026-01-01T00:00:00Z')",
                     (run_id, host, int(gone.stdout)))
    listed = invoke("runs", "--db", copy, "--format", "json")
    assert json.loads(listed.output)[0]["status"] == "died"
    resumed = invoke("run", SMOKE, "--db", copy, "--resume", run_id, "--quiet")
    assert resumed.exit_code == 0 and f"run {run_id} died (pid {gone.stdout.strip()}" in \
        resumed.output and f"run {run_id} finished" in resumed.output, resumed.output
    with contextlib.closing(sqlite3.connect(copy)) as conn, conn:
        conn.execute("UPDATE runs SET status = 'running'")
        conn.execute("INSERT INTO leases VALUES (?, ?, ?, ?, '2026-01-01T00:00:00Z')",
                     (run_id, host, pid, process))
    assert json.loads(invoke("runs", "--db", copy, "--format", "json").output)[0]["status"] \
        == "running"
    resumed = invoke("run", SMOKE, "--db", copy, "--resume", run_id, "--quiet")
    assert resumed.clean_refusal(run_id, "still being measured", codes=(2,)), resumed.output


def test_a_schema_1_ledger_is_migrated_only_by_a_write(good, tmp_path):
    old = tmp_path / "ledger.sqlite"
    shutil.copy(good, old)
    with sqlite3.connect(old) as conn:
        conn.executescript("ALTER TABLE units DROP COLUMN record_sha; DROP TABLE leases; "
                           "DROP TABLE engine_checks; PRAGMA user_version=1;")
    before = sha(old)
    assert invoke("runs", "--db", old).exit_code == 0 and sha(old) == before
    assert invoke("run", SMOKE, "--db", old, "--items", "1", "--quiet").exit_code == 0
    with sqlite3.connect(old) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (3,)
        assert conn.execute("SELECT COUNT(*) FROM units WHERE record_sha IS NULL").fetchone() \
            == (0,)


# --------------------------------------------------------------------------- outputs

def _full_disk(monkeypatch):
    """The second file written fails half-way with ENOSPC, as on a full disk."""
    calls = []

    def write(path, text):
        calls.append(path)
        if len(calls) == 2:
            path.write_text(text[: len(text) // 2])
            raise OSError(28, "No space left on device", str(path))
        path.write_text(text)

    monkeypatch.setattr(outputs, "write_text", write)


def test_a_full_disk_leaves_no_partial_report(good, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _full_disk(monkeypatch)
    outcome = invoke("report", "latest", "--db", good, "--out", out)
    assert outcome.clean_refusal("No space left on device", codes=(3,)), outcome.output
    assert [p for p in out.rglob("*") if p.is_file()] == []


def test_a_full_disk_keeps_the_previous_comparison(good, tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    args = ["compare", "latest", "latest", "--db", good, "--out", out, "--reports", tmp_path]
    assert invoke(*args).exit_code == 0
    before = {p.name: sha(p) for p in out.iterdir()}
    _full_disk(monkeypatch)
    outcome = invoke(*args)
    assert outcome.clean_refusal(codes=(3,)), outcome.output
    assert {p.name: sha(p) for p in out.iterdir()} == before


@pytest.mark.parametrize("command", ["report", "compare"])
def test_an_unwritable_destination_is_one_line(good, tmp_path, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = (["report", "latest", "--db", good, "--out", blocker / "x"] if command == "report"
            else ["compare", "latest", "latest", "--db", good, "--out", blocker / "x",
                  "--reports", tmp_path])
    outcome = invoke(*args)
    assert outcome.clean_refusal(blocker, codes=(2,)), outcome.output
    assert os.listdir(tmp_path) == ["a-file"]


def test_audit_of_a_partial_run_lists_what_is_pending_without_failing(good, tmp_path):
    copy = _tampered(good, tmp_path, "DELETE FROM rows WHERE item_index = 1; DELETE FROM units "
                                     "WHERE item_index = 1; UPDATE runs SET status = 'partial';")
    outcome = invoke("audit", "latest", "--db", copy, "--quiet")
    assert outcome.exit_code == 0 and "3 planned units are not stored yet" in outcome.output


# --------------------------------------------------------------------------- unwritable ledgers

def test_a_read_only_ledger_is_refused_before_compute(good, tmp_path, monkeypatch):
    """A read-only ledger file or folder: exit 3, one line naming the file, no model loaded,
    nothing written (read_only_folder says how the folder is made read-only)."""
    from kvfid.runs import matrix

    def no_compute(*_):
        raise AssertionError("the case was prepared: compute would start")

    monkeypatch.setattr(matrix, "Matrix", no_compute)
    folder = tmp_path / "ro"
    with read_only_folder(folder, {"ledger.sqlite": good}) as how:
        for what, path, args in read_only_cases(good, folder):
            before = sha(folder / "ledger.sqlite"), listing(folder)
            outcome = invoke(*args)
            refused = outcome.clean_refusal(path, "read-only", codes=(3,))
            assert refused, (what, how, outcome.output)
            assert (sha(folder / "ledger.sqlite"), listing(folder)) == before, (what, how)
        assert sha(folder / "ledger.sqlite") == sha(good)


def test_a_disk_that_fills_during_a_run_is_exit_3_and_resume_finishes_it(smoke_run, tmp_path):
    """The ledger fills after a few units: exit 3, one line "disk full" naming the file and the
    run; what was stored stays, and --resume (with room again) stores the rest, fingerprints
    equal to a clean run's."""
    from kvfid.ledger.store import Ledger

    db = tmp_path / "ledger.sqlite"
    with ledger_full_after(6):
        outcome = invoke("run", SMOKE, "--db", db, "--quiet")
    assert outcome.clean_refusal(db, "disk full", codes=(3,)), outcome.output
    run_id = outcome.error_lines[0].split("--resume ")[1].strip()
    with Ledger(db, readonly=True) as ledger:
        assert 0 < len(ledger.stored_units(run_id)) < ledger.run(run_id).design["units"]
        assert ledger.run(run_id).status == "crashed"
    resumed = invoke("run", SMOKE, "--db", db, "--resume", run_id, "--quiet")
    assert resumed.exit_code == 0, resumed.output
    clean_db, clean_id = smoke_run
    with Ledger(db, readonly=True) as ledger, Ledger(clean_db, readonly=True) as clean:
        assert ledger.run(run_id).status == "finished"
        assert ledger.stored_fingerprints(run_id) == clean.stored_fingerprints(clean_id)
