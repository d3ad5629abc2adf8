"""`kvfid bench --quick` on the smoke case: every step writes its file and the index lists it; the
speed benches' JSON goes only into reports/<environment key>/bench/."""

import json

from click.testing import CliRunner

from kvfid.cli import main
from kvfid.tasks.bench import bench_command as real_command


def test_quick_bench_writes_kernels_report_and_index(tmp_path, monkeypatch, quick_kernels):
    """The kernel step's comparison is the session's quick one (tests/environment/test_invariance.py checks its
    rows); what is tested here is that bench files it, the report and the index. The smoke case
    runs in this process (`--jobs 1`): a process per core is tests/runs/test_local_shards.py's claim,
    and two would each import torch and transformers again."""
    from kvfid.environment import invariance

    def shared(**options):
        assert options["quick"] is True and options["threads"] == 1 and options["device"] == "cpu"
        return quick_kernels

    monkeypatch.setattr(invariance, "compare_kernels", shared)
    result = CliRunner().invoke(main, ["bench", "--reports", str(tmp_path), "--case", "smoke",
                                       "--quick", "--jobs", "1"])   # a case by name, as `kvfid run` takes it
    assert result.exit_code == 0, result.output
    assert "implementation rows that claim invariance are bit-invariant" in result.stdout
    fidelity = next(line for line in result.stdout.splitlines() if line.startswith("fidelity: run"))
    assert "; all " in fidelity and fidelity.count("fidelity:") == 1, fidelity   # its sizing, once
    kernels = json.loads(next(tmp_path.rglob("kernels.json")).read_text())
    assert kernels["ok"] is True
    assert len(list(tmp_path.rglob("report.html"))) == 1
    index = (tmp_path / "index.md").read_text()
    assert kernels["environment_key"].split("/")[0] in index


def test_a_bad_case_or_item_count_is_refused_before_any_step(tmp_path):
    for extra in (["--case", "no-such-case"], ["--case", "smoke", "--items", "-1"]):
        result = CliRunner().invoke(main, ["bench", "--reports", str(tmp_path), *extra])
        assert result.exit_code == 2, result.output
        assert list(tmp_path.iterdir()) == []           # no kernel table, no bench, no ledger


def test_speed_benches_write_their_json_only_into_the_reports_store(tmp_path, monkeypatch):
    """pytest-benchmark writes straight into reports/<key>/bench/; nothing lands in .benchmarks/;
    a second result is compared with the first."""
    from kvfid.environment import envinfo
    from kvfid.tasks import bench

    monkeypatch.setattr(bench, "bench_command",
                        lambda path, part=None: real_command(path, quick=True, part=part))
    stray = bench.ROOT / ".benchmarks"     # pytest-benchmark's own store, no longer used
    files = lambda: {p: p.stat().st_mtime_ns for p in stray.rglob("*")} if stray.exists() else None
    before = files()
    first, second = bench.BenchOutcome(), bench.BenchOutcome()
    # the first in two parts side by side (the quick selection leaves the long part nothing to
    # run: its exit 5 is an empty part), the second in one process
    monkeypatch.setattr(bench, "speed_parts", lambda cuda: ("short", "long"))
    assert "no previous result" in bench._speed(tmp_path, first)[0]
    monkeypatch.setattr(bench, "speed_parts", lambda cuda: (None,))
    assert "benchmarks vs " in bench._speed(tmp_path, second)[0]
    folder = tmp_path / envinfo.environment_key(envinfo.collect()) / "bench"
    stored = sorted(folder.glob("*.json"))
    assert [str(p) for p in stored] == [first.files["bench"], second.files["bench"]]
    data = json.loads(stored[0].read_text())
    assert data["benchmarks"] and data["machine_info"]["kvfid"]["environment_key"] == \
        envinfo.environment_key(envinfo.collect())
    assert all(p.with_suffix(".md").is_file() and p.with_suffix(".html").is_file() for p in stored)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == \
        sorted(n for p in stored for n in (p.name, p.with_suffix(".md").name, p.with_suffix(".html").name))
    assert files() == before


def _steps(decode_s: dict, prefill_s: dict, context=64) -> list[dict]:
    """Model steps as kvfid.reports.model_steps gives them, at one length."""
    return [{"stack": stack, "phase": phase, "context": context, "median_s": seconds,
             "interpreter": False}
            for phase, table in (("decode", decode_s), ("prefill", prefill_s))
            for stack, seconds in table.items()]


def test_the_cpu_default_case_is_sized_by_this_machines_model_steps():
    """Per unit a warm-up (one prefill, one decode step) and per arm one prefill and its decode
    steps (a prefill arm S - 1, the others B + S - 1), the replicas' arms by their share of the
    items, S decode steps per transplant pair; per item the crossing's arms by their share, at
    each crossed stack's cost. Where all items would pass what is left of the budget over the
    processes, whole rounds of one item per process that fit, at least one; else all of them
    (None: the case's count). Sizing takes an item as RUN_OVER_STEPS times that."""
    from kvfid.runs.case import load_case
    from kvfid.tasks import bench

    case = load_case(bench.ROOT / "cases" / "smollm2-cpu.toml")
    assert (case.items.n, case.B, case.S) == (8, 12, 16)
    assert case.constructions == ("live", "prefill", "incremental")
    labels = ("native/bf16+bi", "sdpa/bf16", "sdpa/fp32")
    steps = _steps({s: 0.1 for s in labels}, {s: 1.0 for s in labels})
    long_arm, prefill_arm = 1.0 + 27 * 0.1, 1.0 + 15 * 0.1
    unit = (1.0 + 0.1) + long_arm + prefill_arm + long_arm + 2 / 8 * prefill_arm + 2 * 16 * 0.1
    crossing = 2 * 4 / 8 * (long_arm + prefill_arm)       # two dtypes: incremental and prefill
    expected = 3 * unit + crossing
    assert abs(bench.item_seconds(case, steps) - expected) < 1e-9
    sized = expected * bench.RUN_OVER_STEPS
    assert bench.sized_items(case, steps, jobs=2, budget_s=8 * sized / 2)[0] is None
    assert bench.sized_items(case, steps, jobs=2, budget_s=8 * expected / 2)[0] == 4  # the margin
    fit, why = bench.sized_items(case, steps, jobs=2, budget_s=3.5 * sized / 2)
    assert fit == 2 and "2 of 8 items" in why            # 3.5 items fit: one whole round of 2
    assert bench.sized_items(case, steps, jobs=2, budget_s=-5.0)[0] == 2   # at least one round
    assert bench.sized_items(case, steps, jobs=1, budget_s=5.5 * sized)[0] == 5
    # a stack the bench did not time: the case's count, and why
    missing = [s for s in steps if s["stack"] != "sdpa/fp32"]
    assert bench.item_seconds(case, missing) is None
    assert bench.sized_items(case, missing, jobs=2, budget_s=1.0) == (
        None, "all 8 items (no model step timed here for every stack to size them by)")
    # steps at longer prefixes do not size it
    longer = steps + _steps({s: 100.0 for s in labels}, {s: 100.0 for s in labels}, context=2048)
    assert bench.item_seconds(case, longer) == bench.item_seconds(case, steps)
