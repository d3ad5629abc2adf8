"""`make gpu-check`: the one prepared script for a GPU machine.

Runs, in order and each under its own time limit, most wanted first (a budget cuts the last):
`kvfid compile` (every kernel config compiled for sm_80/sm_90/sm_100 and judged, with its roofline;
it needs no GPU, so a lease skips it: `--skip compile`), the kernel speed table (kvfid against
stock per bench shape with its bits check, the split decode against its floor, the matmul's M
buckets: kvfid.environment.speed_table), the profile of one prefill and one decode step per bf16
stack of the default case (kvfid.tasks.unit_profile), the default case
`cases/gpu-qwen2.5-shape.toml` complete, a timed 4-item slice of the seed paper's design
(`cases/paper-shape.toml`: SmolLM2's shape, random weights; into the same ledger), `kvfid
kernels`, the GPU-marked tests, tensor parallel on two ranks (`tp`, `tp-stock`: the
TP-invariant stack bit-exact against its TP=1 rebuilds, stock sdpa's difference shown), and
the default case's report; writes every result into one flat
output folder (at most 8 files, for machines that return only a few: the run's
aggregates and report.html are not copied, since `kvfid show` / `kvfid report` rebuild them from
ledger.sqlite) and prints a headline. Needs only what the GPU image has (torch, triton,
transformers, click, pytest, nvidia-ml-py): run from the source tree, nothing is installed.
`--dry-run` runs the same steps on CPU at toy sizes, to prove the script works before a GPU is
spent on it. `--skip STEP` leaves a step out; `--budget SECONDS` fits the whole check into a
lease: each step's limit is cut to the time left, less what the report needs, and a step with no
time left is recorded as not run. The summary, gpu-check.json, is rewritten after every step, so a
check cut off from outside keeps what it did.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfid.tasks.local_shards import child_env
from kvfid.environment import envinfo

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    stdout_file: str | None = None   # keep the step's stdout as this file in the output folder


def plan(out: Path, dry_run: bool) -> list[Step]:
    """The steps, most wanted first (a budget cuts the last); dry-run swaps in toy sizes and the
    CPU smoke case."""
    py = sys.executable
    cli = [py, "-m", "kvfid.cli"]
    db = str(out / "ledger.sqlite")
    case = "cases/smoke.toml" if dry_run else "cases/gpu-qwen2.5-shape.toml"
    dry = ["--dry-run"] if dry_run else []
    # Dry run: one arch, one kernel, one dtype (the full plan takes minutes on 2 CPU cores).
    compile_args = (["--arch", "sm_90", "--dtypes", "bf16", "--kernels", "matmul"] if dry_run
                    else [])
    return [
        Step("compile", cli + ["compile", "--format", "json"] + compile_args, 180, "compile.json"),
        # kvfid against stock per bench shape with its bits check, the split decode against its
        # floor, the matmul's M buckets (kvfid.environment.speed_table): one JSON line a row.
        Step("speed", [py, "-m", "kvfid.environment.speed_table"] + dry, 90, "speed.json"),
        # Where a unit's time goes: one prefill and one decode step per bf16 stack of the case,
        # torch.profiler's top kernels, launches, copies to the host (kvfid.tasks.unit_profile).
        Step("profile", [py, "-m", "kvfid.tasks.unit_profile"] + dry, 75, "profile.txt"),
        # The default case complete (docs/cases.md sizes it from the H200's unit times); the dry
        # run takes one item of the smoke case.
        Step("fidelity", cli + ["run", case, "--db", db, "--quiet", "--run-id", DEFAULT_RUN]
             + (["--items", "1"] if dry_run else []), 270),
        # A timed slice of the seed paper's design (sdpa bf16/fp32) on SmolLM2's shape (the GPU
        # image has no GGUF package): its units' times in the ledger give the items per minute.
        # Dry run: the smoke case again (paper-shape.toml is a CUDA case).
        Step("paper", cli + ["run", "cases/smoke.toml" if dry_run else "cases/paper-shape.toml",
                             "--db", db, "--quiet", "--items", "1" if dry_run else "4"], 75),
        Step("kernels", cli + ["kernels", "--format", "json"]
             + (["--quick", "--dtypes", "fp32"] if dry_run else []), 90, "kernels.json"),
        # Dry run: one file's GPU tests (each skips on a CPU; collecting all of tests/ would cost
        # more than it checks). The limit leaves room for Triton's cold cache (docs/gpu.md).
        Step("gpu-tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                           "tests/gpu/test_kernel_gpu_buckets.py" if dry_run else "tests"], 180),
        *tp_steps(cli, dry_run),
        Step("report", cli + ["report", DEFAULT_RUN, "--db", db, "--out", str(out / "reports")], 20),
    ]


DEFAULT_RUN = "gpu-check-default"   # the default case's run id in the check's ledger (reported)


def tp_steps(cli: list[str], dry_run: bool) -> list[Step]:
    """Tensor parallel on two ranks of this machine (kvfid.stacks.tp: NCCL where each rank has a
    GPU of its own, else gloo, as on one GPU): the TP-invariant stack's live@tp2 against its TP=1
    rebuilds (bit-exact expected), and stock sdpa's (its difference shown, exit 1 expected)."""
    device, backend = ("cpu", "native") if dry_run else ("cuda", "triton")
    common = cli + ["repro", "--model", "tiny-llama", "--prompt", "What is 12 plus 30?",
                    "--device", device, "--tp", "2", "-B", "8", "-S", "8"]
    return [Step("tp", common + ["--backend", backend, "--batch-invariant", "--dtype", "bf16",
                                 "--constructions", "live,prefill,prefill@tp1,incremental@tp1,"
                                 "chunked:4,batched:2", "--expect", "bit-exact"], 120),
            Step("tp-stock", common + ["--backend", "sdpa", "--constructions", "live,prefill@tp1"],
                 60)]


