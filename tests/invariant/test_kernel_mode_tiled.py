"""kvfid.kernels.invariant.tiled: fixed tiles of rows per stock call, a probe before they are trusted, and
the row-by-row fallback where the probe fails (a kernel variant by construction is the control)."""

from __future__ import annotations

import torch
from helpers import BATCH_SIZES, assert_bitwise_equal, randn

from kvfid.kernels.invariant import route as mode_route, tiled as mode_tiled, whole
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.invariant.route import Route


def place_dependent(t: torch.Tensor) -> torch.Tensor:
    """A 'kernel' whose row bits depend on the row's place in its call (variant on any machine)."""
    return t * (1 + 1e-3 * torch.arange(t.shape[0], dtype=t.dtype))[:, None]


def test_every_call_has_the_tile_shape_whatever_m():
    shapes = []

    def recording(t):
        shapes.append(tuple(t.shape))
        return t * 2

    tiles = Route(4)                   # a tiled route (a whole-call route: test_kernel_mode_whole.py)
    for m in (1, 31, 32, 33, 70):
        out = mode_tiled.by_tiles(("recording", 8, None, torch.float32), recording, randn(m, 8, on="cpu"),
                                  route=tiles)
        assert out.shape == (m, 8)
    assert set(shapes) == {(4, 8)}


def test_control_a_place_dependent_kernel_fails_its_probe_and_runs_row_by_row():
    key, route = ("place-dependent", 12, None, torch.float32), Route(8)   # a tile with places to differ
    rows = randn(40, 12, on="cpu")
    out = mode_tiled.by_tiles(key, place_dependent, rows, route=route)
    assert not mode_tiled.trusted(key, place_dependent, 12, torch.float32, torch.device("cpu"), route=route)
    # Row by row: every row at place 0 of a one-row call, so each has its bits alone.
    for i in (0, 7, 31, 39):
        assert_bitwise_equal(out[i:i + 1], place_dependent(rows[i:i + 1].clone()), f"row {i}")
    assert any(line.startswith("place-dependent [8, 12] float32") and "rowwise there" in line
               for line in mode_tiled.fallbacks())


def test_tiled_linear_rows_alone_equal_rows_in_any_batch():
    """Whatever the probes found on this machine (tiles trusted, or rows alone), a row's bits do
    not depend on the batch it is computed in."""
    x = randn(max(BATCH_SIZES), 96, dtype=torch.bfloat16, on="cpu")
    w = randn(80, 96, dtype=torch.bfloat16, scale=96 ** -0.5, on="cpu")
    with set_batch_invariant_mode(impl="tiled"):
        alone = [torch.nn.functional.linear(x[i:i + 1].clone(), w) for i in range(x.shape[0])]
        for n in BATCH_SIZES:
            out = torch.nn.functional.linear(x[:n].clone(), w)
            for i in range(n):
                assert_bitwise_equal(out[i:i + 1], alone[i], f"row {i} of {n}")
    route = mode_route.route(torch.bfloat16, torch.device("cpu"))
    # the call shape that served them: a span of whole calls, or the route's tile
    served = ([v["call"] for v in whole.verdicts() if v["floor"] is not None] if route.whole else
              [v["call"] for v in mode_tiled.verdicts()])
    head = "mm [M, 96]" if route.whole else f"mm [{route.tile}, 96]"
    assert any(call.startswith(head) for call in served), served
