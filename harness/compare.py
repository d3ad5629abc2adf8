"""Regression comparison of two runs: what changed between two environments (or revisions).

`compare()` resolves each side, A and B, to a stored run: a run id (or unique prefix, or `latest`),
or an environment key (its latest finished run, of the other side's case when it has one); each
side may live in its own ledger file (a committed baseline against a user's GPU ledger). Then, per
stack stored in both runs, on the items stored in both: bit-exact verdicts that flipped item by
item, rates whose 95% Wilson intervals no longer overlap, and fingerprints that differ per item and
arm, with each run's own first bad layer against live. Kernel invariance results
(`harness.invariance.compare_kernels`) and kernel benchmarks (pytest-benchmark JSON) are optional
inputs per side. The result is plain JSON-able data with `regressed` and its reasons;
`render_markdown`, `render_html` and `write_comparison` present it.
"""

from __future__ import annotations

import contextlib
import html
import json
from pathlib import Path

from harness import stats
from harness.ledger import Ledger, LedgerError
from harness.report import aggregate, markdown, to_html

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
SHOWN = 40          # rows of a long list shown in the Markdown (the JSON has them all)


# --------------------------------------------------------------------------- resolving A and B

def _open(source, opened: dict, stack: contextlib.ExitStack) -> Ledger:
    if isinstance(source, Ledger):
        return source
    path = Path(source)
    if not path.is_file():
        raise LedgerError(f"{path}: no ledger file")
    key = path.resolve()
    if key not in opened:
        opened[key] = stack.enter_context(Ledger(path))
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
        entry, reasons = _compare_stack(label, side_a, side_b, must_reproduce)
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
        from harness.benchreport import latest_previous

        bench = latest_previous(folder / "bench")
    return {"kernels": kernels if kernels.is_file() else None, "bench": bench}


def _load(ledger: Ledger, run) -> dict:
    units = ledger.units(run.id)
    names = {(u.item_index, u.stack): u.item_id for u in units}
    prints = {}
    for (index, stack), rows in ledger.stored_fingerprints(run.id).items():
        prints[(names.get((index, stack), f"#{index}"), stack)] = rows
    stacks = list(dict.fromkeys(u.stack for u in units))
    try:
        summary, error = aggregate(units, run.design), None
    except (KeyError, TypeError, ValueError) as err:   # records of an older format
        summary, error = None, f"{type(err).__name__}: {err}"
    return {"run": run, "path": str(ledger.path), "model": _case_model(run),
            "units": {(u.item_id, u.stack): u for u in units}, "prints": prints,
            "stacks": stacks, "summary": summary, "aggregate_error": error}


def _case_model(run) -> str | None:
    from harness.case import stored_case

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
    for name, side in (("A", side_a), ("B", side_b)):
        if side["aggregate_error"]:
            notes.append(f"run {name}'s records could not be aggregated "
                         f"({side['aggregate_error']}; an older record format?): rates are not "
                         f"compared, verdicts and fingerprints are.")
    if run_a.id == run_b.id and side_a["path"] == side_b["path"]:
        notes.append("A and B are the same stored run.")
    for name, run in (("A", run_a), ("B", run_b)):
        if run.status != "finished":
            notes.append(f"run {name} ({run.id}) is {run.status}, not finished.")
    return notes


# --------------------------------------------------------------------------- one stack

