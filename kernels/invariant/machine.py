"""What the tiled batch-invariant mode keeps per machine: the key a machine's findings are kept
under, the folder they are kept in, and the store files' lock and atomic writes.

A route (kvfid.kernels.invariant.route) and a whole-call span (kvfid.kernels.invariant.whole)
change a `+bi` stack's bits and cost time to find, so each is found once per machine and read
back by every later process there. "The machine" is what a kernel's choices depend on: the CPU
model, the capability torch dispatches to, the ISA variables oneDNN, ATen and MKL read, the torch
version and the thread count, and the version of the rule that made the finding.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from pathlib import Path
import fcntl

import torch

ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
           "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "MKL_CBWR")


def machine_key(rule: str, threads: int | None = None) -> str:
    """CPU model, torch's dispatch capability, torch version, thread count, the ISA variables
    set, and `rule` (the finding's rule and version), joined by `|`."""
    threads = torch.get_num_threads() if threads is None else threads
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), model)
    isa = ",".join(f"{name}={os.environ[name]}" for name in ISA_ENV if os.environ.get(name))
    return "|".join([model, torch.backends.cpu.get_cpu_capability(), f"torch {torch.__version__}",
                     f"threads {threads}", isa or "isa default", rule])


def cache_dir() -> Path:
    """`$KVFID_CACHE`, default `~/.cache/kvfid`."""
    return Path(os.environ.get("KVFID_CACHE") or Path.home() / ".cache" / "kvfid")


def read_json(path: Path) -> dict:
    """A kept store; {} where there is none or it is unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: Path, store: dict) -> None:
    """A store written whole, atomically (a sibling file renamed over it)."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def locked(path: Path):
    """One process at a time finds and writes what `path` keeps (the others then read it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
