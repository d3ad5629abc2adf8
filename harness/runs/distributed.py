"""Several processes (GPUs, hosts) sharing one case through `torchrun`, not a home-made launcher.

Under `torchrun`, every rank takes `--shard rank/world` of the case and writes its own units into
one run (rank 0 draws the run id and broadcasts it); after a barrier rank 0 closes the run and
reports. A case at TP size N (kvfid.stacks.tp) takes N ranks as its TP group instead (`in_group`):
all of them measure each unit, rank 0 writes it. Each rank on a CUDA machine uses the GPU of its LOCAL_RANK. Ranks on different hosts
should write separate ledgers (SQLite over a network file system is not safe) and be joined with
`kvfid merge`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvfid.ledger.store import Ledger, new_run_id
from kvfid.runs import matrix, shards
from kvfid.stacks.ranks import backend_for


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    local_rank: int


def torchrun_rank() -> RankInfo | None:
    """This process's place in a torchrun launch, or None when not launched by torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} outside WORLD_SIZE={world}")
    return RankInfo(rank, world, int(os.environ.get("LOCAL_RANK", str(rank))))


def in_group(info: RankInfo, device: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) on this torchrun rank inside one process group of all of them (a TP
    case: the ranks share each unit's model; kvfid.stacks.tp)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    dist.init_process_group(backend_for(device, info.world))
    try:
        return fn(*args, **kwargs)
    finally:
        dist.destroy_process_group()


def run_ranked(case, db, info: RankInfo, *, items=None, run_id=None, progress=True):
    """Run this rank's shard of `case` into the shared run; rank 0 returns the closed run's
    result, other ranks return their own shard's result."""
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank)   # "cuda" in the case means this rank's GPU
    dist.init_process_group("gloo")
    try:
        chosen = [run_id or (new_run_id() if info.rank == 0 else None)]
        dist.broadcast_object_list(chosen, src=0)
        result = matrix.run_case(case, db, items=items, run_id=chosen[0],
                                 shard=shards.Shard(info.rank, info.world),
                                 progress=progress and info.rank == 0)
        dist.barrier()
        if info.rank == 0:
            with Ledger(db) as ledger:
                result.status = ledger.finish(result.run_id)
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()
