"""The environment record: what hardware and software stack a measurement was taken on.

This module owns `collect()`, which reads every visible GPU through NVML (nvidia-ml-py), the CUDA
runtime and cuDNN that torch was built with, library and Python versions, the CPU and what decides
its numerics (kvfid.environment.cpu), the numerics-changing environment variables, the Triton launch options
every kernel is compiled with, and the project's git revision; `environment_key()`, which names the folder that groups comparable runs;
and `describe()`, the human text behind `kvfid env`. Each NVML field the device does not support
is None, and a machine without NVML (no library or no driver) is a normal environment with
`gpus: []`, not an error. The record is plain JSON-serializable data.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

import numpy
import torch

from kvfid.environment.cpu import collect_cpu, numerics_env
from kvfid.kernels import LAUNCH_OPTIONS
from kvfid.kernels.invariant import route as mode_route, whole
from kvfid.kernels.invariant.route import Route

_GPU_FIELDS = (
    "name", "uuid", "compute_capability", "driver_version", "cuda_driver_version",
    "sm_clock_mhz", "sm_clock_max_mhz", "memory_clock_mhz", "memory_clock_max_mhz",
    "power_limit_w", "temperature_c", "ecc_mode", "mig_mode", "persistence_mode",
    "pcie_gen", "pcie_width", "pcie_gen_max", "pcie_width_max",
)


def collect(nvml=None) -> dict:
    """Collect the environment record; nvml is a pynvml-like module (default: import pynvml)."""
    gpus, nvml_error = _collect_gpus(nvml)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "gpus": gpus,
        "nvml_error": nvml_error,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": torch.cuda.is_available(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda_runtime": torch.version.cuda,
            "cudnn": cudnn,  # an integer as cuDNN reports it, e.g. 90100 for 9.1.0
            "triton": _triton_version(),
            "transformers": _distribution_version("transformers"),
            "numpy": numpy.__version__,
        },
        "cpu": collect_cpu(),
        "numerics_env": numerics_env(),
        "triton_launch_options": dict(LAUNCH_OPTIONS),
        # The tiled batch-invariant mode's routes kept for this machine (kvfid.kernels.invariant.route): a
        # route changes a +bi stack's bits, and is timed once per machine, so it is recorded.
        "tiled_routes": {name: r["route"] for name, r in mode_route.kept().items()},
        "platform": platform.platform(),
        "git": _git_revision(),
    }


def machine_record() -> dict:
    """`kvfid env`'s record: `collect()` and, where a whole-call route serves one stock call per
    product (kvfid.kernels.invariant.whole), every product shape's span kept for this machine
    (they decide a `+bi` stack's bits; a run's record holds those its processes used)."""
    return {**collect(), "whole_calls": whole.kept()}


# --- GPUs through NVML -------------------------------------------------------------------------

def _collect_gpus(nvml) -> tuple[list[dict], str | None]:
    """(one record per visible GPU, None) or ([], why NVML is unavailable)."""
    if nvml is None:
        try:
            import pynvml as nvml   # lazy: guarded: absent where the except below applies
        except ImportError as e:
            return [], f"nvidia-ml-py not importable: {e}"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return [], f"NVML unavailable: {e}"
    try:
        driver = _text(_query(nvml, "nvmlSystemGetDriverVersion"))
        cuda_driver = _cuda_version(_query(nvml, "nvmlSystemGetCudaDriverVersion"))
        count = _query(nvml, "nvmlDeviceGetCount")
        if count is None:
            return [], "NVML could not count devices"
        devices = []
        for index in range(count):
            handle = _query(nvml, "nvmlDeviceGetHandleByIndex", index)
            record = {"index": index, **dict.fromkeys(_GPU_FIELDS)}
            if handle is not None:
                record.update(_gpu_fields(nvml, handle))
            record.update(driver_version=driver, cuda_driver_version=cuda_driver)
            devices.append(record)
        return _visible(devices, os.environ.get("CUDA_VISIBLE_DEVICES")), None
    finally:
        _query(nvml, "nvmlShutdown")


def _gpu_fields(nvml, handle) -> dict:
    sm, mem = getattr(nvml, "NVML_CLOCK_SM", 1), getattr(nvml, "NVML_CLOCK_MEM", 2)
    capability = _query(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
    power_mw = _query(nvml, "nvmlDeviceGetEnforcedPowerLimit", handle)
    return {
        "name": _text(_query(nvml, "nvmlDeviceGetName", handle)),
        "uuid": _text(_query(nvml, "nvmlDeviceGetUUID", handle)),
        "compute_capability": None if capability is None else f"{capability[0]}.{capability[1]}",
        "sm_clock_mhz": _query(nvml, "nvmlDeviceGetClockInfo", handle, sm),
        "sm_clock_max_mhz": _query(nvml, "nvmlDeviceGetMaxClockInfo", handle, sm),
        "memory_clock_mhz": _query(nvml, "nvmlDeviceGetClockInfo", handle, mem),
        "memory_clock_max_mhz": _query(nvml, "nvmlDeviceGetMaxClockInfo", handle, mem),
        "power_limit_w": None if power_mw is None else power_mw / 1000,
        "temperature_c": _query(nvml, "nvmlDeviceGetTemperature", handle,
                                getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
        # ECC and MIG report [current, pending]; the current mode is what the run saw.
        "ecc_mode": _current_flag(_query(nvml, "nvmlDeviceGetEccMode", handle)),
        "mig_mode": _current_flag(_query(nvml, "nvmlDeviceGetMigMode", handle)),
        "persistence_mode": _flag(_query(nvml, "nvmlDeviceGetPersistenceMode", handle)),
        # The current PCIe generation drops at idle to save power, so the maximum is kept too.
        "pcie_gen": _query(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle),
        "pcie_width": _query(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle),
        "pcie_gen_max": _query(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle),
        "pcie_width_max": _query(nvml, "nvmlDeviceGetMaxPcieLinkWidth", handle),
    }


def _query(nvml, function: str, *args):
    """nvml.<function>(*args), or None when NVML lacks it or refuses (NotSupported and the like)."""
    fn = getattr(nvml, function, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _visible(devices: list[dict], env: str | None) -> list[dict]:
    """The devices CUDA_VISIBLE_DEVICES exposes, in its order (all when it is unset).

    Integer entries are taken as NVML indices (PCI bus order, which is CUDA's order on machines
    with one GPU model). Like CUDA, the list ends at the first entry that names no device; a MIG
    entry cannot be mapped to its parent here, so then every device is kept.
    """
    if env is None:
        return devices
    picked = []
    for token in (t.strip() for t in env.split(",")):
        if token.startswith("MIG-"):
            return devices
        match = [d for d in devices if token == str(d["index"])
                 or (token.startswith("GPU-") and (d["uuid"] or "").startswith(token))]
        if len(match) != 1:
            break
        if match[0] not in picked:
            picked.append(match[0])
    return picked


def _text(value) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _flag(value) -> bool | None:
    return None if value is None else bool(value)


def _current_flag(pair) -> bool | None:
    return None if pair is None else bool(pair[0])


def _cuda_version(value: int | None) -> str | None:
    """NVML's integer CUDA version (e.g. 12080) as `12.8`."""
    return None if value is None else f"{value // 1000}.{value % 1000 // 10}"