REPORT_RESERVE_S = 20   # what a budget keeps back for the report, the last step


def step_limit(step: Step, seconds_left: float | None) -> int:
    """A step's limit under a budget: its own, cut to the time left (less the report's share,
    unless it is the report)."""
    if seconds_left is None:
        return step.timeout_s
    reserve = 0 if step.name == "report" else REPORT_RESERVE_S
    return max(0, min(step.timeout_s, int(seconds_left - reserve)))


def run_step(step: Step, out: Path, log, timeout_s: int) -> dict:
    """Run one step under its limit; its output goes to the log (and stdout to its file)."""
    if timeout_s <= 0:
        print(f"[gpu-check] {step.name:<10} not run: no time left in the budget", file=sys.stderr,
              flush=True)
        return {"step": step.name, "rc": None, "seconds": 0.0, "tail": ["not run: budget spent"]}
    start = time.perf_counter()
    log.write(f"\n===== {step.name} (limit {timeout_s} s): {' '.join(step.argv)}\n")
    log.flush()
    env = child_env()
    try:
        done = subprocess.run(step.argv, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        rc, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as err:
        rc, stdout, stderr = 124, _text(err.stdout), _text(err.stderr) + "\n[timed out]"
    log.write(stdout + "\n" + stderr[-20000:] + "\n")
    log.flush()
    if step.stdout_file:
        (out / step.stdout_file).write_text(stdout)
    seconds = time.perf_counter() - start
    print(f"[gpu-check] {step.name:<10} rc={rc} {seconds:6.1f} s", file=sys.stderr, flush=True)
    return {"step": step.name, "rc": rc, "seconds": round(seconds, 1),
            "tail": stdout.strip().splitlines()[-3:]}


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def compile_verdict(out: Path) -> dict | None:
    """The compile step's verdict from compile.json: how many configs, which failed and why."""
    try:
        report = json.loads((out / "compile.json").read_text())
    except (OSError, ValueError):
        return None
    return {"ok": report["ok"], "configs": len(report["configs"]),
            "failed": {r["name"]: r["problems"] for r in report["configs"] if r["problems"]}}


def flatten_reports(out: Path) -> None:
    """Copy the run report next to the other results (one level) and drop the nested folder
    (report.html is left out: `kvfid report latest --db ledger.sqlite` rebuilds it, and a
    device returns at most 8 files)."""
    for name in ("report.md",):
        found = sorted((out / "reports").rglob(name))
        if found:
            shutil.copy(found[-1], out / name)
    shutil.rmtree(out / "reports", ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"),
                        help="output folder (default: $OUT, else ./gpu-check-out)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, toy sizes: check that every step runs")
    names = [step.name for step in plan(Path("."), dry_run=False)]   # the plan only lists argv
    parser.add_argument("--skip", action="append", default=[], choices=names, metavar="STEP",
                        help=f"leave this step out (repeatable; one of {', '.join(names)})")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="the whole check's time: each step's limit is cut to what is left")
    args = parser.parse_args(argv)
    if args.budget is not None and args.budget <= REPORT_RESERVE_S:
        parser.error(f"--budget must exceed {REPORT_RESERVE_S} s (the report's share)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; use --dry-run to rehearse on CPU", file=sys.stderr)
        return 3
    started = time.perf_counter()
    results = []

    environment = envinfo.collect()

    def summary(finished: bool) -> dict:
        done = {"environment_key": envinfo.environment_key(environment),
                "dry_run": args.dry_run, "finished": finished, "skipped": args.skip,
                "compile": compile_verdict(out), "steps": results}
        (out / "gpu-check.json").write_text(json.dumps({**done, "environment": environment},
                                                       indent=1))
        return done

    with open(out / "log.txt", "w") as log:
        for step in plan(out, args.dry_run):
            if step.name in args.skip:
                continue
            left = None if args.budget is None else args.budget - (time.perf_counter() - started)
            results.append(run_step(step, out, log, step_limit(step, left)))
            if step.name == "compile" and results[-1]["rc"]:
                # Said at once, not after the other steps' minutes; they still run.
                print(f"[gpu-check] compile FAILED: {json.dumps(compile_verdict(out))}",
                      file=sys.stderr, flush=True)
            summary(finished=False)
    flatten_reports(out)
    print(json.dumps(summary(finished=True), indent=1))
    return 0 if all(r["rc"] in (0, 1) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
