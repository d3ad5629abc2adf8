"""Regression comparison of two runs: what changed between two environments (or revisions).

`compare()` resolves each side, A and B, to a stored run: a run id (or unique prefix, or `latest`),
or an environment key (its latest finished run, of the other side's case when it has one); each
side may live in its own ledger file (a committed baseline against a user's GPU ledger). Then, per
stack stored in both runs, on the items stored in both (harness.reports.compare_stack): bit-exact verdicts
that flipped item by item, rates whose 95% Wilson intervals no longer overlap, and fingerprints
that differ per item and arm, with each run's own first bad layer against live. Kernel invariance
results (`harness.environment.invariance.compare_kernels`) and kernel benchmarks (pytest-benchmark JSON) are
optional inputs per side, compared here. The result is plain JSON-able data with `regressed` and
its reasons; harness.reports.compare_render presents it (`render_markdown`, `render_html` and
`write_comparison`, re-exported here).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from harness.runs.aggregate import aggregate
from harness.reports.compare_render import (SHOWN, number_text, seconds_text, document,  # noqa: F401 (re-exported)
                                    render_html, render_markdown, svg_intervals, write_comparison)
from harness.reports.compare_stack import compare_stack, rate_change  # noqa: F401 (re-exported)
from harness.errors import BadInput
from harness.runs.ledger import Ledger, LedgerError

INTERVAL_RULE = ("A rate changed beyond its interval when the two runs' 95% Wilson intervals do "
                 "not overlap (then each run's rate also lies outside the other's interval); a "
                 "change in the bad direction is a regression, any smaller change is reported "
                 "as within the intervals.")
INVARIANCE_RULE = ("A bit-exact verdict is an invariance of a stack when it holds on every item "
                   "compared; one that holds on every item in A and fails on some item in B is a "
                   "regression, and the items are named.")
FINGERPRINT_RULE = ("Fingerprints that differ between two runs of one case on the same "
                    "environment key are a regression (the run does not reproduce there); "
                    "between different keys they are what the change did, and are listed.")


# --------------------------------------------------------------------------- resolving A and B

def _open(source, opened: dict, stack: contextlib.ExitStack) -> Ledger:
    if isinstance(source, Ledger):
        return source
    path = Path(source)
    if not path.is_file():
        raise LedgerError(f"{path}: no ledger file")
    key = path.resolve()
    if key not in opened:
        opened[key] = stack.enter_context(Ledger(path, readonly=True))
    return opened[key]


def _by_run(ledger: Ledger, spec: str):
    """(run, None) when `spec` names a run; (None, the error) when it does not."""
    try:
        return ledger.run(spec), None
    except LedgerError as err:
        return None, err


def _keys_matching(ledger: Ledger, spec: str) -> list[str]:
    keys = sorted({run.environment_key for run, _ in ledger.runs()})
    spec = spec.strip("/")
    return [spec] if spec in keys else [k for k in keys if k.startswith(spec)]


def _latest_of_key(ledger: Ledger, key: str, other=None):
    """The latest finished run of `key`: of `other`'s case (same text, else same name) if any."""
    runs = [run for run, _ in ledger.runs() if run.environment_key == key]
    finished = [run for run in runs if run.status == "finished"]
    if not finished:
        listed = ", ".join(f"{r.id} ({r.status})" for r in runs[-5:])
        raise LedgerError(f"{ledger.path}: no finished run on {key} (runs there: {listed})")
    if other is not None:
        for same in (lambda r: r.case_sha == other.case_sha,
                     lambda r: r.case_name == other.case_name):
            matching = [r for r in finished if same(r)]
            if matching:
                return matching[-1]
    return finished[-1]


