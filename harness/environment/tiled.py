"""What the kernel table and the bench headline say about the tiled batch-invariant mode: its
probes gathered from several processes, and the route each dtype takes on this machine."""

from __future__ import annotations

import torch

from kvfid.kernels import DTYPES
from kvfid.kernels.invariant import route as mode_route


def union_probes(*lists: list[dict]) -> list[dict]:
    """Tiled-mode probe verdicts (kvfid.kernels.invariant.tiled.verdicts) from several processes, each call
    shape, thread count and route once."""
    return list({(p["call"], p["threads"], p.get("route")): p for probes in lists for p in probes}.values())


def tiled_routes(ran_tiled: bool, dtypes, device: torch.device) -> dict[str, dict]:
    """The tiled mode's route per dtype at this thread count (kvfid.kernels.invariant.route: kept for this
    machine, so every process of a run takes the same), where tiled rows ran on a CPU."""
    if device.type != "cpu" or not ran_tiled:
        return {}
    for dtype in dtypes:
        mode_route.route(DTYPES[dtype], device)
    mine = {f"{d}@t{torch.get_num_threads()}" for d in dtypes}
    return {name: r for name, r in mode_route.routes().items() if name in mine}


def choose_routes(stacks) -> None:
    """Choose (or read back) the route every CPU stack in the tiled batch-invariant mode will
    take, at its thread count, for its dtype and fp32, before a run's environment record is
    taken: the first run on a fresh machine then records the routes its units use (the record
    reads kvfid.kernels.invariant.route's store; a route is timed once per machine and kept)."""
    for stack in stacks:
        if stack.batch_invariant_impl != "tiled" or not stack.device.startswith("cpu"):
            continue
        previous = torch.get_num_threads()
        try:
            if stack.threads is not None:
                torch.set_num_threads(stack.threads)
            for dtype in {DTYPES[stack.dtype], torch.float32}:
                mode_route.route(dtype, torch.device("cpu"))
        finally:
            torch.set_num_threads(previous)
