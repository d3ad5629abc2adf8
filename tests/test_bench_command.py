"""`kvfid bench --quick` on the smoke case: every step writes its file and the index lists it."""

import json

from click.testing import CliRunner

from harness.cli import main


def test_quick_bench_writes_kernels_report_and_index(tmp_path):
    result = CliRunner().invoke(main, ["bench", "--reports", str(tmp_path), "--case",
                                       "cases/smoke.toml", "--quick"])
    assert result.exit_code == 0, result.output
    assert "implementation rows that claim invariance are bit-invariant" in result.stdout
    kernels = json.loads(next(tmp_path.rglob("kernels.json")).read_text())
    assert kernels["ok"] is True
    assert len(list(tmp_path.rglob("report.html"))) == 1
    index = (tmp_path / "index.md").read_text()
    assert kernels["environment_key"].split("/")[0] in index
