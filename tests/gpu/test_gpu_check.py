"""The GPU check's CPU rehearsal: every step runs and the results fit what a device returns."""

import json
import sys

import pytest
import torch

from kvfid.tasks import gpu_check


@pytest.mark.gpu_rehearsal
def test_dry_run_runs_every_step_into_at_most_eight_flat_files(tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert all(p.is_file() for p in tmp_path.iterdir()) and len(files) <= 8
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["compile", "speed", "profile", "fidelity",
                                                      "paper", "kernels", "gpu-tests", "tp",
                                                      "tp-stock", "report"]
    assert all(s["rc"] == 0 for s in summary["steps"]), summary["steps"]
    assert summary["steps"][-3]["tail"][-1] == "verdict: bit-exact"     # TP=2 against TP=1
    assert summary["steps"][-2]["tail"][-1].startswith("verdict: diverges")  # stock, its control
    assert {"compile.json", "speed.json", "profile.txt", "kernels.json", "report.md",
            "ledger.sqlite"} <= set(files)
    assert summary["compile"]["ok"] and summary["compile"]["configs"] == 7, summary["compile"]
    compiled = json.loads((tmp_path / "compile.json").read_text())["configs"]
    assert all(row["roofline"] and row["mma"] > 0 for row in compiled)  # kept with its roofline
    # The speed table: a row per kind (decode, prefill, long decode, matmul), each bit-exact.
    rows = [json.loads(line) for line in (tmp_path / "speed.json").read_text().splitlines()]
    assert len(rows) == 5 and rows[-1]["rows"] == 4 and rows[-1]["bits_ok"], rows
    assert all(r["kvfid_us"] > 0 and r["stock_us"] > 0 and r["bits_ok"] for r in rows[:4])
    assert rows[2]["unsplit_us"] > 0 and rows[3]["bucket_bits_ok"]
    # The profile: per stack its parts' wall times and its top-ops table.
    profile = (tmp_path / "profile.txt").read_text()
    stacks = [json.loads(line) for line in profile.splitlines() if line.startswith("{")]
    assert [s["stack"] for s in stacks] == ["sdpa/bf16@t1", "triton/bf16+bi@t1"]
    assert all(s["wall_ms"]["decode step"] > 0 and s["host_ms"] > 0 for s in stacks)
    assert "Self CPU" in profile
    # Two runs in one ledger (the default case, then the paper slice); the report is the first's.
    from kvfid.ledger.store import Ledger

    with Ledger(tmp_path / "ledger.sqlite", readonly=True) as ledger:
        runs = ledger.runs()
    assert [run.id for run, _ in runs][0] == gpu_check.DEFAULT_RUN and len(runs) == 2
    assert all(units > 0 for _, units in runs)


def test_without_cuda_the_real_check_refuses_with_exit_3(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    assert gpu_check.main(["--out", str(tmp_path)]) == 3


def _cheap_plan(out, dry_run):
    """Two steps that cost nothing: one that would outlast a small budget, then the report."""
    py = sys.executable
    return [gpu_check.Step("split", [py, "-c", "import time; time.sleep(30)"], 60),
            gpu_check.Step("kernels", [py, "-c", "print('kernels ran')"], 60, "kernels.json"),
            gpu_check.Step("report", [py, "-c", "print('report ran')"], 20)]


def test_a_budget_cuts_a_step_to_the_time_left_and_keeps_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "plan", _cheap_plan)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--budget", "23"]) == 1
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    split, kernels, report = summary["steps"]
    assert split["rc"] == 124 and split["seconds"] < 10   # cut to 3 s, not its own 60
    assert kernels["rc"] is None and kernels["tail"] == ["not run: budget spent"]
    assert report["rc"] == 0 and report["tail"] == ["report ran"] and summary["finished"]


def test_skip_leaves_a_step_out_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "plan", _cheap_plan)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--skip", "split"]) == 0
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["kernels", "report"]
    assert summary["skipped"] == ["split"]
    assert (tmp_path / "kernels.json").read_text().strip() == "kernels ran"


@pytest.mark.parametrize("argv", [["--skip", "nothing"], ["--budget", "20"]])
def test_bad_skip_or_budget_is_refused_with_exit_2(tmp_path, argv):
    with pytest.raises(SystemExit) as err:
        gpu_check.main(["--dry-run", "--out", str(tmp_path)] + argv)
    assert err.value.code == 2