def _compare_stack(label: str, side_a: dict, side_b: dict, must_reproduce: bool):
    """(the stack's entry, its regression reasons); `must_reproduce`: same key and case."""
    units_a = {i: u for (i, s), u in side_a["units"].items() if s == label}
    units_b = {i: u for (i, s), u in side_b["units"].items() if s == label}
    both = [i for i in units_a if i in units_b]
    comparable = [i for i in both if _comparable(units_a[i].record, units_b[i].record)]
    ok = [i for i in comparable
          if units_a[i].record.get("status") == units_b[i].record.get("status") == "ok"]
    entry = {"items": {"compared": ok,
                       "only_a": [i for i in units_a if i not in units_b],
                       "only_b": [i for i in units_b if i not in units_a],
                       "not_comparable": [i for i in both if i not in comparable],
                       "status_changed": [{"item": i, "a": units_a[i].record.get("status"),
                                           "b": units_b[i].record.get("status")}
                                          for i in comparable if units_a[i].record.get("status")
                                          != units_b[i].record.get("status")]}}
    reasons = []
    entry["verdicts"] = _verdict_changes([(i, units_a[i].record, units_b[i].record) for i in ok])
    for v in entry["verdicts"]:
        if v["status"] == "regression":
            items = "; ".join(f"{f['item']} (B: {f['b']})" for f in v["broke"][:5])
            more = f" and {len(v['broke']) - 5} more" if len(v["broke"]) > 5 else ""
            reasons.append(f"{label}: {v['check']} of {v['construction']} held on all "
                           f"{v['a']['n']} items in A and fails in B on {items}{more}")
    summary_a, summary_b = side_a["summary"], side_b["summary"]
    if summary_a is None or summary_b is None:
        entry["rates"] = []
    elif label == "crossing":
        entry["rates"] = _crossing_rates(summary_a["crossing"], summary_b["crossing"])
    else:
        entry["rates"] = _rate_changes(summary_a["stacks"][label], summary_b["stacks"][label])
    for r in entry["rates"]:
        if r["status"] == "worse":
            reasons.append(f"{label}: {r['measure']} of {r['construction']} worse beyond the 95% "
                           f"intervals: {_count(r['a'])} in A, {_count(r['b'])} in B")
    models = side_a["model"], side_b["model"]
    compare_prints = not (all(models) and models[0] != models[1])
    entry["fingerprints"] = [] if not compare_prints else _fingerprint_changes(
        label, comparable, side_a, side_b)
    entry["fingerprints_compared"] = compare_prints
    if must_reproduce and entry["fingerprints"]:
        items = sorted({d["item"] for d in entry["fingerprints"]})
        shown = ", ".join(items[:5]) + (", ..." if len(items) > 5 else "")
        reasons.append(f"{label}: fingerprints differ on {len(items)} item(s) ({shown}) between "
                       f"two runs of one case on the same environment key: the run does not "
                       f"reproduce there")
    entry["regressed"] = bool(reasons)
    return entry, reasons


def _comparable(ra: dict, rb: dict) -> bool:
    """Same prompt, B and S: the two units measured the same thing."""
    prompt = lambda r: r["item"].get("prompt") if isinstance(r.get("item"), dict) else r.get("item")
    return (prompt(ra), ra.get("B"), ra.get("S")) == (prompt(rb), rb.get("B"), rb.get("S"))


def _verdicts(record: dict) -> dict[tuple, tuple[bool, str]]:
    """{(check, construction, invariance?): (holds, what it says)} of one unit's record."""
    out = {}
    for c in record.get("comparisons", []):
        cache, logits, suffix = c.get("cache"), c.get("logits") or {}, c["suffix"]
        if "stack" in c:        # a crossing comparison, within one precision
            where = f"{c['b']} vs {c['a']} at {c['stack']}"
        elif c["kind"] == "bridge":
            where = f"{c['b']} vs {c['a']} (bridge)"
        else:
            where = f"{c['b']} vs {c['a']}"
        if c.get("kind") == "replica":
            exact = bool(cache and cache.get("bit_exact")) and bool(logits.get("equal")) \
                and suffix["identical"]
            out[("replica bit-exact", c["a"], True)] = (exact, _state_text(c))
            continue
        if cache is not None:
            out[("cache bit-exact", where, True)] = (bool(cache.get("bit_exact")), _state_text(c))
        out[("suffix identical", where, False)] = (
            suffix["identical"], "identical" if suffix["identical"]
            else f"diverges at {suffix['first_divergence']}")
    for label, arm in (record.get("arms") or {}).items():
        if arm.get("rows_identical") is not None:
            out[("batched rows identical", label, True)] = (
                bool(arm["rows_identical"]), "every row's state equals row 0's"
                if arm["rows_identical"] else "a row's state differs from row 0's")
    for key, cell in (record.get("cells") or {}).items():
        same = cell.get("same_as_reference_live")
        if same is not None:
            out[("suffix equals reference live", key.replace("|", " "), False)] = (
                bool(same), "equal" if same else "differs")
    return out


