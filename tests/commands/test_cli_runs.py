"""`kvfid run/runs/show/audit/report/merge` through click's runner: output and exit codes."""

import json
import re
import shlex
import sqlite3
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvfid.runs.case import load_case
from kvfid.cli import main
from kvfid.ledger.store import Ledger
from kvfid.reports.report import repro_command

SMOKE = str(Path(__file__).resolve().parents[2] / "cases" / "smoke.toml")


def kvfid(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def ledger_with_run(smoke_run):
    """The session's smoke run (read only): (db, run id)."""
    return smoke_run


def test_run_with_report_prints_the_headline_and_the_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)     # `kvfid run --report` writes under ./reports
    result = kvfid("run", SMOKE, "--db", tmp_path / "l.sqlite", "--quiet", "--items", "2",
                   "--report")
    assert result.exit_code == 0, result.output
    run_id = re.match(r"run (\S+) finished: 6 units measured", result.stdout)[1]
    assert "suffix ≠ live" in result.stdout and "sdpa/bf16@t1" in result.stdout
    assert (tmp_path / "reports" / "index.md").is_file()
    assert len(list((tmp_path / "reports").rglob(f"{run_id}/report.html"))) == 1


def test_runs_and_show(ledger_with_run):
    db, run_id = ledger_with_run
    listed = kvfid("runs", "--db", db, "--format", "json")
    assert listed.exit_code == 0
    (row,) = json.loads(listed.stdout)
    assert (row["id"], row["status"], row["units"], row["planned"]) == (run_id, "finished", 9, 9)
    shown = kvfid("show", "latest", "--db", db)
    assert shown.exit_code == 0 and f"# kvfid run {run_id}: smoke" in shown.stdout
    assert "## Stack eager/bf16@t1" in shown.stdout
    as_json = json.loads(kvfid("show", run_id, "--db", db, "--format", "json").stdout)
    assert set(as_json["stacks"]) == {"sdpa/bf16@t1", "eager/bf16@t1"}


def test_audit_exit_codes(ledger_with_run, tmp_path):
    db, run_id = ledger_with_run
    passed = kvfid("audit", run_id, "--db", db, "--quiet", "--items", "2")
    assert passed.exit_code == 0 and "PASS" in passed.stdout
    tampered = tmp_path / "tampered.sqlite"
    with sqlite3.connect(db) as source, sqlite3.connect(tampered) as target:
        source.backup(target)
    with sqlite3.connect(tampered) as conn:
        conn.execute("UPDATE rows SET fingerprints = json_set(fingerprints, '$.suffix_sha', 'x')"
                     " WHERE item_index = 2 AND stack = 'crossing' AND kind = 'crossing-cell' "
                     "AND label = 'sdpa/fp32@t1|prefill'")
    failed = kvfid("audit", run_id, "--db", tampered, "--quiet")
    assert failed.exit_code == 1
    assert "item arith-0002 (#2) stack crossing crossing-cell sdpa/fp32@t1|prefill suffix_sha: " \
           "stored 'x'" in failed.stdout


def test_report_writes_the_three_files(ledger_with_run, tmp_path):
    db, run_id = ledger_with_run
    result = kvfid("report", run_id, "--db", db, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    files = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert set(files) == {"markdown", "html", "summary", "index"}
    assert all(Path(path).is_file() for path in files.values())
    assert f"/{run_id}/" in files["html"]


def test_a_row_reproduces_with_its_repro_command(ledger_with_run):
    db, run_id = ledger_with_run
    with Ledger(db) as ledger:
        unit = next(u for u in ledger.units(run_id) if u.stack == "eager/bf16@t1"
                    and u.status == "ok")
    command = repro_command(load_case(SMOKE), "eager/bf16@t1", unit.item_index, "")
    result = kvfid(*shlex.split(command)[1:])
    assert result.exit_code == 0, result.output
    assert f"sha256 {unit.record.prefix_sha[:16]}" in result.stdout
    for label, arm in unit.record.arms.items():
        assert re.search(rf"^  {re.escape(label)} .* cache {arm.cache_sha[:12]} ", result.stdout,
                         re.M), label


def test_shards_then_merge(tmp_path):
    db = tmp_path / "ledger.sqlite"
    ids = []
    for shard in ("0/2", "1/2"):
        result = kvfid("run", SMOKE, "--db", db, "--quiet", "--shard", shard, "--items", "2")
        assert result.exit_code == 0, result.output
        ids.append(re.match(r"run (\S+) partial", result.stdout)[1])
    merged = kvfid("merge", *ids, "--db", db, "--into", "both")
    assert merged.exit_code == 0 and merged.stdout.startswith("run both finished: 6 units")
    assert kvfid("merge", ids[0], "--db", db).exit_code == 2


@pytest.mark.parametrize("args,message", [
    (["run", "cases/nowhere.toml"], "cannot read the case file"),
    (["run", SMOKE, "--shard", "2/2"], "bad shard"),
    (["run", SMOKE, "--items", "0"], "--items = 0 is not allowed"),
    (["show", "latest"], "no ledger at"),
])
def test_usage_errors_exit_2(args, message, tmp_path):
    result = kvfid(*args, "--db", tmp_path / "none.sqlite")
    assert result.exit_code == 2 and message in result.output


def test_unknown_run_exits_2(ledger_with_run):
    db, _ = ledger_with_run
    result = kvfid("show", "no-such-run", "--db", db)
    assert result.exit_code == 2 and "no run 'no-such-run'" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_a_gpu_case_without_a_gpu_exits_3(tmp_path):
    case = Path(SMOKE).with_name("gpu-qwen2.5-shape.toml")
    result = kvfid("run", case, "--db", tmp_path / "l.sqlite")
    assert result.exit_code == 3 and "no CUDA device" in result.output
