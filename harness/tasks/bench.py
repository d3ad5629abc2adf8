"""`make bench` / `kvfid bench`: what a user runs on each machine of a fleet.

In order: the environment record, the kernel comparison table, the speed benches (filed under
reports/<environment key>/bench/ and compared with the previous result of that key), the default
fidelity case into the ledger, its run report, and an update of reports/index.md; then a short
headline. A claimed invariance that fails is the verdict (exit 1); speed changes are flagged in
the headline, since one run on a shared CPU is too noisy to fail a build on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
import json
import tempfile

from kvfid.environment import envinfo, invariance
from kvfid.environment.invariance import union_probes
from kvfid.kernels.invariant import route as mode_route, tiled as mode_tiled
from kvfid.kernels.invariant.route import Route
from kvfid.reports import benchreport
from kvfid.reports.invariance_table import write_result
from kvfid.reports.model_steps import model_steps
from kvfid.runs.case import load_case
from kvfid.stacks.stack import parse_stack
from kvfid.tasks.launch import resolve_case
from kvfid.tasks.local_shards import child_env, default_jobs
from kvfid.tasks.publish import publish

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class BenchOutcome:
    """What `run_bench` did: the headline lines, the files written, and the verdict."""

    lines: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    invariance_ok: bool = True
    seconds: dict[str, float] = field(default_factory=dict)

    def text(self, total_s: float) -> str:
        """What `kvfid bench` prints on stdout: the headline lines and the time per step."""
        steps = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())
        return "\n".join(self.lines + [f"bench took {total_s:.0f} s ({steps})"])


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_bench(reports: str | Path = "reports", db: str | Path | None = None,
              case: str = "default", *, kernels_quick: bool = False, speed: bool = True,
              items: int | None = None, jobs: int | None = None) -> BenchOutcome:
    """Run every `make bench` step; return the headline and the files written."""
    chosen = load_case(resolve_case(case))      # a bad case is refused before any compute
    if items is not None:
        chosen.with_item_count(items)
    reports = Path(reports)
    db = Path(db) if db else reports / "ledger.sqlite"
    out = BenchOutcome()
    environment = envinfo.collect()
    key = envinfo.environment_key(environment)
    _log(f"environment {key}")
    folder = reports / key
    folder.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    # Without CUDA the Triton rows run in the interpreter: the tile-edge batch sizes (7/8, 16/17,
    # 33) at the full shapes, not all twelve (the kernel step's time is mostly those rows).
    cuda = environment["cuda_available"]
    kernels = invariance.compare_kernels(quick=kernels_quick, threads=1,
                                         device="cuda" if cuda else "cpu", progress=_log,
                                         batch_sizes=None if cuda or kernels_quick
                                         else invariance.QUICK_BATCH_SIZES,
                                         jobs=jobs or (1 if cuda else os.cpu_count() or 1))
    out.files["kernels"] = str(write_result(kernels, reports))
    out.seconds["kernels"] = time.perf_counter() - start
    out.invariance_ok = kernels["ok"]
    claimed = [r for r in kernels["rows"] if r["claims"]["batch"] or r["claims"]["sequence"]]
    out.lines.append(f"kernels: {'all' if kernels['ok'] else 'NOT all'} of {len(claimed)} "
                     f"implementation rows that claim invariance are bit-invariant")

    steps: list[dict] = []
    if speed:
        start = time.perf_counter()
        line, steps = _speed(reports, out)
        out.lines.append(line)
        out.seconds["speed"] = time.perf_counter() - start

    start = time.perf_counter()
    jobs = jobs or default_jobs(chosen, cuda)    # one-thread CPU stacks: a process per core
    sizing = ""
    if items is None and not cuda:
        left = BENCH_BUDGET_S - sum(out.seconds.values())
        items, sizing = sized_items(chosen, steps, jobs, left)
        _log(f"fidelity: {sizing}")
    done = publish(chosen, db, reports=reports, index_ledger=True, items=items, progress=True,
                   jobs=jobs)
    out.files.update({name: str(path) for name, path in done.files.items()})
    out.seconds["fidelity"] = time.perf_counter() - start
    out.lines += [f"fidelity: run {done.result.run_id} of {chosen.name} ({done.result.status}), "
                  f"report {done.files['markdown']}" + (f"; {sizing}" if sizing else ""),
                  done.headline(),
                  _tiled_line(kernels["tiled_probes"], kernels.get("tiled_routes") or {})]
    return out


# The bench's share, in seconds, of the time `make bench` aims at on a CPU (a fresh clone's set-up
# comes on top): the fidelity step gets what the kernel table and the speed benches left of it.
# Where this machine's model steps say the default case's items would take longer over its
# processes, it runs fewer (whole rounds of one item per process, at least one round), every
# check of each item unchanged: an item's cost differs several-fold between CPUs (docs/cases.md).
BENCH_BUDGET_S = 300.0
# What a run's items take over what `item_seconds` gives, as the sizing assumes: units run longer
# than their model steps (the tiled mode probes new call shapes; processes start and report).
# Kept as a margin: a machine where the steps predict well runs fewer items only when the budget
# is tight. The measurement behind it: docs/hazards.md, "The bench's model steps".
RUN_OVER_STEPS = 1.4


def _arm_steps(arm: str, B: int, S: int) -> int:
    """Decode steps of one arm after its prefill (kvfid.protocol): a unit's warm-up makes one; a
    prefill arm decodes the suffix only (S - 1 after the prefill's token); live, incremental and
    the others B + S - 1 (incremental feeds its B boundary tokens one at a time)."""
    return {"warm-up": 1, "prefill": S - 1}.get(arm, B + S - 1)


def item_seconds(case, steps: list[dict]) -> float | None:
    """Seconds one item of `case` would take over all its stacks, from the model bench's steps
    (kvfid.reports.model_steps) at the headline length on this machine. Per unit: a warm-up (one
    prefill, one decode step), each construction's arm (one prefill, `_arm_steps` decode steps),
    its share of the replicas' arms, and S decode steps per transplant pair (an upper bound: only
    divergent and control rows are transplanted); per item, its share of the crossing's arms at
    each crossed stack's cost. A prefill is costed as the headline's (64 tokens; a case's prompts
    are shorter). None when a stack has no measured step."""
    length = min((s["context"] for s in steps if s["context"] is not None), default=None)
    medians = {(parse_stack(s["stack"], threads=1).label, s["phase"]): s["median_s"]
               for s in steps if s["context"] == length and not s["interpreter"]}
    n, B, S = case.items.n, case.B, case.S

    def cost(stack, arms) -> float | None:
        prefill, decode = (medians.get((stack.label, phase)) for phase in ("prefill", "decode"))
        if prefill is None or decode is None:
            return None
        return sum(share * (prefill + _arm_steps(arm, B, S) * decode) for arm, share in arms)

    replicas = min(case.replicas.items or n, n) / n
    pairs = len(case.transplants.specs) if case.transplants else 0
    unit = [("warm-up", 1.0)] + [(c, 1.0) for c in case.constructions] + \
        [(a, replicas) for a in case.replicas.arms]
    total = 0.0
    for stack in case.stacks:
        seconds = cost(stack, unit)
        if seconds is None:
            return None
        share = sum(case.takes(stack, i) for i in range(n)) / n
        total += share * (seconds + pairs * S * medians[stack.label, "decode"])
    for stack in case.crossing.stacks if case.crossing else ():
        seconds = cost(stack, [(c, min(case.crossing.items or n, n) / n)
                               for c in case.crossing.constructions])
        if seconds is None:
            return None
        total += seconds
    return total


def sized_items(case, steps: list[dict], jobs: int, budget_s: float) -> tuple[int | None, str]:
    """The default case's item count on this machine and why: all of them, or whole rounds of
    `jobs` items that fit `budget_s` by `item_seconds` with its margin, RUN_OVER_STEPS (at least
    one round)."""
    n = case.items.n
    per_item = item_seconds(case, steps)
    if per_item is None:
        return None, (f"all {n} items (no model step timed here for every stack to size "
                      f"them by)")
    per_item *= RUN_OVER_STEPS
    estimate = per_item * n / jobs
    if estimate <= budget_s:
        return None, (f"all {n} items (about {estimate:.0f} s over {jobs} process(es) "
                      f"by this machine's model steps, within the {budget_s:.0f} s left)")
    rounds = max(1, int(budget_s * jobs / per_item) // jobs)
    fit = min(n, rounds * jobs)
    return fit, (f"{fit} of {n} items, sized to this machine: about {per_item:.0f} s "
                 f"an item by its model steps and a {RUN_OVER_STEPS}x margin, {estimate:.0f} s "
                 f"for all {n} over {jobs} "
                 f"process(es), over the {max(budget_s, 0):.0f} s the kernel table and the speed "
                 f"benches left of the bench's {BENCH_BUDGET_S:.0f} s")


def _tiled_line(kernel_probes: list[dict], kernel_routes: dict[str, dict]) -> str:
    """What the tiled batch-invariant mode's probes found: those of the kernel table (its
    processes) and of this one (kvfid.kernels.invariant.tiled), each call shape once; and the route each
    dtype takes on this machine (kvfid.kernels.invariant.route)."""
    probes = union_probes(kernel_probes, mode_tiled.verdicts())
    kernel_routes = {**kernel_routes, **mode_route.routes()}
    failed = [p for p in probes if p["failed"]]
    return (f"tiled mode: {len(probes)} stock call shapes probed by the kernel table and this "
            f"process, {len(probes) - len(failed)} trusted; {route_text(kernel_routes)}"
            + "".join(f"\n  fallback: {p['call']} at {p['threads']} thread(s): {p['failed']}; "
                      f"rowwise there" for p in failed))


def route_text(routes: dict[str, dict]) -> str:
    """The tiled mode's routes (kvfid.kernels.invariant.route.routes(), e.g. of the kernel table) in words."""
    if not routes:
        return "routes: none chosen (no tiled call on this CPU)"

    return "routes: " + ", ".join(f"{name} {Route(**r['route']).text()}" for name, r in sorted(routes.items()))


