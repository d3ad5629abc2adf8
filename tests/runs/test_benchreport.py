"""kvfid.reports.benchreport: filing pytest-benchmark results per environment, comparing medians."""

from __future__ import annotations

import json

import pytest

from kvfid.reports.benchreport import (MACHINE_INFO_KEY, compare_bench, latest_previous,
                                         new_result_path, render_bench, save_bench)

KEY = "cpu-Test-CPU/none/none/2.13.0+cpu/3.9.0"


def bench_json(medians: dict[str, float], when="2026-01-02T03:04:05.000006+00:00", key=KEY) -> dict:
    """A minimal pytest-benchmark result: one benchmark per name with the given median (s)."""
    return {
        "machine_info": {"node": "test", MACHINE_INFO_KEY: {"environment": {}, "environment_key": key}},
        "commit_info": {},
        "datetime": when,
        "version": "5.3.1",
        "benchmarks": [
            {"group": "g", "name": f"test_bench[{name}]",
             "fullname": f"tests/bench/test_bench_kernels.py::test_bench[{name}]",
             "params": {}, "param": name, "extra_info": {"gbps": 2.0},
             "options": {}, "stats": {"min": median * 0.9, "max": median * 1.5, "mean": median * 1.1,
                                      "median": median, "rounds": 5, "iterations": 1}}
            for name, median in medians.items()],
    }


def write(path, data):
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def by_name(comparison):
    return {row["name"]: row for row in comparison["rows"]}


def test_regression_is_a_median_slower_by_more_than_the_threshold():
    previous = bench_json({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "gone": 1.0})
    new = bench_json({"a": 1.10, "b": 1.11, "c": 0.5, "d": 0.95, "added": 3.0})
    comparison = compare_bench(new, previous)
    rows = by_name(comparison)
    assert rows["test_bench[a]"]["status"] == "unchanged"  # exactly +10% is not over 10%
    assert rows["test_bench[b]"]["status"] == "regression"
    assert rows["test_bench[b]"]["ratio"] == pytest.approx(1.11)
    assert rows["test_bench[c]"]["status"] == "improvement"
    assert rows["test_bench[d]"]["status"] == "unchanged"
    assert rows["test_bench[added]"]["status"] == "new" and rows["test_bench[added]"]["ratio"] is None
    assert comparison["removed"] == ["test_bench[gone]"]
    assert comparison["regressions"] == ["test_bench[b]"]
    assert comparison["ok"] is False
    assert comparison["same_environment"] is True


def test_only_the_median_counts():
    """A slower mean or max with the same median is not a regression."""
    previous = bench_json({"a": 1.0})
    new = bench_json({"a": 1.0})
    new["benchmarks"][0]["stats"].update(mean=5.0, max=50.0)
    assert compare_bench(new, previous)["ok"] is True


def test_threshold_is_a_parameter():
    previous, new = bench_json({"a": 1.0}), bench_json({"a": 1.04})
    assert compare_bench(new, previous)["ok"] is True
    assert compare_bench(new, previous, threshold=0.03)["regressions"] == ["test_bench[a]"]
    with pytest.raises(ValueError):
        compare_bench(new, previous, threshold=-0.1)


def test_first_run_has_no_baseline_and_is_ok():
    comparison = compare_bench(bench_json({"a": 1.0}), None)
    assert comparison["ok"] is True and comparison["previous"] is None
    assert by_name(comparison)["test_bench[a]"]["status"] == "new"
    assert "first run" in render_bench(comparison)


def test_another_environment_is_said_in_the_report():
    comparison = compare_bench(bench_json({"a": 1.0}), bench_json({"a": 1.0}, key="NVIDIA-H100/x/y/z/w"))
    assert comparison["same_environment"] is False
    assert "ANOTHER environment" in render_bench(comparison)


def on_processor(data: dict, family: int, clock: str = "2.4454 GHz") -> dict:
    """The result as run on an "AMD EPYC" of the given family (py-cpuinfo's fields)."""
    data["machine_info"]["cpu"] = {"brand_raw": "AMD EPYC", "family": family, "model": 1,
                                   "stepping": 1, "hz_actual_friendly": clock}
    return data


def test_another_processor_of_one_key_is_said_in_the_report_and_one_kind_is_not():
    """One environment key spans CPU generations: the report says when the result it compares
    with ran on another processor; a clock read differently on one kind is not another."""
    new = on_processor(bench_json({"a": 2.0}), family=23, clock="1.9963 GHz")
    comparison = compare_bench(new, on_processor(bench_json({"a": 1.0}), family=25))
    assert comparison["same_environment"] is True and comparison["same_processor"] is False
    text = render_bench(comparison)
    assert "ANOTHER processor" in text and "family 25" in text and "family 23" in text
    same = compare_bench(on_processor(bench_json({"a": 2.0}), family=25, clock="2.1 GHz"),
                         on_processor(bench_json({"a": 1.0}), family=25))
    assert same["same_processor"] is True and "ANOTHER processor" not in render_bench(same)
    unknown = compare_bench(new, bench_json({"a": 1.0}))   # a result that names no processor
    assert unknown["same_processor"] is None and "ANOTHER processor" not in render_bench(unknown)


