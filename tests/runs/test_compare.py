"""`compare`: a run against itself is clean; a flipped bit-exact verdict, a rate beyond its
interval, a broken claimed kernel invariance and a slower kernel are regressions; environment keys
resolve to their latest runs (of the other side's case), across two ledger files; the HTML is
self-contained."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from fake_nvml import H200, FakeNVML  # tests/ is on sys.path (pytest's rootdir-less import mode)
from kvfid.environment import envinfo
from kvfid.runs.case import load_case, stored_case
from kvfid.compare.runs import compare, render_html, render_markdown, write_comparison, rate_change
from kvfid.ledger.store import Ledger, LedgerError
from kvfid.runs.matrix import run_case
from kvfid.runs.aggregate import rate
from kvfid.inputs.models import load_model

CASES = Path(__file__).resolve().parents[2] / "cases"
SMOKE = load_case(CASES / "smoke.toml")
# Another case on the same model: one stack shared with smoke (sdpa/bf16), one of its own.
OTHER = """name = "smoke-other"
model = "tiny-llama"
B = 6
S = 6
constructions = ["live", "prefill", "incremental"]
[items]
set = "arith"
n = 3
seed = 0
[stacks]
backends = ["sdpa"]
dtypes = ["bf16", "fp32"]
device = "cpu"
threads = 1
"""
REAL_COLLECT = envinfo.collect


def gpu_environment(driver: str) -> dict:
    """This machine's record with a (fake) H200 on `driver`: another environment key."""
    return REAL_COLLECT(FakeNVML([H200], driver_version=driver))


def key_of(driver: str) -> str:
    return envinfo.environment_key(gpu_environment(driver))


@pytest.fixture(scope="module")
def ledgers(tmp_path_factory, smoke_run):
    """A CPU ledger with the session's smoke run, and a "GPU" ledger with runs on two fake
    drivers: 570 (smoke), 575 (smoke), 570 again (smoke, newer), 570 (another case, newest).
    The smoke runs on fake drivers are the CPU run's units stored again (this CPU computes them
    the same bits); the other case is measured."""
    folder = tmp_path_factory.mktemp("compare")
    other_path = folder / "other.toml"
    other_path.write_text(OTHER)
    cpu_db, gpu_db = folder / "cpu.sqlite", folder / "gpu.sqlite"
    smoke_db, smoke_id = smoke_run
    with Ledger(smoke_db, readonly=True) as source, Ledger(cpu_db) as target:
        runs = {"cpu": store_again(source, smoke_id, target, smoke_id, REAL_COLLECT())}
    with Ledger(smoke_db, readonly=True) as source, Ledger(gpu_db) as target:
        for n, (name, driver) in enumerate((("570-old", "570.86.15"), ("575", "575.51.03"),
                                            ("570", "570.86.15"))):
            runs[name] = store_again(source, smoke_id, target, f"20260101-00000{n}-000{n}",
                                     gpu_environment(driver))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(envinfo, "collect", lambda: gpu_environment("570.86.15"))
        runs["570-other"] = run_case(load_case(other_path), gpu_db,
                                     model=load_model(SMOKE.model), progress=False).run_id
    return cpu_db, gpu_db, runs


def store_again(source: Ledger, source_id: str, target: Ledger, new_id: str, environment: dict,
                tamper=None) -> str:
    """Run `source_id` of `source` stored in `target` as `new_id`, measured (says its record) in
    `environment`; each unit's record passed through `tamper(unit) -> record`."""
    key = envinfo.environment_key(environment)
    run = source.run(source_id)
    target.create_run(new_id, stored_case(run), environment, key)
    for unit in source.units(run.id):
        record = tamper(unit) if tamper else unit.record
        target.write_unit(new_id, unit.item_index, unit.item_id, unit.stack, record, key)
    target.finish(new_id)
    return new_id


def clone(db, source: str, new_id: str, tamper=None) -> str:
    """A copy of run `source` (same environment), each unit's record passed through `tamper`."""
    with Ledger(db) as ledger:
        return store_again(ledger, source, ledger, new_id, ledger.run(source).environment,
                           tamper)


def break_bridge(unit, stack="sdpa/bf16@t1", item="arith-0002"):
    """In B: the bridge's cache differs from live on one item, from layer 1 (K) on."""
    record = unit.record
    if unit.stack != stack or unit.item_id != item:
        return record
    bridge = record.bridge
    broken = replace(bridge, cache=replace(bridge.cache, bit_exact=False, first_bad_layer=1,
                                           first_bad_kv="k", bad_layers=(1,), n_diff=3,
                                           max_ulp=2, d_rel=1e-3))
    return replace(record, comparisons=tuple(broken if c is bridge else c
                                             for c in record.comparisons),
                   arms={**record.arms, bridge.b: replace(record.arms[bridge.b],
                                                          cache_sha="0" * 64)})