def _resolve(ledger_a: Ledger, a: str, ledger_b: Ledger, b: str):
    """((run A, how), (run B, how)); a side given as a key follows the other side's case."""
    run_a, error_a = _by_run(ledger_a, a)
    run_b, error_b = _by_run(ledger_b, b)
    keys = {}
    for side, ledger, spec, run, error in (("A", ledger_a, a, run_a, error_a),
                                           ("B", ledger_b, b, run_b, error_b)):
        if run is not None:
            continue
        matching = _keys_matching(ledger, spec)
        if not matching:
            raise LedgerError(f"{side}: {error} (and no environment key there matches {spec!r})")
        if len(matching) > 1:
            raise LedgerError(f"{side}: {spec!r} matches {len(matching)} environment keys in "
                              f"{ledger.path}: {', '.join(matching[:5])}")
        keys[side] = matching[0]
    if "A" in keys and "B" in keys:
        run_a = _latest_of_key(ledger_a, keys["A"])
        run_b = _latest_of_key(ledger_b, keys["B"], run_a)
        if run_b.case_sha != run_a.case_sha:   # B's key lacks A's latest case: B's, on A's key?
            run_a = _latest_of_key(ledger_a, keys["A"], run_b)
    elif "A" in keys:
        run_a = _latest_of_key(ledger_a, keys["A"], run_b)
    elif "B" in keys:
        run_b = _latest_of_key(ledger_b, keys["B"], run_a)
    how = lambda side: f"latest finished run of key {keys[side]}" if side in keys else "run id"
    return (run_a, how("A")), (run_b, how("B"))


# --------------------------------------------------------------------------- the comparison

def compare(ledger_or_paths, a: str, b: str, *, kernels_a=None, kernels_b=None, bench_a=None,
            bench_b=None, threshold: float = 0.10, reports=None) -> dict:
    """Compare run (or environment key) A with B. `ledger_or_paths`: a Ledger or ledger path for
    both sides, or a pair (A's, B's). Kernel and bench inputs are paths or loaded dicts; with
    `reports` (a reports folder), a side's missing ones are what `kvfid bench` filed for its key."""
    pair = (ledger_or_paths if isinstance(ledger_or_paths, (tuple, list))
            else (ledger_or_paths, ledger_or_paths))
    if len(pair) != 2:
        raise ValueError(f"give one ledger, or two (A's and B's), not {len(pair)}")
    with contextlib.ExitStack() as stack:
        opened: dict = {}
        ledger_a, ledger_b = (_open(source, opened, stack) for source in pair)
        (run_a, how_a), (run_b, how_b) = _resolve(ledger_a, a, ledger_b, b)
        side_a, side_b = _load(ledger_a, run_a), _load(ledger_b, run_b)
    same_key = run_a.environment_key == run_b.environment_key
    if reports is not None:
        filed_a, filed_b = (stored_inputs(reports, r.environment_key) for r in (run_a, run_b))
        kernels_a, bench_a = kernels_a or filed_a["kernels"], bench_a or filed_a["bench"]
        kernels_b, bench_b = kernels_b or filed_b["kernels"], bench_b or filed_b["bench"]
    source = lambda x: None if x is None else "(given as data)" if isinstance(x, dict) else str(x)
    result = {
        "a": _describe(side_a, a, how_a), "b": _describe(side_b, b, how_b),
        "environment": _environment_parts(run_a, run_b),
        "same_environment": same_key, "same_case": run_a.case_sha == run_b.case_sha,
        "threshold": threshold,
        "rules": {"intervals": INTERVAL_RULE, "invariance": INVARIANCE_RULE,
                  "fingerprints": FINGERPRINT_RULE},
        "notes": _notes(side_a, side_b), "stacks": {},
        "only_a": [s for s in side_a["stacks"] if s not in side_b["stacks"]],
        "only_b": [s for s in side_b["stacks"] if s not in side_a["stacks"]],
        "inputs": {"kernels_a": source(kernels_a), "kernels_b": source(kernels_b),
                   "bench_a": source(bench_a), "bench_b": source(bench_b)},
        "kernels": None, "bench": None, "regressions": [],
    }
    must_reproduce = same_key and result["same_case"]
    for label in (s for s in side_a["stacks"] if s in side_b["stacks"]):
        entry, reasons = compare_stack(label, side_a, side_b, must_reproduce)
        result["stacks"][label] = entry
        result["regressions"] += reasons
    result["kernels"], reasons = _compare_kernels(kernels_a, kernels_b)
    result["regressions"] += reasons
    result["bench"], reasons = _compare_bench(bench_a, bench_b, threshold)
    result["regressions"] += reasons
    result["regressed"] = bool(result["regressions"])
    return result