def _state_text(c: dict) -> str:
    """One comparison's cache verdict: `bit-exact`, or its first bad layer and size."""
    cache = c.get("cache")
    if not cache:
        return "no cache comparison"
    if cache.get("bit_exact"):
        text = "bit-exact"
    else:
        kv = (cache.get("first_bad_kv") or "").upper()
        bad = cache.get("bad_layers") or []
        text = (f"first bad layer {cache.get('first_bad_layer')}{' ' + kv if kv else ''}"
                f" ({len(bad)} layer(s) differ), max ULP {cache.get('max_ulp')}, "
                f"d_rel {_num(cache.get('d_rel'))}")
    if c.get("kind") == "replica" and not c["suffix"]["identical"]:
        text += f"; suffix diverges at {c['suffix']['first_divergence']}"
    return text


def _verdict_changes(units: list[tuple[str, dict, dict]]) -> list[dict]:
    """Per (check, construction): counts in A and B over the same items, items that flipped."""
    table: dict[tuple, dict] = {}
    for item, ra, rb in units:
        va, vb = _verdicts(ra), _verdicts(rb)
        for key in [k for k in va if k in vb]:
            check, construction, invariance = key
            entry = table.setdefault(key, {
                "check": check, "construction": construction, "invariance": invariance,
                "a": {"k": 0, "n": 0}, "b": {"k": 0, "n": 0}, "broke": [], "fixed": []})
            (held_a, text_a), (held_b, text_b) = va[key], vb[key]
            for side, held in (("a", held_a), ("b", held_b)):
                entry[side]["k"] += held
                entry[side]["n"] += 1
            if held_a != held_b:
                entry["broke" if held_a else "fixed"].append(
                    {"item": item, "a": text_a, "b": text_b})
    for entry in table.values():
        entry["held_a"] = entry["a"]["n"] > 0 and entry["a"]["k"] == entry["a"]["n"]
        entry["held_b"] = entry["b"]["n"] > 0 and entry["b"]["k"] == entry["b"]["n"]
        if entry["invariance"] and entry["held_a"] and not entry["held_b"]:
            entry["status"] = "regression"
        elif entry["broke"] and entry["fixed"]:
            entry["status"] = "changed"
        elif entry["broke"]:
            entry["status"] = "worse"
        elif entry["fixed"]:
            entry["status"] = "better"
        else:
            entry["status"] = "same"
    return list(table.values())


# --------------------------------------------------------------------------- rates

def _rate(k: int, n: int) -> dict:
    lo, hi = stats.wilson_interval(k, n)
    return {"k": k, "n": n, "rate": k / n if n else None, "ci": [lo, hi]}


def rate_change(measure: str, construction: str, ra: dict | None, rb: dict | None,
                 worse: str) -> dict | None:
    """`worse`: `higher` or `lower`; status same / within / worse / better (INTERVAL_RULE)."""
    if not ra or not rb:
        return None
    ra, rb = _rate(ra["k"], ra["n"]), _rate(rb["k"], rb["n"])   # recomputed: one source of CI
    if (ra["k"], ra["n"]) == (rb["k"], rb["n"]):
        status = "same"
    elif ra["ci"][1] < rb["ci"][0]:
        status = "worse" if worse == "higher" else "better"
    elif rb["ci"][1] < ra["ci"][0]:
        status = "better" if worse == "higher" else "worse"
    else:
        status = "within"
    return {"measure": measure, "construction": construction, "worse_when": worse,
            "a": ra, "b": rb, "status": status}


def _flips(paired: dict | None) -> dict | None:
    """Correctness flips against live (either direction) as a count of the paired items."""
    if not paired or not paired.get("n"):
        return None
    return {"k": paired["a_right_b_wrong"] + paired["a_wrong_b_right"], "n": paired["n"]}