def test_save_files_by_environment_key_and_timestamp_and_finds_the_previous(tmp_path):
    reports = tmp_path / "reports"
    first = save_bench(write(tmp_path / "one.json", bench_json({"a": 1.0})), reports_dir=reports)
    later = "2026-01-02T04:00:00+00:00"
    second = save_bench(write(tmp_path / "two.json", bench_json({"a": 1.2}, when=later)), reports_dir=reports)
    same_second = save_bench(write(tmp_path / "three.json", bench_json({"a": 1.3}, when=later)),
                             reports_dir=reports)
    assert first == reports / KEY / "bench" / "20260102T030405Z.json"
    assert second.name == "20260102T040000Z.json" and same_second.name == "20260102T040000Z-2.json"
    assert json.loads(first.read_text())["benchmarks"][0]["stats"]["median"] == 1.0  # a copy
    key_dir = reports / KEY
    assert latest_previous(key_dir, exclude=same_second) == second
    assert latest_previous(key_dir / "bench", exclude=second) == same_second
    assert latest_previous(key_dir) == same_second
    assert latest_previous(tmp_path / "nowhere") is None
    comparison = compare_bench(same_second, latest_previous(key_dir, exclude=same_second))
    row = by_name(comparison)["test_bench[a]"]
    assert row["ratio"] == pytest.approx(1.3 / 1.2) and row["status"] == "unchanged"  # +8% < 10%
    assert comparison["previous"]["path"] == str(second)


def test_render_marks_regressions_and_rates():
    text = render_bench(compare_bench(bench_json({"a": 2e-3}), bench_json({"a": 1e-3})))
    assert "| test_bench[a] | g | 2 ms | 1 ms | 2.00 | 2 GB/s | **REGRESSION** |" in text
    assert "1 regression(s): test_bench[a]" in text


def test_not_a_benchmark_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pytest-benchmark"):
        save_bench(write(tmp_path / "x.json", {"rows": []}), reports_dir=tmp_path)


def test_a_result_written_into_its_store_stays_there(tmp_path):
    """`kvfid bench` has pytest-benchmark write into reports/<key>/bench/ directly: filing it
    copies nothing; a result whose record names another key is filed under that key."""
    reports = tmp_path / "reports"
    there = new_result_path(reports, KEY)
    assert there.parent == reports / KEY / "bench" and not there.exists()
    write(there, bench_json({"a": 1.0}))
    assert save_bench(there, reports_dir=reports) == there
    assert list((reports / KEY / "bench").iterdir()) == [there]
    other = new_result_path(reports, KEY)
    write(other, bench_json({"a": 1.0}, key="NVIDIA-H100/x/y/z/w"))
    moved = save_bench(other, reports_dir=reports)
    assert moved.parent == reports / "NVIDIA-H100/x/y/z/w" / "bench"


def test_model_steps_table_gives_each_stack_its_ratio_to_the_baseline_of_the_same_run():
    data = bench_json({"sdpa": 0.1, "native": 0.25, "triton": 3.0, "kernel": 0.001})
    for bench in data["benchmarks"]:
        stack = {"sdpa": "sdpa/bf16", "native": "native/bf16+bi", "triton": "triton/bf16+bi"}.get(
            bench["param"])
        if stack:
            bench["group"] = "model-decode-smollm2-135m-ctx64"
            bench["extra_info"] = {"op": "model", "phase": "decode", "stack": stack,
                                   "baseline": "sdpa/bf16", "interpreter": stack.startswith("triton"),
                                   "cache_from": "native/bf16+bi" if stack.startswith("triton")
                                   else "sdpa/bf16"}
    text = render_bench(compare_bench(data, None))
    table = text[text.index("Model steps"):]
    assert "| model-decode-smollm2-135m-ctx64 | native/bf16+bi | 250 ms | 2.50x sdpa/bf16 | - |  |" in table
    # a decode step over a cache another stack's prefill built (the baseline's skipped) says so
    assert ("30.00x sdpa/bf16 | - | Triton interpreter; cache from native/bf16+bi's prefill |"
            in table and "| g |" not in table)
    assert "Model steps" not in render_bench(compare_bench(bench_json({"a": 1.0}), None))


def test_the_scale_curve_gives_each_stack_its_median_and_ratio_by_prefix_length():
    """Model steps at three prefix lengths: a table row per (stack, step) with a cell per length,
    a log-log plot in the HTML page (not in the Markdown), and the tiled route in the note."""
    from kvfid.reports.benchreport import render_bench_html

    medians = {f"{stack}-{ctx}": base * ctx / 64 * (2.0 if stack == "native" else 1.0)
               for stack, base in (("sdpa", 0.1), ("native", 0.1)) for ctx in (64, 512, 2048)}
    data = bench_json(medians)
    for bench in data["benchmarks"]:
        stack, ctx = bench["param"].split("-")
        bench["group"] = f"model-prefill-smollm2-135m-ctx{ctx}"
        bench["extra_info"] = {"op": "model", "phase": "prefill", "context": int(ctx),
                               "stack": "sdpa/bf16" if stack == "sdpa" else "native/bf16+bi",
                               "baseline": "sdpa/bf16", "interpreter": False,
                               "cpu_s_per_call": bench["stats"]["median"] * (0.75 if stack == "native" else 1),
                               "tiled_routes": {"bf16@t1": {"tile": 2, "widen": False}}
                               if stack == "native" else {}}
    comparison = compare_bench(data, None)
    text = render_bench(comparison)
    curve = text[text.index("Scale curve"):]
    assert "| stack | step | 64 tokens | 512 tokens | 2048 tokens |" in curve
    assert "| native/bf16+bi | prefill | 200 ms (2.00x) | 1.6 s (2.00x) | 6.4 s (2.00x) |" in curve
    assert "| 2.00x sdpa/bf16 | 1.50x | tiled bf16@t1: stock, tiles of 2 |" in text and "<svg" not in text
    page = render_bench_html(comparison)
    assert page.count("<svg") == 1 and page.count("<circle") == 6 and ">2048<" in page
