"""Checks of user input that several commands share, made before any compute.

Devices, thread counts, item indices and counts, prompts, and transplant selections against a
model's layers and a boundary prefix's length. Each check returns a reason (a string naming the
allowed values) or None, so a case file and a command-line option can each say where the value
came from; `require` turns a reason into the error.
"""

from __future__ import annotations

import re

import torch

from kvfid.errors import BadInput, Unavailable

MAX_THREADS = 1024          # torch takes an int32; no machine here has more cores
MAX_ITEMS = 100_000         # item sets are generated or read whole: bound the work, never hang
DEVICES = "cpu, cuda, cuda:<index>"


def device_reason(device: str) -> str | None:
    """Why `device` is not a device kvfid runs on (None when it is one)."""
    if isinstance(device, str) and (device in ("cpu", "cuda")
                                    or re.fullmatch(r"cuda:\d{1,3}", device)):
        return None
    return f"allowed: {DEVICES}"


def threads_reason(threads) -> str | None:
    """Why `threads` is not a usable torch thread count (None when it is)."""
    ok = isinstance(threads, int) and not isinstance(threads, bool) and 1 <= threads <= MAX_THREADS
    return None if ok else f"allowed: an integer from 1 to {MAX_THREADS}"


def count_reason(n, what: str = "items") -> str | None:
    """Why `n` is not an item count (1..MAX_ITEMS)."""
    ok = isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_ITEMS
    return None if ok else f"allowed: 1 to {MAX_ITEMS} {what}"


def prompt_reason(prompt: str) -> str | None:
    """Why a prompt cannot be run: empty, or not encodable as UTF-8 (bytes that were not text)."""
    if not prompt or not prompt.strip():
        return "allowed: a non-empty text"
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"not valid UTF-8 (byte {err.object[err.start]!r} at {err.start}); allowed: text"
    return None


def selection_reason(selection, n_layers: int, prefix_length: int) -> str | None:
    """Why a transplant selection does not fit a model of `n_layers` layers and a boundary
    prefix of `prefix_length` tokens (ranges are half-open)."""
    if selection.layers is not None:
        lo, hi = selection.layers
        if not 0 <= lo < hi <= n_layers:
            return (f"layers {lo}-{hi} outside the model's {n_layers} layers; allowed: "
                    f"layers=A-B with 0 <= A < B <= {n_layers}")
    if isinstance(selection.positions, tuple):
        lo, hi = selection.positions
        if not 0 <= lo < hi <= prefix_length:
            return (f"positions {lo}-{hi} outside the boundary prefix of {prefix_length} tokens; "
                    f"allowed: positions=A-B with 0 <= A < B <= {prefix_length}")
    return None


def device_and_threads(device: str | None, threads: int | None) -> str:
    """Check `--device` and `--threads` of a command; the device (None: cuda when available)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    require(device_reason(device), "--device", device)
    if threads is not None:
        require(threads_reason(threads), "--threads", threads)
    check_cuda(device, "--device")
    return device


def require(reason: str | None, where: str, value, error=BadInput) -> None:
    """Raise `error` naming where the value came from, the value, and `reason`."""
    if reason is not None:
        raise error(f"{where} = {value!r} is not allowed; {reason}")


def check_cuda(device: str, where: str, error=Unavailable) -> None:
    """Exit 3 when a CUDA device is asked for and this machine has none (or not that index)."""
    if not device.startswith("cuda"):
        return

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= count:
        raise error(f"{where} = {device!r}: this machine has {count} CUDA device(s)")


MAX_BATCH = 64              # batched:N duplicates the item N times: bound the memory


MAX_TP = 64


def tp_reason(tp) -> str | None:
    """Why a tensor-parallel size is not allowed, or None."""
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
        return f"allowed: a TP size from 1 to {MAX_TP}"
    return None


# Why a construction cannot run here and how a list of them is split: each Construction says
# (kvfid.protocol.constructions: `reason`, `parse_constructions`).
