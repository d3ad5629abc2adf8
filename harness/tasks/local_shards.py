"""`kvfid run --jobs N` (and `kvfid bench` on a CPU): one case over N processes of this machine.

The items are split as `--shard I/N` splits them (every N-th item). This process opens the ledger
and creates the run first, so the N-1 others (`python -m kvfid.cli run CASE --run-id RUN --shard
I/N --quiet`, started here) only join it; it measures shard 0 with the progress bar, waits for the
others, then closes the run once. Each process runs its stacks on their own `threads`, so N
processes of one-thread stacks use N cores without competing. A process that fails leaves its
units unmeasured and the run `partial`: the error names it and the `--resume` that finishes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from kvfid.errors import Unavailable
from kvfid.runs import matrix, shards



class ShardFailed(Unavailable):
    """A shard process of a `--jobs` run exited with an error (exit 3)."""


def default_jobs(case, cuda: bool) -> int:
    """Processes for a case on this machine: one per group of cores its most-threaded stack
    needs (CPU stacks only; a CUDA machine has one device to share), at most one per item."""
    if cuda or any(not stack.device.startswith("cpu") for stack in case.stacks):
        return 1
    threads = max(stack.threads or 1 for stack in case.stacks)
    return max(1, min((os.cpu_count() or 1) // threads, case.items.n))


def child_env() -> dict[str, str]:
    """The environment of a kvfid child process (a shard, the bench suite, a GPU-check step):
    this one without pytest-xdist's worker variables, which would make pytest-benchmark believe
    it runs under xdist and disable itself (when kvfid is itself called from a parallel test
    session). The child imports kvfid as this process does (installed, or on PYTHONPATH)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}


def shard_command(case, db: Path, run_id: str, index: int, jobs: int) -> list[str]:
    """The `kvfid run` of shard `index`/`jobs` joining `run_id`."""
    return [sys.executable, "-m", "kvfid.cli", "run", str(Path(case.source).resolve()),
            "--db", str(Path(db).resolve()), "--run-id", run_id, "--shard", f"{index}/{jobs}",
            "--items", str(case.items.n), "--quiet"]


def measure(prepared, ledger, jobs: int, progress: bool = True):
    """Measure every unit of the prepared case over `jobs` processes into `ledger`; the closed
    run's RunResult (counts over all shards)."""
    jobs = min(jobs, prepared.case.items.n)      # a process with no item would only start up
    if jobs <= 1:
        return matrix.measure(prepared, ledger, shards.Shard(), progress)
    run = matrix.start_run(prepared, ledger)   # the file and the run exist before a shard starts
    planned = {(u.item_index, u.stack) for u in matrix.plan_units(prepared.case)}
    stored_before = len(ledger.stored_units(run.id) & planned)
    if progress:
        print(f"kvfid run {run.id}: {jobs} processes (--shard I/{jobs}); the bar is shard 0's",
              file=sys.stderr)
    env = child_env()
    children = []
    try:
        for index in range(1, jobs):
            log = tempfile.TemporaryFile(mode="w+")
            children.append((index, log, subprocess.Popen(
                shard_command(prepared.case, ledger.path, run.id, index, jobs),
                env=env, stdout=subprocess.DEVNULL, stderr=log)))
        matrix.measure(replace(prepared, existing=run), ledger, shards.Shard(0, jobs), progress)
    except BaseException:
        for _, _, child in children:
            child.terminate()
        raise
    finally:
        failed = [(index, child.wait(), _tail(log)) for index, log, child in children]
    failed = [f for f in failed if f[1] != 0]
    status = ledger.finish(run.id)
    if failed:
        index, code, tail = failed[0]
        raise ShardFailed(f"shard {index}/{jobs} of run {run.id} exited with {code}: {tail}; "
                          f"the run is {status}: `kvfid run {prepared.case.source} --resume "
                          f"{run.id}` measures what is missing")
    stored = ledger.stored_units(run.id) & planned
    return matrix.RunResult(run.id, status, len(stored) - stored_before, stored_before,
                            len(planned))


def _tail(log) -> str:
    log.seek(0)
    lines = [line.strip() for line in log.read().splitlines() if line.strip()]
    log.close()
    return lines[-1] if lines else "no output"