def _rate_changes(sa: dict, sb: dict) -> list[dict]:
    rows = []
    for label, ca in sa["constructions"].items():
        cb = sb["constructions"].get(label)
        if cb is None:
            continue
        name = f"{label} vs {ca['vs']}" + (" (bridge)" if ca["kind"] == "bridge" else "")
        rows += [rate_change("suffix differs", name, ca["suffix_disagree"],
                              cb["suffix_disagree"], "higher"),
                 rate_change("cache bit-exact", name, ca["cache_bit_exact"],
                              cb["cache_bit_exact"], "lower"),
                 rate_change("correctness flips", name, _flips(ca["correctness"]),
                              _flips(cb["correctness"]), "higher")]
    for arm, ra in sa["replicas"].items():
        rows.append(rate_change("replica floor (suffix differs)", f"{arm} twice", ra,
                                 sb["replicas"].get(arm), "higher"))
    for arm, ra in sa["batched_rows_identical"].items():
        rows.append(rate_change("batched rows identical", arm, ra,
                                 sb["batched_rows_identical"].get(arm), "lower"))
    return [r for r in rows if r]


def _crossing_rates(xa: dict | None, xb: dict | None) -> list[dict]:
    if not xa or not xb:
        return []
    rows = []
    for stack, cells in xa["cells"].items():
        for construction, ra in cells.items():
            rows.append(rate_change("suffix equals reference live", f"{stack} {construction}",
                                     ra, xb["cells"].get(stack, {}).get(construction), "lower"))
        within_b = xb["within"].get(stack)
        if within_b:
            within = xa["within"][stack]
            rows.append(rate_change("suffix differs", f"{within['pair']} at {stack}",
                                     within["suffix_disagree"], within_b["suffix_disagree"],
                                     "higher"))
    return [r for r in rows if r]


# --------------------------------------------------------------------------- fingerprints

def _fingerprint_changes(label: str, items: list[str], side_a: dict, side_b: dict) -> list[dict]:
    """One entry per (item, row) whose stored fingerprints differ between the runs."""
    out = []
    for item in items:
        pa, pb = side_a["prints"].get((item, label), {}), side_b["prints"].get((item, label), {})
        ra = side_a["units"][(item, label)].record
        rb = side_b["units"][(item, label)].record
        for row in sorted(set(pa) | set(pb)):
            old, new = pa.get(row), pb.get(row)
            if old == new:
                continue
            kind, name = row
            fields = (["row stored in B only"] if old is None else ["row stored in A only"]
                      if new is None else sorted(f for f in set(old) | set(new)
                                                 if old.get(f) != new.get(f)))
            out.append({"item": item, "kind": kind, "label": name, "fields": fields,
                        "detail": _fingerprint_detail(kind, name, fields, ra, rb)})
    return out


def _fingerprint_detail(kind: str, name: str, fields: list[str], ra: dict, rb: dict) -> str:
    """What the stored records say about a differing row: where tokens part, each run's layers."""
    parts = []
    if kind == "prefix":
        at = _first_difference(ra.get("prefix") or [], rb.get("prefix") or [])
        parts.append(f"P differs from token {at}: the live generation changed, so every state "
                     f"and suffix of this item is built over another prefix")
    if kind == "boundary":
        arm_a, arm_b = (r.get("arms", {}).get(name) or {} for r in (ra, rb))
        if "suffix_sha" in fields:
            at = _first_difference(arm_a.get("suffix") or [], arm_b.get("suffix") or [])
            parts.append(f"suffix differs from token {at}")
        if "cache_sha" in fields:
            ca, cb = _against_live(ra, name), _against_live(rb, name)
            if ca is None or cb is None:
                parts.append("cache bytes differ (one hash per cache is stored, so the layers "
                             "where the two runs' states differ are not known)")
            else:
                parts.append(f"cache bytes differ; against {ca['a']}: A {_state_text(ca)}, "
                             f"B {_state_text(cb)}")
        if "logits_sha" in fields:
            parts.append("boundary logits differ")
    if kind == "crossing-cell":
        cell_a, cell_b = (r.get("cells", {}).get(name) or {} for r in (ra, rb))
        if "suffix_sha" in fields:
            at = _first_difference(cell_a.get("suffix") or [], cell_b.get("suffix") or [])
            parts.append(f"suffix differs from token {at}")
    if kind == "replica" and "verdict" in fields:
        parts.append("the replica verdict changed")
    if kind == "transplant" and "outcome" in fields:
        ta, tb = (next((t for t in r.get("transplants", []) if t.get("label") == name), {})
                  for r in (ra, rb))
        parts.append(f"outcome {ta.get('outcome')} in A, {tb.get('outcome')} in B")
    return "; ".join(parts)


