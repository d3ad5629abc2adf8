"""`kvfid times`: the timings table is read from the stored results, and docs/environment.md's
generated section is what the command gives on the committed reports/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.errors import BadInput
from kvfid.reports.times import BEGIN, END, collect_times, render_times, section, with_section

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
KEY = "cpu-Test-avx2/none/none/2.13.0+cpu/3.9.0"


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _step(stack: str, phase: str, context: int, median: float) -> dict:
    return {"extra_info": {"op": "model", "stack": stack, "phase": phase, "context": context,
                           "baseline": "sdpa/bf16"},
            "stats": {"median": median, "total": median * 5}}


def _reports(tmp_path: Path) -> Path:
    reports = tmp_path / "reports"
    _write(reports / KEY / "20260101-000000-abcd" / "summary.json",
           {"run": "20260101-000000-abcd", "case": "smoke", "status": "finished",
            "environment_key": KEY, "git_revision": "0123456789abcdef0123+dirty", "units": 4,
            "planned_units": 4, "started": "2026-01-01T00:00:00.000Z",
            "finished": "2026-01-01T00:01:30.000Z"})
    _write(reports / KEY / "kernels.json",
           {"environment_key": KEY, "ok": True, "quick": False, "dtypes": ["bf16"], "rows": [{}] * 3,
            "duration_s": 12.5, "environment": {"git": {"revision": "fedcba9876", "dirty": False}}})
    _write(reports / KEY / "bench" / "20260101T000500Z.json",
           {"machine_info": {"kvfid": {"environment_key": KEY}}, "datetime": "2026-01-01T00:05:00+00:00",
            "commit_info": {"id": "abcdef0123", "dirty": False},
            "benchmarks": [_step("sdpa/bf16", "decode", 64, 0.1), _step("native/bf16+bi", "decode", 64, 0.25),
                           _step("native/bf16+bi", "decode", 512, 9.0),
                           _step("sdpa/bf16", "prefill", 64, 0.2), _step("native/bf16+bi", "prefill", 64, 0.3)]})
    return reports


def test_each_stored_result_is_one_row_with_its_source_and_its_figures(tmp_path):
    rows = collect_times(_reports(tmp_path))
    by_what = {r.what.split()[0]: r for r in rows}
    run = by_what["fidelity"]
    assert run.seconds == 90.0 and run.figures == "22.5 s a unit" and run.revision == "0123456+dirty"
    assert run.source == f"{KEY}/20260101-000000-abcd/summary.json" and run.when == "2026-01-01 00:00"
    kernels = by_what["kernel"]
    assert kernels.seconds == 12.5 and kernels.revision == "fedcba9" and "3 rows" in kernels.what
    bench = by_what["speed"]
    assert bench.seconds == pytest.approx(5 * (0.1 + 0.25 + 9.0 + 0.2 + 0.3))
    # ratios at the shortest context only, each to the baseline of the same phase
    assert bench.figures == ("model steps at 64 tokens: native/bf16+bi decode 2.50x sdpa/bf16; "
                             "native/bf16+bi prefill 1.50x sdpa/bf16")
    assert [r.when for r in rows] == sorted(r.when for r in rows)


def test_an_unfinished_run_has_no_time(tmp_path):
    reports = _reports(tmp_path)
    path = reports / KEY / "20260101-000000-abcd" / "summary.json"
    _write(path, json.loads(path.read_text()) | {"status": "running"})
    run = next(r for r in collect_times(reports) if r.what.startswith("fidelity"))
    assert run.seconds is None and run.figures == "-"


def test_a_ledger_adds_its_runs_once(tmp_path):
    """The committed baseline ledger's one run: from the ledger where no summary holds it, and
    listed once where one does."""
    db = tmp_path / "baseline.sqlite"
    shutil.copy(ROOT / "reports" / "baseline-cpu.sqlite", db)
    alone = [r for r in collect_times(_reports(tmp_path), (db,)) if r.source.startswith("ledger")]
    assert len(alone) == 1 and alone[0].what.startswith("fidelity run 20261201-224604-1fe4")
    assert alone[0].seconds is not None and alone[0].seconds > 0
    with_summary = collect_times(ROOT / "reports", (db,))
    assert not [r for r in with_summary if r.source.startswith("ledger")]
    with pytest.raises(BadInput):
        collect_times(_reports(tmp_path), (tmp_path / "absent.sqlite",))


def test_the_section_is_replaced_between_its_markers_and_refused_without_them():
    doc = f"# T\n\nprose\n\n{BEGIN}\n\nold table\n\n{END}\n\nafter\n"
    new = with_section(doc, "| a |\n")
    assert new == f"# T\n\nprose\n\n{BEGIN}\n\n| a |\n\n{END}\n\nafter\n" and section(new) == "| a |\n"
    with pytest.raises(BadInput):
        with_section("no markers\n", "| a |\n")


def _committed_reports(into: Path) -> Path:
    """reports/ as the checkout's HEAD holds it (what `make bench` adds or rewrites here since is
    not part of the committed table); skipped outside a git checkout."""
    import io
    import subprocess
    import tarfile

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the committed reports cannot be read")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD", "reports"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "reports"


def test_docs_environment_section_is_the_commands_output_on_the_committed_reports(tmp_path):
    committed = section((ROOT / "docs" / "environment.md").read_text())
    generated = render_times(collect_times(_committed_reports(tmp_path)))
    assert committed == generated, ("docs/environment.md's times are stale: run "
                                    "`kvfid times --write docs/environment.md`")
    # the control: the committed table changed by one figure is told apart
    assert committed.replace(".", ",", 1) != generated


def test_the_command_prints_writes_and_refuses(tmp_path):
    reports = _reports(tmp_path)
    printed = CliRunner().invoke(main, ["times", "--reports", str(reports)])
    assert printed.exit_code == 0 and "22.5 s a unit" in printed.output
    as_json = CliRunner().invoke(main, ["times", "--reports", str(reports), "--format", "json"])
    assert json.loads(as_json.output)[0]["environment_key"] == KEY
    doc = tmp_path / "doc.md"
    doc.write_text(f"x\n{BEGIN}\n{END}\n")
    wrote = CliRunner().invoke(main, ["times", "--reports", str(reports), "--write", str(doc)])
    assert wrote.exit_code == 0 and section(doc.read_text()) == printed.output
    missing = CliRunner().invoke(main, ["times", "--reports", str(tmp_path / "none")])
    assert missing.exit_code == 2


def test_readme_two_commands_section_is_short_and_its_excerpt_is_from_the_report_it_names():
    import re

    from kvfid.reports.report import headline
    from kvfid.runs.summary import RunSummary

    readme = (ROOT / "README.md").read_text()
    body = readme.split("## The two commands\n", 1)[1].split("\n## ", 1)[0].strip("\n")
    assert len(body.splitlines()) <= 15
    report = re.search(r"\]\((reports/[^)]+/report\.md)\)", body).group(1)
    summary = RunSummary.from_plain(json.loads((ROOT / report).with_name("summary.json").read_text()))
    shown = " ".join(headline(summary).split())
    excerpt = body.split("```\n")[3].strip("\n").splitlines()
    assert len(excerpt) >= 3
    for line in excerpt:
        assert " ".join(line.split()) in shown, line
    # the control: a figure the report does not hold is told apart
    assert " ".join(excerpt[1].replace("8/8", "7/8").split()) not in shown
