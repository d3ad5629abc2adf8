"""The GPU check's CPU rehearsal: every step runs and the results fit what a device returns."""

import json

import pytest
import torch

from harness.tasks import gpu_check


@pytest.mark.gpu_rehearsal
def test_dry_run_runs_every_step_into_at_most_eight_flat_files(tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert all(p.is_file() for p in tmp_path.iterdir()) and len(files) <= 8
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["compile", "split", "gpu-tests", "kernels",
                                                      "bench", "fidelity", "report"]
    split = json.loads(summary["steps"][1]["tail"][-1])  # the long-decode comparison's line
    assert split["decode_equals_chunk_bits"] and split["split_us"] > 0 and split["unsplit_us"] > 0
    assert all(s["rc"] == 0 for s in summary["steps"]), summary["steps"]
    assert {"compile.json", "kernels.json", "bench.json", "report.html", "ledger.sqlite"} <= set(files)
    assert summary["compile"]["ok"] and summary["compile"]["configs"] == 4, summary["compile"]
    compiled = json.loads((tmp_path / "compile.json").read_text())["configs"]
    assert all(row["roofline"] and row["mma"] > 0 for row in compiled)  # kept with its roofline


def test_without_cuda_the_real_check_refuses_with_exit_3(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    assert gpu_check.main(["--out", str(tmp_path)]) == 3
