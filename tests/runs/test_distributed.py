"""torchrun: two CPU ranks share the smoke case and land in one run equal to a single process."""

import os
import subprocess
import sys
from pathlib import Path

from kvfid.ledger.store import Ledger

ROOT = Path(__file__).resolve().parents[2]


def test_two_torchrun_ranks_equal_a_single_process(tmp_path, smoke_run):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "kvfid.cli", "run", "cases/smoke.toml",
                "--db", str(tmp_path / "ranks.sqlite"), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(torchrun, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    one, single_id = smoke_run      # the same case in a single process (tests/conftest.py)
    with Ledger(tmp_path / "ranks.sqlite") as ledger:
        (run, count), = ledger.runs()
        assert run.status == "finished" and count == len(single_units(one, single_id))
        ranked = ledger.stored_fingerprints(run.id)
    with Ledger(one, readonly=True) as ledger:
        alone = ledger.stored_fingerprints(single_id)
    assert set(ranked) == set(alone)
    for unit, prints in alone.items():
        assert ranked[unit] == prints, unit


def single_units(db, run_id):
    with Ledger(db, readonly=True) as ledger:
        return ledger.units(run_id)
