"""kvfid's Triton kernels (`kvfid.kernels`), each beside its plain-PyTorch reference.

Without CUDA the kernels run in the Triton interpreter; `kvfid/__init__` selects it before triton
loads. The helpers here say where the kernels run and which product they use there.
"""

import os
import sys

if __name__ == "kernels":
    # This folder imported by its folder's name: a checkout's root is on sys.path (`python -m` or
    # `python -c` run there). The import name `kernels` belongs to the Hugging Face distribution,
    # which transformers 5.25 imports: where it is installed, hand the name over to it. Where it
    # is not, this folder imports as before, with no `__version__`: a transformers that probes
    # the name (before 5.25: find it, then import it for a version) reports hub kernels absent.
    import importlib.machinery
    import importlib.util

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout])
    if _spec is not None:
        sys.modules["kernels"] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules["kernels"])

import torch  # noqa: E402


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (NumPy on the CPU) in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can take tensors on `device` (CPU tensors need the interpreter)."""
    return device.type == "cuda" or interpreting()


def uses_tl_dot(device: torch.device) -> bool:
    """Products by `tl.dot` on a real GPU; by broadcast multiply and `tl.sum` in the interpreter,
    whose `tl.dot` is a NumPy BLAS call that can give a row bits depending on its place in the
    tile (docs/hazards.md)."""
    return device.type == "cuda" and not interpreting()


def gpu_arch(device: torch.device) -> str:
    """The kernel config family of a CUDA device: `sm_90` (Hopper), `sm_100` (Blackwell data
    centre), else `sm_80` (Ampere-class MMA: A100, Ada, consumer Blackwell)."""
    major, _ = torch.cuda.get_device_capability(device)
    return {9: "sm_90", 10: "sm_100"}.get(major, "sm_80")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}   # by kvfid's names

# Code-generation options that change result bits, fixed at every launch rather than left to
# Triton's defaults: FMA contraction (`enable_fp_fusion`) defaults to on up to triton 3.9 and to off
# from 3.10, so an unpinned kernel would change its bits with a Triton upgrade. Off matches the
# interpreter (NumPy never contracts) and the 3.10 default. The environment record stores these.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


class KernelRefusal(ValueError):
    """A call one of our kernels cannot serve (a mechanism, mask or bias it does not apply),
    found during the forward: the harness reports it as a refusal (exit 3), not a crash."""


def check_row_input(name: str, x: torch.Tensor) -> None:
    """Refuse a tensor the row kernels (norm, softmax) cannot take, with a clear message."""
    if not triton_runs_on(x.device):
        raise ValueError(f"{name}: tensors on {x.device} need CUDA or the Triton interpreter "
                         "(TRITON_INTERPRET=1 set before triton is imported)")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} supports {FLOAT_DTYPES}; got {x.dtype}")