# --- software, CPU, git ------------------------------------------------------------------------

def _triton_version() -> str | None:
    try:
        import triton  # imported here: optional on some hosts, and slow to import
    except Exception:  # a broken install raises more than ImportError; the record says None
        return None
    return getattr(triton, "__version__", None)


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_MEASUREMENT_PATHS = ("harness", "kernels", "cases", "setup.py")


def _git_revision() -> dict | None:
    """{"revision", "dirty"} of the checkout holding this file; None when it is not in one.

    `dirty`: the code or cases that define a measurement differ from HEAD, new files included
    (changes elsewhere, such as rendered reports or tests, do not count).
    """
    here = Path(__file__).resolve()
    try:
        top = _git(here.parent, "rev-parse", "--show-toplevel")
        revision = _git(here.parent, "rev-parse", "HEAD")
        # An installed copy under some other repository (a venv inside a checkout) is not ours.
        if top is None or revision is None or not here.is_relative_to(Path(top).resolve()) \
                or here.relative_to(Path(top).resolve()).parts[0] != "harness":
            return None
        status = _git(Path(top), "status", "--porcelain", "--", *_MEASUREMENT_PATHS)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"revision": revision, "dirty": None if status is None else bool(status)}


def _git(cwd: Path, *args: str) -> str | None:
    result = subprocess.run(["git", "-C", str(cwd), *args],
                            capture_output=True, text=True, timeout=30)
    return result.stdout.strip() if result.returncode == 0 else None


# --- key and text ------------------------------------------------------------------------------

def environment_key(record: dict) -> str:
    """`<gpu name or cpu-model-capability>/<driver>/<cuda>/<torch>/<triton>`, each part a safe
    folder name. A CPU key carries the capability torch dispatches to (e.g. `avx2`, `avx512`),
    since CPUs of one model name can compute different bits."""
    versions = record.get("versions", {})
    if record.get("gpus"):
        gpu = record["gpus"][0]
        device, driver = gpu.get("name"), gpu.get("driver_version")
    else:
        cpu = record.get("cpu") or {}
        parts = ["cpu", cpu.get("model"), (cpu.get("capability") or "").lower() or None]
        device, driver = "-".join(p for p in parts if p), None
    parts = (device, driver,
             versions.get("cuda_runtime"), versions.get("torch"), versions.get("triton"))
    return "/".join(_folder_name(p) for p in parts)


