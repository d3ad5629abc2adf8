"""What decides CPU numerics: the processor, the code path torch dispatches to, BLAS, settings.

Stock CPU results differ between machines: a stock bf16 mm batch-variant on an Intel Xeon (AMX)
was invariant on an AMD EPYC (AVX-512). What decides it is the vector capability torch dispatches
to (`torch.backends.cpu.get_cpu_capability()`), the instruction-set flags BLAS and oneDNN pick
kernels by (AMX, AVX512-BF16, AVX512-FP16), the BLAS and oneDNN versions, the thread count, and
environment variables that change any of these. `collect_cpu()` reads them all; `numerics_env()`
reads the variables. Every field is None where it cannot be read.
"""

from __future__ import annotations

import os
import platform
import re

import torch

# CPU flags (as /proc/cpuinfo spells them) that select different BLAS / oneDNN kernels.
NUMERIC_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                 "amx_tile", "amx_bf16", "amx_fp16")

# Environment variables that change which kernels run, with how many threads, or their bits.
NUMERICS_ENV = (
    "TRITON_INTERPRET", "KVFID_BI_IMPL", "KVFID_TILED_ROUTE", "TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE",
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "ATEN_CPU_CAPABILITY",
    "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUDA_VISIBLE_DEVICES",
)


def collect_cpu() -> dict:
    """The CPU part of the environment record."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "model": info.get("model name") or platform.processor() or platform.machine() or None,
        "vendor": info.get("vendor_id"),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "capability": _capability(),
        "flags": {flag: flag in flags for flag in NUMERIC_FLAGS} if flags else None,
        "blas": _config_value(r"BLAS_INFO=([^,\s]+)"),
        "mkl": _config_value(r"Math Kernel Library Version ([^\s]+)"),
        "onednn": _config_value(r"MKL-DNN v([^\s]+)"),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def numerics_env() -> dict:
    """The numerics-changing environment variables, each its value or None when unset."""
    return {name: os.environ.get(name) for name in NUMERICS_ENV}


def _capability() -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def _config_value(pattern: str) -> str | None:
    match = re.search(pattern, torch.__config__.show())
    return match[1] if match else None


def _cpuinfo() -> dict:
    """The first processor's `key: value` lines of /proc/cpuinfo ({} where there is none)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out