def test_a_run_compared_with_itself_shows_no_difference(ledgers):
    cpu_db, _, runs = ledgers
    result = compare(cpu_db, runs["cpu"], "latest")
    assert result["a"]["run"] == result["b"]["run"] == runs["cpu"]
    assert not result["regressed"] and result["regressions"] == []
    assert result["only_a"] == result["only_b"] == []
    assert set(result["stacks"]) == {"sdpa/bf16@t1", "eager/bf16@t1", "crossing"}
    for entry in result["stacks"].values():
        assert entry["verdicts"] and {v["status"] for v in entry["verdicts"]} == {"same"}
        assert entry["rates"] and {r["status"] for r in entry["rates"]} == {"same"}
        assert entry["fingerprints"] == [] and not entry["regressed"]
    assert not any(p["changed"] for p in result["environment"])
    assert "No regression." in render_markdown(result)
    json.dumps(result)   # plain data


def test_a_flipped_bit_exact_verdict_is_a_regression_naming_stack_construction_item(ledgers,
                                                                                      tmp_path):
    _, gpu_db, runs = ledgers
    db = tmp_path / "gpu.sqlite"
    db.write_bytes(Path(gpu_db).read_bytes())
    tampered = clone(db, runs["575"], "20990101-000000-beef", break_bridge)
    result = compare(db, runs["575"], tampered)
    assert result["regressed"]
    (reason,) = [r for r in result["regressions"] if "bit-exact" in r]
    assert reason.startswith("sdpa/bf16@t1: cache bit-exact of incremental vs live (bridge)")
    assert "arith-0002" in reason and "first bad layer 1 K" in reason
    entry = result["stacks"]["sdpa/bf16@t1"]
    (verdict,) = [v for v in entry["verdicts"] if v["status"] != "same"]
    assert (verdict["held_a"], verdict["held_b"]) == (True, False)
    assert [f["item"] for f in verdict["broke"]] == ["arith-0002"] and verdict["fixed"] == []
    # The fingerprint row says which arm and what each run's stored layers say.
    (printed,) = entry["fingerprints"]
    assert (printed["item"], printed["kind"], printed["label"]) == (
        "arith-0002", "boundary", "incremental")
    assert printed["fields"] == ["cache_sha"]
    assert "A bit-exact, B first bad layer 1 K" in printed["detail"]
    # Same key, same case: a changed fingerprint also means the run does not reproduce.
    assert any("does not reproduce" in r for r in result["regressions"])
    assert not result["stacks"]["eager/bf16@t1"]["regressed"]
    text = render_markdown(result)
    assert "REGRESSED" in text and "REGRESSION" in text and "arith-0002" in text


def test_a_fixed_verdict_is_an_improvement_not_a_regression(ledgers, tmp_path):
    _, gpu_db, runs = ledgers
    db = tmp_path / "gpu.sqlite"
    db.write_bytes(Path(gpu_db).read_bytes())
    broken = clone(db, runs["575"], "20990101-000000-beef", break_bridge)
    result = compare(db, broken, runs["575"])
    (verdict,) = [v for v in result["stacks"]["sdpa/bf16@t1"]["verdicts"] if v["status"] != "same"]
    assert verdict["status"] == "better" and verdict["fixed"][0]["item"] == "arith-0002"
    assert not any("bit-exact" in r for r in result["regressions"])


def test_environment_keys_resolve_to_their_latest_runs_of_the_same_case(ledgers):
    cpu_db, gpu_db, runs = ledgers
    k570, k575 = key_of("570.86.15"), key_of("575.51.03")
    # Both keys: 570's newest run is another case; 575 has only smoke, so smoke is compared.
    result = compare(gpu_db, k570, k575)
    assert (result["a"]["run"], result["b"]["run"]) == (runs["570"], runs["575"])
    assert result["a"]["resolved_by"] == f"latest finished run of key {k570}"
    # A run id on one side: the key's latest run of that run's case; a unique key prefix works.
    result = compare(gpu_db, runs["575"], "NVIDIA-H200/570")
    assert result["b"]["run"] == runs["570"]
    result = compare(gpu_db, runs["570-other"], k575, allow_different=True)  # other case
    assert result["b"]["run"] == runs["575"]          # 575 has no run of that case: its latest
    # Two ledger files: the CPU baseline against the GPU ledger.
    result = compare((cpu_db, gpu_db), "latest", k575)
    assert (result["a"]["run"], result["b"]["run"]) == (runs["cpu"], runs["575"])
    assert result["a"]["ledger"] == str(cpu_db) and result["b"]["ledger"] == str(gpu_db)
    changed = {p["part"] for p in result["environment"] if p["changed"]}
    assert {"GPU", "driver"} <= changed and "torch" not in changed
    # Only the record differs (both ran on this CPU): a different key, nothing else changed.
    assert not result["same_environment"] and not result["regressed"]
    assert all(not e["fingerprints"] for e in result["stacks"].values())


def test_stacks_on_one_side_only_are_listed_not_compared(ledgers):
    _, gpu_db, runs = ledgers
    result = compare(gpu_db, runs["570"], runs["570-other"], allow_different=True)
    assert set(result["stacks"]) == {"sdpa/bf16@t1"}
    assert result["only_a"] == ["eager/bf16@t1", "crossing"] and result["only_b"] == ["sdpa/fp32@t1"]
    assert not result["same_case"] and any("smoke-other" in n for n in result["notes"])
    assert "Stacks in one run only" in render_markdown(result)


