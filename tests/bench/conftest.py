"""Benchmark set-up: only under `--benchmark-only`, one torch thread, the environment recorded.

`pytest tests` (`make test`) collects this folder too; every benchmark here is skipped at
collection unless pytest-benchmark runs with `--benchmark-only`, so the test budget is not spent
on timing. The environment record (kvfid.environment.envinfo) goes into pytest-benchmark's
`machine_info`, so every saved JSON result says what it was measured on;
kvfid.reports.benchreport files results by its key.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvfid.environment import envinfo
from kvfid.reports.benchreport import MACHINE_INFO_KEY

HERE = Path(__file__).resolve().parent
# Timing threads: one by default (on a shared 2-core machine two torch threads run many times
# slower: docs/hazards.md, "Threads on a shared CPU");
# KVFID_BENCH_THREADS=N measures with N.
BENCH_THREADS = int(os.environ.get("KVFID_BENCH_THREADS", "1"))


def benchmarking(config) -> bool:
    return bool(config.getoption("benchmark_only", default=False))


def pytest_benchmark_update_machine_info(config, machine_info):
    record = envinfo.collect()
    record["cpu"]["torch_threads"] = BENCH_THREADS  # what the benchmarks ran with (see below)
    machine_info[MACHINE_INFO_KEY] = {"environment": record,
                                      "environment_key": envinfo.environment_key(record),
                                      "bench_threads": BENCH_THREADS}


def pytest_collection_modifyitems(config, items):
    """Without `--benchmark-only` every benchmark here is skipped at collection, before any of its
    fixtures is set up (a module fixture such as the model bench's SmolLM2 would be loaded before
    a function-scoped skip, at the suite's cost). `--bench-part long`: only the benchmarks marked
    bench_long; `short`: all the others."""
    if not benchmarking(config):
        skip = pytest.mark.skip(reason="benchmarks run with `pytest tests/bench --benchmark-only`")
        for item in items:
            if Path(str(item.fspath)).parent == HERE:
                item.add_marker(skip)
        return
    part = config.getoption("bench_part", default=None)
    if part is None:
        return
    keep = [i for i in items if (i.get_closest_marker("bench_long") is not None) == (part == "long")]
    dropped = [i for i in items if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session", autouse=True)
def _bench_threads(request):
    """Set the torch thread count for the timed session and restore it afterwards."""
    if not benchmarking(request.config):
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(BENCH_THREADS)
    yield
    torch.set_num_threads(previous)
