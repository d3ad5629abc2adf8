"""`kvfid run --jobs N`: local processes share the smoke case and land in one run equal to a
single process; a shard that fails leaves the run partial, named, and resumable."""

import sys

from click.testing import CliRunner

from kvfid.cli import main
from kvfid.ledger.store import Ledger
from kvfid.tasks import local_shards


def test_two_local_processes_equal_a_single_process(tmp_path, smoke_run):
    db = tmp_path / "jobs.sqlite"
    result = CliRunner().invoke(main, ["run", "smoke", "--db", str(db), "--jobs", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    one, single_id = smoke_run      # the same case in a single process (tests/conftest.py)
    with Ledger(db) as ledger:
        (run, count), = ledger.runs()
        assert run.status == "finished" and ledger.leases(run.id) == []
        shared = ledger.stored_fingerprints(run.id)
    with Ledger(one, readonly=True) as ledger:
        alone = ledger.stored_fingerprints(single_id)
    assert set(shared) == set(alone) and count == len(alone)
    for unit, prints in alone.items():
        assert shared[unit] == prints, unit
    assert f"run {run.id} finished: {count} units measured, 0 already stored" in result.stdout


def test_a_failed_shard_is_named_and_its_items_resume(tmp_path, monkeypatch):
    db = tmp_path / "jobs.sqlite"
    failing = [sys.executable, "-c", "import sys; sys.exit('shard broke here')"]
    monkeypatch.setattr(local_shards, "shard_command", lambda *args: failing)
    result = CliRunner().invoke(main, ["run", "smoke", "--db", str(db), "--jobs", "2", "--quiet"])
    assert result.exit_code == 3, result.output
    with Ledger(db) as ledger:
        (run, count), = ledger.runs()
    assert run.status == "partial" and 0 < count
    message = result.output.strip().splitlines()[-1]
    assert "shard 1/2" in message and "shard broke here" in message
    assert f"--resume {run.id}" in message
    monkeypatch.undo()
    resumed = CliRunner().invoke(main, ["run", "smoke", "--db", str(db), "--resume", run.id,
                                        "--quiet"])
    assert resumed.exit_code == 0, resumed.output
    assert f"run {run.id} finished" in resumed.stdout and f"{count} already stored" in resumed.stdout


def test_jobs_with_a_shard_of_its_own_is_refused_before_compute(tmp_path):
    result = CliRunner().invoke(main, ["run", "smoke", "--db", str(tmp_path / "x.sqlite"),
                                       "--jobs", "2", "--shard", "0/2"])
    assert result.exit_code == 2 and "drop --shard" in result.output
    assert not (tmp_path / "x.sqlite").exists()