def test_unknown_specs_and_missing_ledgers_are_errors(ledgers, tmp_path):
    cpu_db, _, runs = ledgers
    with pytest.raises(LedgerError, match="nope"):
        compare(cpu_db, "nope", runs["cpu"])
    with pytest.raises(LedgerError, match="no ledger file"):
        compare(tmp_path / "absent.sqlite", "latest", "latest")
    assert not (tmp_path / "absent.sqlite").exists()


def test_the_interval_rule():
    worse = rate_change("suffix differs", "prefill vs live", rate(0, 50),
                         rate(20, 50), "higher")
    assert worse["status"] == "worse" and worse["a"]["ci"][1] < worse["b"]["ci"][0]
    assert rate_change("x", "y", rate(20, 50), rate(0, 50), "higher")["status"] \
        == "better"
    assert rate_change("x", "y", rate(50, 50), rate(30, 50), "lower")["status"] \
        == "worse"
    # 0/2 and 2/2 differ, but their intervals ([0, 66%] and [34%, 100%]) overlap.
    assert rate_change("x", "y", rate(0, 2), rate(2, 2), "higher")["status"] \
        == "within"


def kernel_rows(matmul_batch_invariant: bool, stock_batch_invariant: bool) -> dict:
    def row(impl, claims, invariant):
        return {"op": "matmul", "impl": impl, "dtype": "bf16",
                "claims": {"batch": claims, "sequence": claims},
                "batch": {"invariant": invariant, "first_failing_batch": None if invariant else 7,
                          "max_abs_diff": 0.0 if invariant else 0.015625},
                "sequence": {"invariant": True, "first_differing_position": None,
                             "max_abs_diff": 0.0},
                "ok": invariant or not claims}
    return {"ok": matmul_batch_invariant, "environment_key": "k",
            "rows": [row("triton", True, matmul_batch_invariant),
                     row("stock", False, stock_batch_invariant)]}


def bench(medians: dict) -> dict:
    return {"datetime": "2026-01-01T00:00:00", "machine_info": {"kvfid": {"environment_key": "k"}},
            "benchmarks": [{"name": n, "fullname": f"tests/bench.py::{n}", "group": "matmul",
                            "stats": {"median": m}} for n, m in medians.items()]}


def test_kernel_invariance_and_kernel_time_regressions(ledgers):
    cpu_db, _, runs = ledgers
    result = compare(cpu_db, runs["cpu"], runs["cpu"],
                     kernels_a=kernel_rows(True, True), kernels_b=kernel_rows(False, False),
                     bench_a=bench({"mm": 1e-3, "norm": 1e-3}),
                     bench_b=bench({"mm": 1.3e-3, "norm": 1.05e-3}))
    assert result["regressed"]
    kernel = [r for r in result["regressions"] if r.startswith("kernel matmul")]
    assert kernel == ["kernel matmul / triton / bf16: claimed batch invariance held in A and "
                      "fails in B (first failing batch 7, max abs diff 0.0156)"]
    stock = next(r for r in result["kernels"]["rows"]
                 if r["impl"] == "stock" and r["check"] == "batch")
    assert stock["status"] == "worse"           # unclaimed: listed, not a regression
    timed = [r for r in result["regressions"] if r.startswith("kernel benchmark")]
    assert len(timed) == 1 and "mm" in timed[0] and "x1.30" in timed[0]
    # One side only: noted, not compared.
    alone = compare(cpu_db, runs["cpu"], runs["cpu"], kernels_b=kernel_rows(False, False))
    assert not alone["regressed"] and "B only" in alone["kernels"]["note"]


def test_written_comparison_is_self_contained(ledgers, tmp_path):
    _, gpu_db, runs = ledgers
    result = compare(gpu_db, runs["570"], runs["575"])
    paths = write_comparison(result, tmp_path / "out")
    assert set(paths) == {"markdown", "html", "json"} and all(p.is_file() for p in paths.values())
    page = paths["html"].read_text()
    assert page == render_html(result) and "<svg" in page
    assert not re.search(r"\b(src|href)\s*=", page) and "<script" not in page \
        and "<link" not in page and "url(" not in page
    assert json.loads(paths["json"].read_text())["b"]["run"] == runs["575"]


def test_kernel_results_filed_by_bench_are_found_per_environment_key(ledgers, tmp_path):
    _, gpu_db, runs = ledgers
    for driver, invariant in (("570.86.15", True), ("575.51.03", False)):
        folder = tmp_path / "reports" / key_of(driver)
        folder.mkdir(parents=True)
        (folder / "kernels.json").write_text(json.dumps(kernel_rows(invariant, True)))
    result = compare(gpu_db, runs["570"], runs["575"], reports=tmp_path / "reports")
    assert result["inputs"]["kernels_b"].endswith(f"{key_of('575.51.03')}/kernels.json")
    assert result["inputs"]["bench_a"] is None and result["bench"] is None
    assert [r for r in result["regressions"] if r.startswith("kernel matmul / triton")]
