"""The `+compile` stack option: the model's forward under `torch.compile` (inductor).

Compiled kernels specialise on shapes and fuse ops into code inductor writes itself (C++ on CPU,
Triton on CUDA), so a stack that is invariant eagerly need not be invariant compiled: that is what
the option measures. The forward is compiled with dynamic shapes, so one graph serves every
sequence length (a length of 1 is specialised by torch, so a decode step gets its own graph); the
protocol's untimed warm-up (a prompt forward and one decode step) pays those compiles, which keeps
compile time apart from the arms' time. A later new shape (a batch of 2) may still compile inside
an arm. Dynamo's caches are reset on entry and on exit, so no graph traced under one stack (its
batch-invariant overrides, its attention) is ever reused by another.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator

import torch

from harness.errors import Unavailable


def unavailable_reason(backend: str, device: str) -> str | None:
    """Why inductor cannot compile this stack's forward here, or None."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        return ("the Triton kernel runs in Triton's interpreter here, which torch.compile cannot "
                "trace; +compile with --backend triton needs CUDA")
    if not device.startswith("cuda"):
        compiler = os.environ.get("CXX") or "c++"
        if shutil.which(compiler) is None and shutil.which("g++") is None:
            return f"inductor on CPU writes C++ and needs a C++ compiler ({compiler} or g++ on PATH)"
    return None


@contextlib.contextmanager
def compiled_forward(module: torch.nn.Module, label: str) -> Iterator[None]:
    """`module.forward` compiled (dynamic shapes) inside the block; the eager forward and empty
    dynamo caches after it."""
    reason = unavailable_reason(label.split("/")[0], str(next(module.parameters()).device))
    if reason:
        raise Unavailable(f"stack {label}: {reason}")
    torch._dynamo.reset()
    module.forward = torch.compile(module.forward, dynamic=True)   # an instance attribute
    try:
        yield
    finally:
        del module.forward                                         # the class's forward again
        torch._dynamo.reset()