def _against_live(record: dict, arm: str) -> dict | None:
    """The stored comparison of `arm`'s state with the reference (live); None for live itself."""
    return next((c for c in record.get("comparisons", [])
                 if c.get("b") == arm and c.get("kind") != "replica"), None)


def _first_difference(a: list, b: list) -> int | None:
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if list(a) == list(b) else common


# --------------------------------------------------------------------------- kernels

def _load_json(source, what: str, key: str) -> dict:
    if isinstance(source, dict):
        data = source
    else:
        with open(source, encoding="utf-8") as f:
            data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise ValueError(f"{source if not isinstance(source, dict) else 'the given dict'}: "
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
                f"{_num(verdict.get('max_abs_diff'))}")
    return (f"first differing position {verdict.get('first_differing_position')}, max abs diff "
            f"{_num(verdict.get('max_abs_diff'))}")


def _compare_bench(bench_a, bench_b, threshold: float) -> tuple[dict | None, list[str]]:
    """Kernel medians B against A (harness.benchreport's rule: slower by more than threshold)."""
    if bench_a is None and bench_b is None:
        return None, []
    if bench_a is None or bench_b is None:
        return {"note": f"benchmarks given for {'A' if bench_a else 'B'} only: not compared",
                "rows": []}, []
    from harness.benchreport import compare_bench, load_bench

    result = compare_bench(load_bench(bench_b), load_bench(bench_a), threshold)
    reasons = [f"kernel benchmark {r['name']}: median {_seconds(r['previous_median_s'])} in A, "
               f"{_seconds(r['median_s'])} in B (x{r['ratio']:.2f}, threshold "
               f"+{threshold:.0%})" if r["ratio"] is not None else
               f"kernel benchmark {r['name']}: median 0 in A, {_seconds(r['median_s'])} in B"
               for r in result["rows"] if r["status"] == "regression"]
    return result, reasons


# --------------------------------------------------------------------------- rendering

def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _count(r: dict | None) -> str:
    if not r:
        return "-"
    return f"{r['k']}/{r['n']} ({_pct(r['rate'])}) [{_pct(r['ci'][0])}, {_pct(r['ci'][1])}]"


def _num(x) -> str:
    return "n/a" if x is None else format(x, ".3g")


def _seconds(x) -> str:
    return "-" if x is None else f"{x * 1e3:.3g} ms"


def _table(head, rows) -> tuple:
    return ("table", [str(h) for h in head], [[str(c) for c in r] for r in rows])


def _items(flips: list[dict]) -> str:
    shown = "; ".join(f"{f['item']} (A: {f['a']}; B: {f['b']})" for f in flips[:5])
    return shown + (f"; {len(flips) - 5} more" if len(flips) > 5 else "")


def document(result: dict) -> list[tuple]:
    """The comparison as report blocks (see harness.report.document)."""
    a, b = result["a"], result["b"]
    verdict = (f"REGRESSED: {len(result['regressions'])} regression(s)." if result["regressed"]
               else "No regression.")
    doc = [("h1", f"kvfid compare: A {a['run']} vs B {b['run']}"), ("p", verdict),
           _table(["", "A", "B"], [
               ["given as"] + [f"{s['spec']} ({s['resolved_by']})" for s in (a, b)],
               ["run", a["run"], b["run"]], ["ledger", a["ledger"], b["ledger"]],
               ["case"] + [f"{s['case']} ({s['case_sha'][:12]})" for s in (a, b)],
               ["model", a["model"] or "unknown", b["model"] or "unknown"],
               ["status", f"{a['status']}: {a['units']}/{a['planned_units']} units",
                f"{b['status']}: {b['units']}/{b['planned_units']} units"],
               ["finished", a["finished"] or "-", b["finished"] or "-"],
               ["environment key", a["environment_key"], b["environment_key"]]]),
           ("h2", "Environment"),
           _table(["", "A", "B", "changed"],
                  [[p["part"], _none(p["a"]), _none(p["b"]), "CHANGED" if p["changed"] else ""]
                   for p in result["environment"]])]
    if result["regressions"]:
        doc += [("h2", "Regressions"), ("pre", "\n".join(result["regressions"]))]
    doc += [("h2", "Rules"), ("p", result["rules"]["invariance"]),
            ("p", result["rules"]["intervals"]), ("p", result["rules"]["fingerprints"])]
    if result["notes"]:
        doc += [("h2", "Notes"), ("pre", "\n".join(result["notes"]))]
    for label, entry in result["stacks"].items():
        doc += _stack_blocks(label, entry)
    if result["only_a"] or result["only_b"]:
        doc += [("h2", "Stacks in one run only (not compared)"),
                _table(["run", "stacks"], [["A", ", ".join(result["only_a"]) or "-"],
                                           ["B", ", ".join(result["only_b"]) or "-"]])]
    doc += (_kernel_blocks(result["kernels"], result["inputs"])
            + _bench_blocks(result["bench"], result["inputs"]))
    return doc


