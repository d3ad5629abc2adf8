"""The ranks of a tensor-parallel stack: this process's place among them, and ranks started on
this machine.

`on_ranks(n, fn, *args)` runs fn on n processes forked from a forkserver that imported torch,
transformers and kvfid once (a fresh interpreter per rank would import them again each time),
in one torch.distributed group: gloo on a CPU; NCCL where every rank has a GPU of its own (two
ranks on one GPU: NCCL refuses duplicate devices, so gloo); `KVFID_TP_BACKEND` overrides. Rank
0's return value comes back; a rank's exception is raised here as it was raised there.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
import datetime
import multiprocessing
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZE_ENV = "KVFID_TP_BACKEND"
PRELOAD = ["torch", "torch.distributed", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "kvfid.protocol.protocol",
           "kvfid.inputs.models", "kvfid.stacks.tp"]


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks (size 1, rank 0 without torch.distributed)."""

    size: int
    rank: int


def ranks() -> Ranks:
    """This process's place: torch.distributed's default group, or rank 0 of 1."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_world_size(), dist.get_rank())
    return Ranks(1, 0)


def shared(value):
    """Rank 0's `value` on every rank (the value itself on one rank)."""
    if ranks().size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def backend_for(device: str, size: int) -> str:
    """gloo on a CPU; NCCL where every rank has a GPU of its own; else gloo (two ranks on one
    GPU: NCCL refuses duplicate devices). KVFID_TP_BACKEND overrides."""
    chosen = os.environ.get(SIZE_ENV)
    if chosen:
        return chosen
    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.device_count() >= size:
        return "nccl"
    return "gloo"


def on_ranks(size: int, fn, *args, device: str = "cpu"):
    """Run fn(*args) on `size` ranks spawned on this machine (one process group); rank 0's result.
    A rank's exception is raised here as it was raised there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="kvfid-tp-") as folder:
        # Forked from a server that imported torch, transformers and kvfid and ran nothing (no
        # thread pool to inherit): a rank starts in a fraction of a fresh interpreter's time,
        # and later calls in this process reuse the server.

        multiprocessing.set_forkserver_preload(PRELOAD)
        try:
            mp.start_processes(_rank_main, args=(size, port, folder, device, fn, args),
                               nprocs=size, start_method="forkserver")
        except mp.ProcessExitedException:
            pass   # the rank that failed left its exception behind (read below)
        errors = sorted(Path(folder).glob("rank*.error"))
        if errors:
            raise pickle.loads(errors[0].read_bytes())
        return pickle.loads((Path(folder) / "rank0.result").read_bytes())


def _rank_main(rank: int, size: int, port: int, folder: str, device: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    elif torch.get_num_threads() * size > (os.cpu_count() or 1):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))   # a stack's @tN wins later
    dist.init_process_group(backend_for(device, size), rank=rank, world_size=size,
                            timeout=datetime.timedelta(minutes=30))
    try:
        result = fn(*args)
        if rank == 0:
            (Path(folder) / "rank0.result").write_bytes(pickle.dumps(result))
    except BaseException as err:   # noqa: BLE001 - carried to the parent, which raises it
        try:
            data = pickle.dumps(err)
        except Exception:          # noqa: BLE001 - an exception that does not pickle
            data = pickle.dumps(RuntimeError(f"rank {rank}: {type(err).__name__}: {err}"))
        (Path(folder) / f"rank{rank}.error").write_bytes(data)
        os._exit(1)                # the others may wait in a collective: the parent ends them
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
