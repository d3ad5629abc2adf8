"""`kvfid compile`: the GPU path compiled and inspected on this machine, no GPU needed.

Triton compiles for a GPU without one (`triton.compile(ASTSource(...), target=GPUTarget(...))`),
and its wheel ships `ptxas` and `cuobjdump`. For every target of `compile_plan` this module
compiles the cubin (in worker processes: the compiler must not run under TRITON_INTERPRET, which
this package sets on machines without CUDA), reads its resource use (`cuobjdump -res-usage`:
registers, stack) and Triton's shared memory, counts the instruction mix of its SASS (tensor-core
MMAs, FFMA, atomics, local loads and stores), and judges it: a config fails when it does not
compile, spills, needs more shared memory than the arch has, contains an atomic (a reduction whose
order is left to the hardware), or has products meant for tensor cores without one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
import importlib

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvfid.environment.compile_plan import Target
from kvfid.environment.roofline import Work, roofline

ROOT = Path(__file__).resolve().parents[2]
# Maximum shared memory per block (CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability"): 163 KB on 8.0, 227 KB on 9.0 and 10.0.
SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024, "sm_100": 227 * 1024}
# Atomics on global memory: a reduction whose order the hardware picks. Shared-memory ATOMS are
# counted apart: on sm_100 Triton's tensor-memory allocator sets and clears bits of a shared mask
# with ATOMS.OR/AND (beside UTCATOMSWS), bookkeeping that orders no data.
ATOMICS = {"ATOM", "ATOMG", "RED", "REDG"}
_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", re.M)
_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def triton_tool(name: str) -> str:
    """A tool of Triton's NVIDIA backend (`cuobjdump`, `ptxas`), else one on PATH."""
    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(shipped) if shipped.exists() else (shutil.which(name) or name)


def instruction_mix(sass: str) -> dict:
    """Counts of the instructions that matter: tensor-core MMAs (HMMA, HGMMA, UTC*MMA, ...),
    FFMA, atomics, local loads/stores (spill traffic)."""
    ops = Counter(op for op in _SASS_OP.findall(sass))
    mma = {op: n for op, n in ops.items() if "MMA" in op}
    return {"mma": sum(mma.values()), "mma_ops": mma, "ffma": ops["FFMA"],
            "atomics": sum(ops[op] for op in ATOMICS), "shared_atomics": ops["ATOMS"], "ldl": ops["LDL"], "stl": ops["STL"],
            "instructions": sum(ops.values())}


def resource_usage(text: str) -> dict:
    """Registers and stack of the kernel function from `cuobjdump -res-usage`."""
    found = _RES_USAGE.search(text)
    if not found:
        raise ValueError(f"no resource usage in cuobjdump output: {text[:200]!r}")
    registers, stack, _, local = (int(x) for x in found.groups())
    return {"registers": registers, "stack": stack, "local": local}