def stored_inputs(reports, environment_key: str) -> dict:
    """What `kvfid bench` filed for a key: reports/<key>/kernels.json and the newest
    reports/<key>/bench/*.json (None where absent)."""
    folder = Path(reports) / environment_key
    kernels, bench = folder / "kernels.json", None
    if (folder / "bench").is_dir():
        from harness.reports.benchreport import latest_previous

        bench = latest_previous(folder / "bench")
    return {"kernels": kernels if kernels.is_file() else None, "bench": bench}


def _load(ledger: Ledger, run) -> dict:
    units = ledger.units(run.id)
    names = {(u.item_index, u.stack): u.item_id for u in units}
    prints = {}
    for (index, stack), rows in ledger.stored_fingerprints(run.id).items():
        prints[(names.get((index, stack), f"#{index}"), stack)] = rows
    stacks = list(dict.fromkeys(u.stack for u in units))
    return {"run": run, "path": str(ledger.path), "model": _case_model(run),
            "units": {(u.item_id, u.stack): u for u in units}, "prints": prints,
            "stacks": stacks, "summary": aggregate(units, run.design)}


def _case_model(run) -> str | None:
    from harness.runs.case import stored_case

    try:
        return stored_case(run).model
    except Exception:   # an older stored case that no longer validates: the model is unknown
        return None


def _describe(side: dict, spec: str, how: str) -> dict:
    run = side["run"]
    return {"spec": spec, "resolved_by": how, "run": run.id, "ledger": side["path"],
            "case": run.case_name, "case_sha": run.case_sha, "model": side["model"],
            "status": run.status, "environment_key": run.environment_key,
            "git_revision": run.git_revision, "started": run.started, "finished": run.finished,
            "units": len(side["units"]), "planned_units": run.design.get("units")}


def _environment_parts(run_a, run_b) -> list[dict]:
    """The parts of the two environment records a reader looks at, and which changed."""
    def parts(run):
        env = run.environment
        gpu = (env.get("gpus") or [{}])[0]
        versions, cpu = env.get("versions") or {}, env.get("cpu") or {}
        return {"GPU": gpu.get("name"), "compute capability": gpu.get("compute_capability"),
                "driver": gpu.get("driver_version"), "CUDA driver": gpu.get("cuda_driver_version"),
                "CUDA runtime": versions.get("cuda_runtime"), "cuDNN": versions.get("cudnn"),
                "torch": versions.get("torch"), "triton": versions.get("triton"),
                "transformers": versions.get("transformers"), "numpy": versions.get("numpy"),
                "Python": versions.get("python"), "CPU": cpu.get("model"),
                "CPU capability": cpu.get("capability"), "BLAS": cpu.get("mkl") or cpu.get("blas"),
                "oneDNN": cpu.get("onednn"),
                "numerics env": ", ".join(f"{k}={v}" for k, v in (env.get("numerics_env") or {}).items()
                                          if v is not None) or None,
                "Triton launch options": str(env.get("triton_launch_options")),
                "git revision": run.git_revision}
    pa, pb = parts(run_a), parts(run_b)
    return [{"part": k, "a": pa[k], "b": pb[k], "changed": pa[k] != pb[k]} for k in pa]


def _notes(side_a: dict, side_b: dict) -> list[str]:
    run_a, run_b = side_a["run"], side_b["run"]
    notes = []
    if run_a.case_sha != run_b.case_sha:
        notes.append(f"A ran case {run_a.case_name} ({run_a.case_sha[:12]}), B ran "
                     f"{run_b.case_name} ({run_b.case_sha[:12]}): stacks are matched by label, "
                     f"items by id, and an item is compared only where both runs gave it the same "
                     f"prompt, B and S.")
    if side_a["model"] and side_b["model"] and side_a["model"] != side_b["model"]:
        notes.append(f"the models differ ({side_a['model']} vs {side_b['model']}): fingerprints "
                     f"are not compared.")
    if run_a.id == run_b.id and side_a["path"] == side_b["path"]:
        notes.append("A and B are the same stored run.")
    for name, run in (("A", run_a), ("B", run_b)):
        if run.status != "finished":
            notes.append(f"run {name} ({run.id}) is {run.status}, not finished.")
    return notes