def _none(x) -> str:
    return "n/a" if x is None else str(x)


def _stack_blocks(label: str, entry: dict) -> list[tuple]:
    items = entry["items"]
    out = [("h2", f"Stack {label}" + (" (regressed)" if entry["regressed"] else "")),
           ("p", f"{len(items['compared'])} item(s) with a boundary state in both runs."
                 + "".join(f" {name.replace('_', ' ')}: {', '.join(map(str, ids))}."
                           for name, ids in (("only in A", items["only_a"]),
                                             ("only in B", items["only_b"]),
                                             ("not comparable", items["not_comparable"])) if ids)
                 + "".join(f" {s['item']}: {s['a']} in A, {s['b']} in B."
                           for s in items["status_changed"]))]
    if entry["verdicts"]:
        out += [("h3", "Bit-exact verdicts, item by item"), _table(
            ["check", "construction", "A", "B", "status", "items that flipped"],
            [[v["check"], v["construction"], f"{v['a']['k']}/{v['a']['n']}",
              f"{v['b']['k']}/{v['b']['n']}",
              v["status"].upper() if v["status"] == "regression" else v["status"],
              _items(v["broke"] + v["fixed"]) or "-"] for v in entry["verdicts"]])]
    if entry["rates"]:
        out += [("h3", "Rates with 95% Wilson intervals"), _table(
            ["measure", "construction", "A", "B", "change"],
            [[r["measure"], r["construction"], _count(r["a"]), _count(r["b"]),
              r["status"].upper() if r["status"] == "worse" else r["status"]]
             for r in entry["rates"]]),
            ("figure", svg_intervals(entry["rates"]),
             f"Rates of {label}, A above B on each line, with 95% Wilson intervals.")]
    prints = entry["fingerprints"]
    out.append(("h3", "Fingerprints"))
    if not entry["fingerprints_compared"]:
        out.append(("p", "not compared (the runs measured different models)."))
    elif not prints:
        out.append(("p", "identical on every item stored in both runs."))
    else:
        items_hit = sorted({d["item"] for d in prints})
        out += [("p", f"{len(prints)} row(s) on {len(items_hit)} item(s) differ"
                      f"{f' (first {SHOWN} shown)' if len(prints) > SHOWN else ''}."),
                _table(["item", "row", "fields that differ", "what the records say"],
                       [[d["item"], f"{d['kind']} {d['label']}", ", ".join(d["fields"]),
                         d["detail"] or "-"] for d in prints[:SHOWN]])]
    return out


def _kernel_blocks(kernels: dict | None, inputs: dict) -> list[tuple]:
    if kernels is None:
        return []
    out = [("h2", "Kernel invariance"),
           ("p", f"A: {inputs['kernels_a'] or 'none'}; B: {inputs['kernels_b'] or 'none'}.")]
    if "note" in kernels:
        return out + [("p", kernels["note"])]
    changed = [r for r in kernels["rows"] if r["status"] != "same"]
    out.append(("p", f"A measured on {kernels['a_environment_key']}, B on "
                     f"{kernels['b_environment_key']}; {len(kernels['rows'])} verdicts compared, "
                     f"{len(changed)} changed. A claimed invariance that held in A and fails in B "
                     f"is a regression; an unclaimed one (a stock path) that changes is listed."))
    if changed:
        out.append(_table(["op", "impl", "dtype", "check", "claimed", "A", "B", "status",
                           "B's failure"],
                          [[r["op"], r["impl"], r["dtype"], r["check"], r["claimed"],
                            "invariant" if r["a"] else "NOT", "invariant" if r["b"] else "NOT",
                            r["status"].upper() if r["status"] == "regression" else r["status"],
                            r["detail"] or "-"] for r in changed]))
    for name, rows in (("A", kernels["only_a"]), ("B", kernels["only_b"])):
        if rows:
            out.append(("p", f"Only in {name}: {', '.join(rows)}."))
    return out