def _folder_name(part) -> str:
    """One key part: trademarks dropped, anything but letters, digits and `._+-` made `-`."""
    if part is None:
        return "none"
    text = re.sub(r"\((?:R|TM)\)", "", str(part), flags=re.IGNORECASE)
    text = re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-.")
    return text or "none"


def describe(record: dict) -> str:
    """A short multi-line text of the record, for `kvfid env`."""
    lines = []
    for gpu in record.get("gpus", []):
        lines += [
            f"GPU {gpu['index']}: {_show(gpu['name'])} ({_show(gpu['uuid'])}), "
            f"compute {_show(gpu['compute_capability'])}, driver {_show(gpu['driver_version'])}, "
            f"CUDA driver {_show(gpu['cuda_driver_version'])}",
            f"  clocks SM {_show(gpu['sm_clock_mhz'])}/{_show(gpu['sm_clock_max_mhz'])} MHz, "
            f"memory {_show(gpu['memory_clock_mhz'])}/{_show(gpu['memory_clock_max_mhz'])} MHz, "
            f"power limit {_show(gpu['power_limit_w'], ' W')}, {_show(gpu['temperature_c'], ' C')}",
            f"  ECC {_on_off(gpu['ecc_mode'])}, MIG {_on_off(gpu['mig_mode'])}, "
            f"persistence {_on_off(gpu['persistence_mode'])}, PCIe gen {_show(gpu['pcie_gen'])} "
            f"x{_show(gpu['pcie_width'])} "
            f"(max gen {_show(gpu['pcie_gen_max'])} x{_show(gpu['pcie_width_max'])})",
        ]
    if not record.get("gpus"):
        lines.append(f"GPU: none ({record.get('nvml_error') or 'no visible device'})")
    v, cpu, git = record.get("versions", {}), record.get("cpu", {}), record.get("git")
    lines += [
        f"CUDA runtime {_show(v.get('cuda_runtime'))}, cuDNN {_show(v.get('cudnn'))}, "
        f"CUDA available to torch: {_show(record.get('cuda_available'))}",
        f"torch {_show(v.get('torch'))}, triton {_show(v.get('triton'))}, "
        f"transformers {_show(v.get('transformers'))}, numpy {_show(v.get('numpy'))}, "
        f"Python {_show(v.get('python'))}",
        f"CPU {_show(cpu.get('model'))}: {_show(cpu.get('cpu_count'))} logical CPUs, "
        f"torch threads {_show(cpu.get('torch_threads'))}, capability {_show(cpu.get('capability'))}, "
        f"BLAS {_show(cpu.get('blas'))} {_show(cpu.get('mkl'))}, oneDNN {_show(cpu.get('onednn'))}",
        "CPU flags " + _flags(cpu.get("flags")),
        "numerics env " + (", ".join(f"{k}={v}" for k, v in (record.get("numerics_env") or {}).items()
                                     if v is not None) or "none set"),
        f"Triton launch options {_show(record.get('triton_launch_options'))}",
        "tiled mode routes " + (", ".join(f"{k} {Route(**r).text()}"
                                          for k, r in sorted((record.get("tiled_routes") or {}).items()))
                                or "none kept for this machine yet"),
        *whole_lines(record.get("whole_calls") or {}),
        "git " + ("none (not a git checkout)" if git is None else
                  f"{git['revision']}{' (dirty)' if git['dirty'] else ''}"),
        f"key {environment_key(record)}",
    ]
    return "\n".join(lines)


SHOWN = 12   # whole-call spans that do not take one call, listed by name (the rest counted)


def whole_lines(spans: dict[str, dict]) -> list[str]:
    """The whole-call spans kept for this machine (kvfid.kernels.invariant.whole) in words: how
    many product shapes take one call, from which floor, and each that does not or stops early."""
    if not spans:
        return ["whole calls: none kept for this machine yet"]
    one = [s for s in spans.values() if s.get("floor") is not None]
    floors = sorted({s["floor"] for s in one})
    bands = sum(1 for s in one if s.get("tile"))
    lines = [f"whole calls: {len(one)} of {len(spans)} product shapes take one call"
             + (f" (floors {', '.join(map(str, floors))})" if floors else "")
             + (f", {bands} of them up to a band's last count and in its tiles above" if bands else "")]
    short = [f"  {call}: {s.get('why')}" for call, s in sorted(spans.items())
             if s.get("floor") is None or s.get("ceiling", 0) < s.get("probed", 0)]
    return lines + short[:SHOWN] + ([f"  ... and {len(short) - SHOWN} more"] if len(short) > SHOWN else [])


def _flags(flags: dict | None) -> str:
    if not flags:
        return "n/a"
    return " ".join(name for name, present in flags.items() if present) or "none of " + ", ".join(flags)


def _show(value, unit: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _on_off(value: bool | None) -> str:
    return "n/a" if value is None else "on" if value else "off"
