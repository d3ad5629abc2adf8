"""`compare` compares like with like: runs of another case, model, B/S, item set or thread count
are refused with exit 2 and a one-line message naming every difference, unless
`allow_different`, and then the report says first what differs. A run against itself still says
no regression; the environment variables that change numerics are shown."""

import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.errors import BadInput
from kvfid.compare.runs import UnlikeRuns, compare, render_markdown
from kvfid.runs.case import load_case
from kvfid.ledger.store import Ledger

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "cases" / "smoke.toml"
BASELINE = ROOT / "reports" / "baseline-cpu.sqlite"     # the committed smollm2-cpu run


@pytest.fixture(scope="module")
def runs(smoke_run, tmp_path_factory):
    """One ledger: the session's smoke run (one thread), and the same case on two threads. The
    two-thread run is a process of its own with OpenMP's passive wait: in-process, its threads
    would spin against the other test worker's core."""
    folder = tmp_path_factory.mktemp("refuse")
    two = folder / "smoke-t2.toml"
    text = SMOKE.read_text()
    assert "threads = 1 " in text
    two.write_text(text.replace("threads = 1 ", "threads = 2 "))
    db = folder / "ledger.sqlite"
    smoke_db, smoke_id = smoke_run
    with closing(sqlite3.connect(smoke_db)) as source, closing(sqlite3.connect(db)) as target:
        source.backup(target)
    done = subprocess.run([sys.executable, "-m", "kvfid.cli", "run", str(two), "--db", str(db),
                           "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert done.returncode == 0, done.stderr[-2000:]
    with Ledger(db, readonly=True) as ledger:
        (other,) = [run.id for run, _ in ledger.runs() if run.id != smoke_id]
    return db, {"t1": smoke_id, "t2": other}


def test_smoke_against_the_smollm2_cpu_baseline_exits_2_naming_every_difference(runs):
    db, ids = runs
    before = BASELINE.read_bytes()
    result = CliRunner().invoke(main, ["compare", "latest", ids["t1"], "--db-a", str(BASELINE),
                                       "--db-b", str(db)])
    assert result.exit_code == 2, result.output
    (line,) = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert "not like runs" in line and "No regression" not in result.output
    cpu = load_case(ROOT / "cases" / "smollm2-cpu.toml").items     # what the baseline ran
    for named in ("case smollm2-cpu vs smoke", "model smollm2-135m vs tiny-llama",
                  "B/S B=12, S=16 vs B=6, S=6",
                  f"items {cpu.set}, n={cpu.n}, seed {cpu.seed} vs arith, n=3, seed 0",
                  "--allow-different"):
        assert named in line, named
    assert "threads" not in line.split("are not like runs")[1]     # both ran on one thread
    assert BASELINE.read_bytes() == before                        # read, never written


def test_the_same_case_on_another_thread_count_is_refused(runs):
    db, ids = runs
    with pytest.raises(UnlikeRuns, match=r"not like runs: threads t1 vs t2\.") as caught:
        compare(db, ids["t1"], ids["t2"])
    assert isinstance(caught.value, BadInput) and caught.value.exit_code == 2


def test_allow_different_compares_and_the_report_leads_with_the_differences(runs):
    db, ids = runs
    result = compare(db, ids["t1"], ids["t2"], allow_different=True)
    assert result["differences"] == [{"what": "threads", "a": "t1", "b": "t2"}]
    # The stacks carry their thread count: none of t1's is one of t2's.
    assert "sdpa/bf16@t1" in result["only_a"] and "sdpa/bf16@t2" in result["only_b"]
    text = render_markdown(result)
    verdict, unlike = text.index("regression"), text.index("## A and B are not like runs")
    assert unlike < text.index("## Environment") and verdict < unlike
    assert "| threads | t1 | t2 |" in text and "--allow-different" in text


def test_a_run_against_itself_is_like_and_shows_the_numerics_environment(runs, monkeypatch):
    db, ids = runs
    result = compare(db, ids["t1"], ids["t1"])
    assert result["differences"] == [] and not result["regressed"]
    text = render_markdown(result)
    assert "No regression." in text and "not like runs" not in text
    # The tests run under TRITON_INTERPRET=1 (conftest): the record keeps it, the report shows it.
    rows = {p["part"]: p for p in result["environment"]}
    assert rows["env TRITON_INTERPRET"]["a"] == "1" and not rows["env TRITON_INTERPRET"]["changed"]
    assert "| env TRITON_INTERPRET | 1 | 1 |" in text
    cli = CliRunner().invoke(main, ["compare", ids["t1"], ids["t1"], "--db", str(db)])
    assert cli.exit_code == 0 and "No regression." in cli.stdout