def _compile_one(target: dict, out_dir: Path) -> dict:
    """Compile one target (in a worker) and read its cubin."""
    module, name = target["function"].split(":")
    fn = getattr(importlib.import_module(module), name)
    signature, constexprs, attrs = {}, dict(target["constexprs"]), {}
    for index, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        value = target["args"][arg]
        if isinstance(value, str):  # a tensor: "*bf16"
            signature[arg], attrs[(index,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[arg] = "fp32"
        elif value == 1:  # Triton specializes an integer 1 into a constant
            signature[arg], constexprs[arg] = "constexpr", 1
        else:
            signature[arg] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    capability = int(target["arch"].removeprefix("sm_"))
    start = time.perf_counter()
    try:
        # Constexprs keyed by argument position: the form every Triton 3.x ASTSource takes.
        by_index = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
        compiled = triton.compile(ASTSource(fn, signature, by_index, attrs),
                                  target=GPUTarget("cuda", capability, 32),
                                  options=target["options"])
    except Exception as err:  # noqa: BLE001 (a compiler error of any kind is the finding)
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        return {"error": f"{type(err).__name__}: {(lines or [''])[-1][:300]}",
                "compile_s": round(time.perf_counter() - start, 2)}
    seconds = time.perf_counter() - start
    cubin = out_dir / f"{target['name']}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    cuobjdump = triton_tool("cuobjdump")
    res = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return {**resource_usage(res), "shared": compiled.metadata.shared, **instruction_mix(sass),
            "compile_s": round(seconds, 2)}


def _worker(request_path: str) -> None:
    """Compile the targets of a JSON request file; append one JSON record per target to the
    request's `records` file as each finishes."""
    request = json.loads(Path(request_path).read_text())
    out_dir = Path(request["out_dir"])
    with open(request["records"], "a") as records:
        for target in request["targets"]:
            records.write(json.dumps({"name": target["name"], **_compile_one(target, out_dir)})
                          + "\n")
            records.flush()


def _run_workers(targets: list[Target], out_dir: Path, scratch: Path, jobs: int,
                 python_path: list[str]) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([*python_path, os.environ.get("PYTHONPATH", "")])}
    # Round-robin over the workers; the plan interleaves cheap and expensive kernels. Requests,
    # records and logs are files, so no worker ever waits on a pipe.
    workers = []
    for index in range(jobs):
        share = targets[index::jobs]
        if not share:
            continue
        request = scratch / f"request-{index}.json"
        request.write_text(json.dumps({"out_dir": str(out_dir),
                                       "records": str(scratch / f"records-{index}.jsonl"),
                                       "targets": [{**asdict(t), "name": t.name} for t in share]}))
        log = open(scratch / f"worker-{index}.log", "w")
        workers.append((subprocess.Popen([sys.executable, "-m", "kvfid.environment.compile", "--worker",
                                          str(request)], env=env, stdout=log,
                                         stderr=subprocess.STDOUT), log, index))
    records = {}
    for proc, log, index in workers:
        proc.wait()
        log.close()
        path = scratch / f"records-{index}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            records[record.pop("name")] = record
        if proc.returncode:
            tail = (scratch / f"worker-{index}.log").read_text().strip().splitlines()[-1:]
            records.setdefault("__worker__", {"error": tail})
    return records


def problems(target: Target, record: dict) -> list[str]:
    """Why a compiled config fails the GPU path's rules (empty: it passes)."""
    if "error" in record:
        return [f"compile failed: {record['error']}"]
    found = []
    if record["stack"] or record["stl"] or record["ldl"]:
        found.append(f"spills: {record['stack']} B stack, {record['stl']} STL / "
                     f"{record['ldl']} LDL")
    if record["shared"] > SHARED_LIMIT[target.arch]:
        found.append(f"shared memory {record['shared']} B > {SHARED_LIMIT[target.arch]} B")
    if record["atomics"]:
        found.append(f"{record['atomics']} atomic instructions (nondeterministic reduction)")
    if target.tensor_cores and not record["mma"]:
        found.append("no tensor cores")
    return found


def compile_targets(targets: list[Target], out: str | Path | None = None, jobs: int | None = None,
                    python_path: tuple[str, ...] = ()) -> dict:
    """Compile and judge every target; `out` keeps the cubins. Returns the report (JSON-able)."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(targets) or 1))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvfid-compile-") as scratch:
        out_dir = Path(out) if out else Path(scratch)
        out_dir.mkdir(parents=True, exist_ok=True)
        records = _run_workers(targets, out_dir, Path(scratch), jobs, list(python_path))
    rows = []
    for target in targets:
        record = records.get(target.name) or {
            "error": f"worker died: {records.get('__worker__', {}).get('error')}"}
        rows.append({"name": target.name, "kernel": target.kernel, "arch": target.arch,
                     "dtype": target.dtype, "config": target.config,
                     "num_warps": target.options.get("num_warps"),
                     "num_stages": target.options.get("num_stages"),
                     "tensor_cores_expected": target.tensor_cores, **record,
                     "problems": problems(target, record),
                     "roofline": roofline(tuple(Work(**asdict(w)) for w in target.work),
                                          target.arch, target.tensor_cores)})
    return {"ok": all(not r["problems"] for r in rows), "triton": triton.__version__,
            "cuobjdump": triton_tool("cuobjdump"), "jobs": jobs,
            "seconds": round(time.perf_counter() - start, 1), "configs": rows}


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2])