def _bench_blocks(bench: dict | None, inputs: dict) -> list[tuple]:
    if bench is None:
        return []
    out = [("h2", "Kernel time"),
           ("p", f"A: {inputs['bench_a'] or 'none'}; B: {inputs['bench_b'] or 'none'}.")]
    if "note" in bench:
        return out + [("p", bench["note"])]
    out += [("p", f"Median of each benchmark, B against A; slower by more than "
                  f"{bench['threshold']:.0%} is a regression."),
            _table(["benchmark", "A median", "B median", "B / A", "status"],
                   [[r["name"], _seconds(r["previous_median_s"]), _seconds(r["median_s"]),
                     "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
                     r["status"].upper() if r["status"] == "regression" else r["status"]]
                    for r in bench["rows"]])]
    if bench.get("removed"):
        out.append(("p", f"Only in A: {', '.join(bench['removed'])}."))
    return out


def svg_intervals(rates: list[dict]) -> str:
    """One line per rate: A's and B's point and 95% interval on a 0-100% axis."""
    left, width, line, top = 300, 380, 26, 18
    height = top + line * len(rates) + 30
    x = lambda v: left + width * v
    parts = [f'<svg viewBox="0 0 {left + width + 20} {height}" width="{left + width + 20}" '
             f'height="{height}" role="img" font-family="sans-serif" font-size="11">']
    for tick in (0, 0.25, 0.5, 0.75, 1):
        parts.append(f'<line x1="{x(tick):.1f}" x2="{x(tick):.1f}" y1="{top - 6}" '
                     f'y2="{height - 24}" stroke="#eee"/><text x="{x(tick):.1f}" '
                     f'y="{height - 10}" text-anchor="middle">{int(tick * 100)}%</text>')
    for i, r in enumerate(rates):
        y = top + line * i
        name = html.escape(f"{r['measure']}: {r['construction']}")
        color = "#d62728" if r["status"] == "worse" else "#222"
        parts.append(f'<text x="{left - 8}" y="{y + 9}" text-anchor="end" fill="{color}">'
                     f'{name}</text>')
        for offset, side, stroke in ((0, "a", "#1f77b4"), (10, "b", "#ff7f0e")):
            rate = r[side]
            lo, hi = rate["ci"]
            yy = y + offset + 1
            parts.append(f'<line x1="{x(lo):.1f}" x2="{x(hi):.1f}" y1="{yy}" y2="{yy}" '
                         f'stroke="{stroke}" stroke-width="2"><title>{side.upper()}: '
                         f'{html.escape(_count(rate))}</title></line>')
            if rate["rate"] is not None:
                parts.append(f'<circle cx="{x(rate["rate"]):.1f}" cy="{yy}" r="3" '
                             f'fill="{stroke}"/>')
    parts.append(f'<text x="{left}" y="{top - 8}" fill="#1f77b4">A</text>'
                 f'<text x="{left + 14}" y="{top - 8}" fill="#ff7f0e">B</text>')
    return "".join(parts) + "</svg>"


def render_markdown(result: dict) -> str:
    """The comparison as Markdown (the interval figures are in the HTML)."""
    return markdown(document(result))


def render_html(result: dict) -> str:
    """The comparison as one self-contained HTML page (inline CSS and SVG)."""
    return to_html(document(result))


def write_comparison(result: dict, out_dir) -> dict[str, Path]:
    """Write comparison.md, comparison.html and comparison.json to `out_dir`."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / "comparison.md", "html": folder / "comparison.html",
             "json": folder / "comparison.json"}
    paths["markdown"].write_text(render_markdown(result), encoding="utf-8")
    paths["html"].write_text(render_html(result), encoding="utf-8")
    paths["json"].write_text(json.dumps(result, indent=1), encoding="utf-8")
    return paths