# --------------------------------------------------------------------------- kernels

class CompareInputError(BadInput, ValueError):
    """A kernels or bench input of `compare` that cannot be read."""


def _load_json(source, what: str, key: str) -> dict:
    if isinstance(source, dict):
        data = source
    else:
        try:
            with open(source, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            raise CompareInputError(f"{source}: cannot read the {what} ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise CompareInputError(f"{source if not isinstance(source, dict) else 'the given dict'}: "
                         f"not a {what} (no {key!r} list)")
    return data


def _compare_kernels(kernels_a, kernels_b) -> tuple[dict | None, list[str]]:
    """Kernel invariance verdicts per (op, impl, dtype, check) that changed between A and B."""
    if kernels_a is None and kernels_b is None:
        return None, []
    if kernels_a is None or kernels_b is None:
        return {"note": f"kernel results given for {'A' if kernels_a else 'B'} only: not "
                        f"compared", "rows": [], "only_a": [], "only_b": []}, []
    ka = _load_json(kernels_a, "kernel comparison", "rows")
    kb = _load_json(kernels_b, "kernel comparison", "rows")
    key = lambda r: (r["op"], r["impl"], r["dtype"])
    rows_a, rows_b = {key(r): r for r in ka["rows"]}, {key(r): r for r in kb["rows"]}
    rows, reasons = [], []
    for k, ra in rows_a.items():
        rb = rows_b.get(k)
        if rb is None:
            continue
        for check in ("batch", "sequence"):
            held_a, held_b = ra[check]["invariant"], rb[check]["invariant"]
            claimed = bool((rb.get("claims") or {}).get(check))
            status = ("same" if held_a == held_b else "better" if held_b else
                      "regression" if claimed else "worse")
            detail = "" if held_b else _kernel_failure(check, rb[check])
            rows.append({"op": k[0], "impl": k[1], "dtype": k[2], "check": check,
                         "claimed": claimed, "a": held_a, "b": held_b, "status": status,
                         "detail": detail})
            if status == "regression":
                reasons.append(f"kernel {' / '.join(k)}: claimed {check} invariance held in A and "
                               f"fails in B ({detail})")
    return {"a_environment_key": ka.get("environment_key"),
            "b_environment_key": kb.get("environment_key"), "rows": rows,
            "only_a": [" / ".join(k) for k in rows_a if k not in rows_b],
            "only_b": [" / ".join(k) for k in rows_b if k not in rows_a]}, reasons


def _kernel_failure(check: str, verdict: dict) -> str:
    if check == "batch":
        return (f"first failing batch {verdict.get('first_failing_batch')}, max abs diff "
                f"{number_text(verdict.get('max_abs_diff'))}")
    return (f"first differing position {verdict.get('first_differing_position')}, max abs diff "
            f"{number_text(verdict.get('max_abs_diff'))}")


def _compare_bench(bench_a, bench_b, threshold: float) -> tuple[dict | None, list[str]]:
    """Kernel medians B against A (harness.reports.benchreport's rule: slower by more than threshold)."""
    if bench_a is None and bench_b is None:
        return None, []
    if bench_a is None or bench_b is None:
        return {"note": f"benchmarks given for {'A' if bench_a else 'B'} only: not compared",
                "rows": []}, []
    from harness.reports.benchreport import compare_bench, load_bench

    result = compare_bench(load_bench(bench_b), load_bench(bench_a), threshold)
    reasons = [f"kernel benchmark {r['name']}: median {seconds_text(r['previous_median_s'])} in A, "
               f"{seconds_text(r['median_s'])} in B (x{r['ratio']:.2f}, threshold "
               f"+{threshold:.0%})" if r["ratio"] is not None else
               f"kernel benchmark {r['name']}: median 0 in A, {seconds_text(r['median_s'])} in B"
               for r in result["rows"] if r["status"] == "regression"]
    return result, reasons
