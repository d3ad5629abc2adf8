"""What the kernel table and the bench headline say about the tiled batch-invariant mode: its
probes gathered from several processes, and the route each dtype takes on this machine."""

from __future__ import annotations

import torch

from kernels import DTYPES


def union_probes(*lists: list[dict]) -> list[dict]:
    """Tiled-mode probe verdicts (kernels.invariant.tiled.verdicts) from several processes, each call
    shape, thread count and route once."""
    return list({(p["call"], p["threads"], p.get("route")): p for probes in lists for p in probes}.values())


def tiled_routes(ran_tiled: bool, dtypes, device: torch.device) -> dict[str, dict]:
    """The tiled mode's route per dtype at this thread count (kernels.invariant.route: kept for this
    machine, so every process of a run takes the same), where tiled rows ran on a CPU."""
    from kernels.invariant import route as mode_route

    if device.type != "cpu" or not ran_tiled:
        return {}
    for dtype in dtypes:
        mode_route.route(DTYPES[dtype], device)
    mine = {f"{d}@t{torch.get_num_threads()}" for d in dtypes}
    return {name: r for name, r in mode_route.routes().items() if name in mine}
