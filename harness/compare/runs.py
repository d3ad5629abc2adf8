"""Regression comparison of two runs: what changed between two environments (or revisions).

`compare()` resolves each side, A and B, to a stored run: a run id (or unique prefix, or `latest`),
or an environment key (its latest finished run, of the other side's case when it has one); each
side may live in its own ledger file (a committed baseline against a user's GPU ledger). It
compares like with like: runs that differ in case, model, B/S, items or thread count are refused
(`UnlikeRuns`, exit 2) unless `allow_different`, and then the report leads with what differs.
Then, per stack stored in both runs, on the items stored in both (kvfid.compare.stack):
bit-exact verdicts that flipped item by item, rates whose 95% Wilson intervals no longer overlap,
and fingerprints that differ per item and arm, with each run's own first bad layer against live.
Kernel invariance results and kernel benchmarks are optional inputs per side
(kvfid.compare.inputs). The environment table names each variable that changes numerics
(kvfid.environment.cpu.NUMERICS_ENV) that either run set. The result is plain JSON-able data
with `regressed` and its reasons; kvfid.compare.render presents it (`render_markdown`,
`render_html` and `write_comparison`, re-exported here).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from kvfid.runs.aggregate import aggregate
from kvfid.compare.render import (SHOWN, document,  # noqa: F401 (re-exported)
                                            render_html, render_markdown, svg_intervals,
                                            write_comparison)
from kvfid.compare.stack import compare_stack, rate_change  # noqa: F401 (re-exported)
from kvfid.compare.inputs import (compare_bench_inputs, compare_kernel_inputs,
                                            stored_inputs)
from kvfid.errors import BadInput
from kvfid.ledger.store import Ledger, LedgerError, default_db_path
from kvfid.runs.case import stored_case

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


# --------------------------------------------------------------------------- like with like

class UnlikeRuns(BadInput, ValueError):
    """A and B differ in what a comparison holds fixed (case, model, B/S, items, threads)."""


def differences(side_a: dict, side_b: dict) -> list[dict]:
    """What makes two runs unlike: [{what, a, b}] for case, model, B/S, items and threads."""
    def fixed(side):
        run, case = side["run"], side["case"]
        unknown = "unknown (stored case unreadable)"
        if case is None:
            return {"case": run.case_name, "model": unknown, "B/S": unknown, "items": unknown,
                    "threads": unknown}
        threads = sorted({f"t{s.threads}" if s.threads else "unset" for s in case.stacks})
        return {"case": run.case_name, "model": case.model, "B/S": f"B={case.B}, S={case.S}",
                "items": f"{case.items.set}, n={run.item_count}, seed {case.items.seed}",
                "threads": ", ".join(threads)}
    fa, fb = fixed(side_a), fixed(side_b)
    return [{"what": k, "a": fa[k], "b": fb[k]} for k in fa if fa[k] != fb[k]]


def _refuse_unlike(found: list[dict], run_a, run_b) -> None:
    if found:
        named = "; ".join(f"{d['what']} {d['a']} vs {d['b']}" for d in found)
        raise UnlikeRuns(f"A (run {run_a.id}) and B (run {run_b.id}) are not like runs: {named}. "
                         f"Compare runs of one case and thread count, or pass --allow-different "
                         f"to compare them anyway.")


# --------------------------------------------------------------------------- the comparison

def compare(ledger_or_paths, a: str, b: str, *, kernels_a=None, kernels_b=None, bench_a=None,
            bench_b=None, threshold: float = 0.10, reports=None,
            allow_different: bool = False) -> dict:
    """Compare run (or environment key) A with B. `ledger_or_paths`: a Ledger or ledger path for
    both sides, or a pair (A's, B's). Kernel and bench inputs are paths or loaded dicts; with
    `reports` (a reports folder), a side's missing ones are what `kvfid bench` filed for its key.
    Runs that differ in case, model, B/S, items or threads raise `UnlikeRuns` unless
    `allow_different`; then `differences` lists what differs."""
    pair = (ledger_or_paths if isinstance(ledger_or_paths, (tuple, list))
            else (ledger_or_paths, ledger_or_paths))
    if len(pair) != 2:
        raise ValueError(f"give one ledger, or two (A's and B's), not {len(pair)}")
    with contextlib.ExitStack() as stack:
        opened: dict = {}
        ledger_a, ledger_b = (_open(source, opened, stack) for source in pair)
        (run_a, how_a), (run_b, how_b) = _resolve(ledger_a, a, ledger_b, b)
        heads = [{"run": run, "case": _stored_case(run)} for run in (run_a, run_b)]
        unlike = differences(*heads)
        if not allow_different:
            _refuse_unlike(unlike, run_a, run_b)
        side_a, side_b = _load(ledger_a, heads[0]), _load(ledger_b, heads[1])
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
        "differences": unlike,
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
    result["kernels"], reasons = compare_kernel_inputs(kernels_a, kernels_b)
    result["regressions"] += reasons
    result["bench"], reasons = compare_bench_inputs(bench_a, bench_b, threshold)
    result["regressions"] += reasons
    result["regressed"] = bool(result["regressions"])
    return result


def compare_command(a: str, b: str, db=None, db_a=None, db_b=None, out=None,
                    allow_different: bool = False, **inputs) -> tuple[dict, dict]:
    """`kvfid compare`: A with B, each in its ledger (`db_a`, `db_b`, else `db`, else $KVFID_DB,
    else reports/ledger.sqlite; `inputs`: kernels_a/b, bench_a/b, threshold, reports); returns
    the result and {name: path} of the files written to `out`."""
    ledgers = tuple(Path(side or db) if side or db else default_db_path() for side in (db_a, db_b))
    result = compare(ledgers, a, b, allow_different=allow_different, **inputs)
    return result, (write_comparison(result, out) if out else {})


def _load(ledger: Ledger, head: dict) -> dict:
    run, case = head["run"], head["case"]
    units = ledger.units(run.id)
    names = {(u.item_index, u.stack): u.item_id for u in units}
    prints = {}
    for (index, stack), rows in ledger.stored_fingerprints(run.id).items():
        prints[(names.get((index, stack), f"#{index}"), stack)] = rows
    stacks = list(dict.fromkeys(u.stack for u in units))
    return {"run": run, "case": case, "path": str(ledger.path),
            "model": case.model if case else None,
            "units": {(u.item_id, u.stack): u for u in units}, "prints": prints,
            "stacks": stacks, "summary": aggregate(units, run.design)}


def _stored_case(run):
    try:
        return stored_case(run)
    except Exception:   # an older stored case that no longer validates: its fields are unknown
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
                "Triton launch options": str(env.get("triton_launch_options")),
                "git revision": run.git_revision}
    pa, pb = parts(run_a), parts(run_b)
    # Numerics-changing variables (kvfid.environment.cpu.numerics_env): one row each that
    # either run set, so a change is named, not folded into one cell.
    env_a, env_b = ((r.environment.get("numerics_env") or {}) for r in (run_a, run_b))
    named = [k for k in dict.fromkeys([*env_a, *env_b])
             if env_a.get(k) is not None or env_b.get(k) is not None]
    for k in named:
        pa[f"env {k}"], pb[f"env {k}"] = env_a.get(k), env_b.get(k)
    if not named:   # n/a: an older record that did not read them
        pa["numerics env"], pb["numerics env"] = ("none set" if e else None for e in (env_a, env_b))
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