def bench_command(json_path: Path, quick: bool = False, part: str | None = None) -> list[str]:
    """The pytest-benchmark run of tests/bench writing `json_path`; `quick`: the fp32 attention
    and matmul decode cases, 5 rounds each (a rehearsal, not a measurement; no model steps);
    `part`: "short" or "long" (tests/bench/conftest.py: the model steps at the longest context
    are the long part), for two processes side by side."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/bench",
               "--benchmark-only", f"--benchmark-json={json_path}"]
    if part:
        command.append(f"--bench-part={part}")
    if quick:
        command += ["--bench-rehearsal", "--benchmark-warmup=off", "-k",
                    "decode and fp32 and not model and (attention or matmul)"]
    return command


def speed_parts(cuda: bool) -> tuple[str | None, ...]:
    """How the speed benches are split: on a CPU with two cores or more, two one-thread processes
    side by side (the 2048-token model steps in one, everything else in the other: those prefills
    alone take about as long as the rest, docs/environment.md); on a GPU, one process (one device
    to time on)."""
    return ("short", "long") if not cuda and (os.cpu_count() or 1) >= 2 else (None,)


NO_TESTS = 5    # pytest's exit status when every test was deselected (a part with nothing to run)


def _run_parts(raw: Path, parts) -> tuple[int, str]:
    """Run the bench suite's parts side by side, each into its own JSON, and merge them into `raw`
    (the first part's machine record, every part's benchmarks): (exit status, last output line)."""
    with tempfile.TemporaryDirectory() as scratch:
        paths = [Path(scratch) / f"{part or 'all'}.json" for part in parts]
        running = [subprocess.Popen(bench_command(path, part=part),
                                    cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
                   for path, part in zip(paths, parts)]
        outputs = [proc.communicate()[0] for proc in running]
        merged = None
        for proc, path, output in zip(running, paths, outputs):
            if proc.returncode == NO_TESTS and len(parts) > 1:
                continue
            if proc.returncode != 0 or not path.is_file():
                return proc.returncode or 1, " ".join(output.strip().splitlines()[-1:])
            data = json.loads(path.read_text())
            if merged is None:
                merged = data
            else:
                merged["benchmarks"] += data["benchmarks"]
        if merged is None:
            return NO_TESTS, "no benchmark selected"
        raw.write_text(json.dumps(merged, indent=2))
    return 0, ""


def _speed(reports: Path, out: BenchOutcome) -> tuple[str, list[dict]]:
    """Run the pytest-benchmark suite with its JSON written straight into
    reports/<environment key>/bench/ (the one store of bench results; nothing in .benchmarks/),
    and compare it with the previous result of this key: (the headline line, the model steps
    measured, which size the fidelity step)."""
    environment = envinfo.collect()
    key = envinfo.environment_key(environment)
    raw = benchreport.new_result_path(reports, key).resolve()  # pytest runs from ROOT
    parts = speed_parts(environment["cuda_available"])
    _log("speed benches: " + " ".join(bench_command(raw)[2:])
         + (f" (in {len(parts)} processes: --bench-part {', '.join(parts)})" if len(parts) > 1 else ""))
    status, last = _run_parts(raw, parts)
    if status != 0 or not raw.is_file():
        raw.unlink(missing_ok=True)     # a failed suite leaves no result in the store
        return f"speed: the bench suite failed (exit {status}): {last}", []
    saved = benchreport.save_bench(raw, reports)  # stays, unless its record names another key
    if saved.resolve() != raw:
        raw.unlink()
    previous = benchreport.latest_previous(saved.parent, exclude=saved)
    comparison = benchreport.compare_bench(saved, previous, 0.10)
    (saved.with_suffix(".md")).write_text(benchreport.render_bench(comparison) + "\n")
    (saved.with_suffix(".html")).write_text(benchreport.render_bench_html(comparison))  # + the plot
    out.files["bench"] = str(saved)
    steps = model_steps(comparison["rows"])
    if previous is None:
        return (f"speed: {len(comparison['rows'])} benchmarks filed ({saved}); no previous result "
                f"of this environment to compare with"), steps
    slower = comparison["regressions"]
    change = benchreport.processor_change(comparison)
    host = f"; that result ran on another processor of this key, {change}" if change else ""
    return (f"speed: {len(comparison['rows'])} benchmarks vs {previous.name}: {len(slower)} "
            f"slower by >10% on the median" + (f" ({', '.join(slower[:4])}...)" if slower else "")
            + host), steps
