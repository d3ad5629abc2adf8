"""Kernel speed results: the one store of pytest-benchmark JSON per environment, comparisons, render.

`reports/<environment key>/bench/<UTC timestamp>.json` is the only place bench results live:
`kvfid bench` has pytest-benchmark write its `--benchmark-json` there directly
(`new_result_path`; no `.benchmarks/` autosave), and `save_bench()` files a result written
elsewhere (`kvfid bench-report`) by its own key. `latest_previous()` finds the run before one;
`compare_bench()` compares medians per benchmark and flags regressions (median slower by more than
the threshold); `render_bench()` is its Markdown and `render_bench_html()` its HTML page, each
with the model steps' section (kvfid.reports.model_steps; the page adds the scale curve's plot).
The environment key comes from the record the bench conftest put into pytest-benchmark's
`machine_info` (see tests/bench/conftest.py), so a result is filed with the machine it was
measured on, not the one that files it.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

from kvfid.environment import envinfo
from kvfid.errors import BadInput
from kvfid.reports.document import Heading, Paragraph, Table, markdown, ratio, seconds, to_html
from kvfid.reports.model_steps import model_steps_document

MACHINE_INFO_KEY = "kvfid"  # machine_info[MACHINE_INFO_KEY] = {"environment": ..., "environment_key": ...}


class BenchInputError(BadInput, ValueError):
    """A benchmark result that cannot be read."""


def load_bench(source) -> dict:
    """A pytest-benchmark JSON result from a path, or the dict itself."""
    if isinstance(source, dict):
        return source
    try:
        with open(source, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise BenchInputError(f"{source}: cannot read a pytest-benchmark JSON result ({err})"
                              ) from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise BenchInputError(f"{source}: not a pytest-benchmark JSON result (no 'benchmarks' list)")
    return data


def bench_environment_key(data: dict) -> str:
    """The environment key recorded with the result; computed here if the run lacked the hook."""
    recorded = (data.get("machine_info") or {}).get(MACHINE_INFO_KEY) or {}
    return recorded.get("environment_key") or envinfo.environment_key(envinfo.collect())


def _timestamp(data: dict | None = None) -> str:
    """A run's start time as `YYYYmmddTHHMMSSZ` (UTC), from pytest-benchmark's `datetime`; now
    without one."""
    text = (data or {}).get("datetime")
    try:
        moment = datetime.fromisoformat(text) if text else datetime.now(timezone.utc)
    except ValueError:
        moment = datetime.now(timezone.utc)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def new_result_path(reports_dir, environment_key: str, stem: str | None = None) -> Path:
    """A free name for the next result of a key: `reports/<key>/bench/<stem or now>[-N].json`."""
    folder = Path(reports_dir) / environment_key / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    stem = stem or _timestamp()
    target, n = folder / f"{stem}.json", 1
    while target.exists():  # two runs in one second: keep both
        n += 1
        target = folder / f"{stem}-{n}.json"
    return target


def save_bench(json_path, reports_dir="reports") -> Path:
    """File a pytest-benchmark JSON file under `reports/<its environment key>/bench/`: one already
    there stays as it is; one from elsewhere is copied in as `<its start time>.json`."""
    data = load_bench(json_path)
    key = bench_environment_key(data)
    if Path(json_path).resolve().parent == (Path(reports_dir) / key / "bench").resolve():
        return Path(json_path)
    target = new_result_path(reports_dir, key, _timestamp(data))
    shutil.copyfile(json_path, target)
    return target


def file_bench(json_path, reports_dir="reports", threshold: float = 0.10) -> tuple[Path, dict]:
    """File a result (`save_bench`) and compare it with the previous one of its key."""
    saved = save_bench(json_path, reports_dir)
    return saved, compare_bench(saved, latest_previous(saved.parent, exclude=saved), threshold)


def latest_previous(key_dir, exclude=None) -> Path | None:
    """The newest stored result in `key_dir` (an environment's folder or its `bench/`), other
    than `exclude`; None when there is none."""
    folder = Path(key_dir)
    if (folder / "bench").is_dir():
        folder = folder / "bench"
    excluded = Path(exclude).resolve() if exclude else None
    candidates = [p for p in folder.glob("*.json") if p.resolve() != excluded]
    return max(candidates, key=_run_order) if candidates else None


def _run_order(path: Path) -> tuple[str, int]:
    """Names are UTC timestamps, so name order is time order; `-N` marks the N-th in one second."""
    stem, _, n = path.stem.partition("-")
    return stem, int(n) if n.isdigit() else 1


def _medians(data: dict) -> dict[str, dict]:
    """fullname -> {name, group, median (s), extra_info} for each benchmark that has stats."""
    out = {}
    for bench in data["benchmarks"]:
        stats = bench.get("stats") or {}
        if stats.get("median") is None:
            continue
        key = bench.get("fullname") or bench["name"]
        out[key] = {"name": bench["name"], "group": bench.get("group"), "median": stats["median"],
                    "extra_info": bench.get("extra_info") or {}}
    return out


# What identifies a processor in pytest-benchmark's `machine_info["cpu"]` (py-cpuinfo's fields):
# one CPU model name spans generations of different speed (docs/hazards.md, "One CPU name, two
# processors"), which one environment key does not tell apart. The clock is shown, not compared
# (its reading moves on one host).
PROCESSOR_FIELDS = ("brand_raw", "family", "model", "stepping")


def processor(data: dict | None) -> dict | None:
    """The processor that ran a result ({field: value} of PROCESSOR_FIELDS and the clock read),
    or None where the result does not say."""
    cpu = ((data or {}).get("machine_info") or {}).get("cpu") or {}
    found = {name: cpu.get(name) for name in PROCESSOR_FIELDS if cpu.get(name) is not None}
    if not found:
        return None
    return found | ({"clock": cpu["hz_actual_friendly"]} if cpu.get("hz_actual_friendly") else {})


def describe_processor(found: dict | None) -> str:
    """`AMD EPYC (family 23, model 1, stepping 2) at 1.9963 GHz`, from `processor()`'s dict."""
    if not found:
        return "unknown"
    generation = ", ".join(f"{field} {found[field]}" for field in ("family", "model", "stepping")
                           if field in found)
    return " ".join(part for part in (str(found.get("brand_raw") or ""),
                                      f"({generation})" if generation else "",
                                      f"at {found['clock']}" if found.get("clock") else "") if part)


def _describe(data: dict | None, source) -> dict | None:
    if data is None:
        return None
    return {"path": None if isinstance(source, dict) else str(source), "datetime": data.get("datetime"),
            "environment_key": bench_environment_key(data), "processor": processor(data)}


def _same_processor(new: dict, old: dict | None) -> bool | None:
    """Whether two results ran on one kind of processor: None where either does not say."""
    if old is None or not old["processor"] or not new["processor"]:
        return None
    return all(new["processor"].get(field) == old["processor"].get(field)
               for field in PROCESSOR_FIELDS)


def processor_change(comparison: dict) -> str | None:
    """The two processors, in words, where the result compared with ran on another one of this
    key (None where it did not, or where either result does not say)."""
    if comparison.get("same_processor") is not False:
        return None
    return (f"{describe_processor(comparison['previous']['processor'])} "
            f"(this run: {describe_processor(comparison['new']['processor'])})")


def compare_bench(new, previous, threshold: float = 0.10) -> dict:
    """Compare medians per benchmark (keyed by pytest's full name). `regression`: new median more
    than `threshold` (a fraction) above the previous one; `improvement`: more than it below.
    `previous` may be None (a first run: every benchmark is `new`). `ok` is False on a regression."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    new_data = load_bench(new)
    old_data = load_bench(previous) if previous is not None else None
    now, before = _medians(new_data), _medians(old_data) if old_data else {}
    rows = []
    for key, bench in now.items():
        old = before.get(key)
        ratio = bench["median"] / old["median"] if old and old["median"] > 0 else None
        if old is None:
            status = "new"
        elif ratio is None:
            status = "unchanged" if bench["median"] == 0 else "regression"
        elif ratio > 1 + threshold:
            status = "regression"
        elif ratio < 1 - threshold:
            status = "improvement"
        else:
            status = "unchanged"
        rows.append({"fullname": key, "name": bench["name"], "group": bench["group"],
                     "median_s": bench["median"], "previous_median_s": old["median"] if old else None,
                     "ratio": ratio, "status": status, "extra_info": bench["extra_info"]})
    new_env, old_env = _describe(new_data, new), _describe(old_data, previous)
    return {
        "ok": not any(r["status"] == "regression" for r in rows),
        "threshold": threshold,
        "rows": rows,
        "removed": sorted(before[k]["name"] for k in set(before) - set(now)),
        "regressions": [r["name"] for r in rows if r["status"] == "regression"],
        "new": new_env,
        "previous": old_env,
        "same_environment": old_env is None or new_env["environment_key"] == old_env["environment_key"],
        "same_processor": _same_processor(new_env, old_env),
    }


def _throughput(extra: dict) -> str:
    parts = []
    if extra.get("gbps") is not None:
        parts.append(f"{extra['gbps']:.3g} GB/s")
    if extra.get("gflops") is not None:
        parts.append(f"{extra['gflops']:.3g} GFLOP/s")
    return ", ".join(parts) or "-"


def bench_document(comparison: dict) -> list:
    """The comparison as blocks of kvfid.reports.document: one row per benchmark."""
    new, old = comparison["new"], comparison["previous"]
    where = lambda side: f" ({side['path']})" if side["path"] else ""
    against = ("none (first run here)" if old is None else
               f"run {old['datetime']}{where(old)}" + ("" if comparison["same_environment"] else
               f" - ANOTHER environment, `{old['environment_key']}`"))
    if (change := processor_change(comparison)) is not None:
        against += (f" - on ANOTHER processor of this key, {change}: a speed difference may be "
                    f"the host's, not the code's")
    if comparison["ok"]:
        result = "ok, no regression."
    else:
        result = (f"{len(comparison['regressions'])} regression(s): "
                  + ", ".join(comparison["regressions"]))
    doc = [Heading("Kernel benchmarks"),
           Paragraph(f"Environment: `{new['environment_key']}`; run {new['datetime']}{where(new)}"),
           Paragraph(f"Compared with: {against}"),
           Paragraph(f"Regression: median more than {comparison['threshold']:.0%} above the "
                     f"previous one."),
           Table(["benchmark", "group", "median", "previous", "ratio", "rate", "status"],
                 [[row["name"], row["group"] or "-", seconds(row["median_s"]),
                   seconds(row["previous_median_s"]), ratio(row["ratio"]),
                   _throughput(row["extra_info"]),
                   "**REGRESSION**" if row["status"] == "regression" else row["status"]]
                  for row in comparison["rows"]])]
    doc += model_steps_document(comparison["rows"])
    if comparison["removed"]:
        doc.append(Paragraph("Not in this run: " + ", ".join(comparison["removed"]) + "."))
    return doc + [Paragraph(f"Result: {result}")]


def render_bench(comparison: dict) -> str:
    """The comparison as Markdown: one row per benchmark, regressions marked."""
    return markdown(bench_document(comparison))


def render_bench_html(comparison: dict) -> str:
    """The comparison as a self-contained HTML page, with the scale curve's plot."""
    return to_html(bench_document(comparison))
