"""Benchmark set-up: only under `--benchmark-only`, one torch thread, the environment recorded.

`pytest tests` (`make test`) collects this folder too; every benchmark here skips itself unless
pytest-benchmark runs with `--benchmark-only`, so the test budget is not spent on timing. The
environment record (harness.environment.envinfo) goes into pytest-benchmark's `machine_info`, so every saved
JSON result says what it was measured on; harness.reports.benchreport files results by its key.
"""

from __future__ import annotations

import os

import pytest
import torch

from harness.environment import envinfo
from harness.reports.benchreport import MACHINE_INFO_KEY

# Timing threads: one by default (on a shared 2-core machine two torch threads are 10-30x slower);
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
    """`--bench-part long`: only the benchmarks marked bench_long; `short`: all the others."""
    part = config.getoption("bench_part", default=None)
    if part is None:
        return
    keep = [i for i in items if (i.get_closest_marker("bench_long") is not None) == (part == "long")]
    dropped = [i for i in items if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(autouse=True)
def _only_when_benchmarking(request):
    if not benchmarking(request.config):
        pytest.skip("benchmarks run with `pytest tests/bench --benchmark-only`")


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
