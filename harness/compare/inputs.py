"""The optional inputs of a comparison: kernel invariance results and kernel benchmarks per side.

`compare_kernel_inputs` finds claimed invariances (kvfid.environment.invariance) that held in A
and fail in B; `compare_bench_inputs` compares kernel medians (kvfid.reports.benchreport's rule);
`stored_inputs` finds what `kvfid bench` filed for an environment key. Each returns plain data
and the regression reasons for kvfid.compare.runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfid.errors import BadInput
from kvfid.reports.benchreport import compare_bench, latest_previous, load_bench
from kvfid.reports.document import number, seconds


def stored_inputs(reports, environment_key: str) -> dict:
    """What `kvfid bench` filed for a key: reports/<key>/kernels.json and the newest
    reports/<key>/bench/*.json (None where absent)."""
    folder = Path(reports) / environment_key
    kernels, bench = folder / "kernels.json", None
    if (folder / "bench").is_dir():
        bench = latest_previous(folder / "bench")
    return {"kernels": kernels if kernels.is_file() else None, "bench": bench}


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


def compare_kernel_inputs(kernels_a, kernels_b) -> tuple[dict | None, list[str]]:
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
                f"{number(verdict.get('max_abs_diff'))}")
    return (f"first differing position {verdict.get('first_differing_position')}, max abs diff "
            f"{number(verdict.get('max_abs_diff'))}")


def compare_bench_inputs(bench_a, bench_b, threshold: float) -> tuple[dict | None, list[str]]:
    """Kernel medians B against A (kvfid.reports.benchreport's rule: slower by more than threshold)."""
    if bench_a is None and bench_b is None:
        return None, []
    if bench_a is None or bench_b is None:
        return {"note": f"benchmarks given for {'A' if bench_a else 'B'} only: not compared",
                "rows": []}, []
    result = compare_bench(load_bench(bench_b), load_bench(bench_a), threshold)
    reasons = [f"kernel benchmark {r['name']}: median {seconds(r['previous_median_s'])} in A, "
               f"{seconds(r['median_s'])} in B (x{r['ratio']:.2f}, threshold "
               f"+{threshold:.0%})" if r["ratio"] is not None else
               f"kernel benchmark {r['name']}: median 0 in A, {seconds(r['median_s'])} in B"
               for r in result["rows"] if r["status"] == "regression"]
    return result, reasons
