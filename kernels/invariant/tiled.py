"""The batch-invariant mode's `tiled` implementation: rows in fixed-shape tiles, each tile one
call of the previously registered (stock) kernel, probed before it is trusted.

A row op (a matmul's rows, a mean over the last dim, a (log-)softmax's rows) is computed T rows
at a time, T the tile of the dtype's route on this machine (kvfid.kernels.invariant.route: timed once per
machine: many rows where a many-row bf16 matmul costs little more than one row, as on an AMX
Xeon, and fewer where it costs many times more): every call the stock kernel sees has the shape [T, K] whatever the
number of rows M (the last tile is padded with zero rows), so nothing the kernel chooses from M
(blocking, a split, a threading plan) can change a row's bits. A route may also widen a
half-precision product: exact fp32 copies of the inputs through the fp32 kernel, rounded back once
(`product`). What is left is the row's place in its tile: row i of M lands at place i % T, while a
decode step puts its one row at place 0. Whether a stock kernel gives a row the same bits at every
place of one fixed shape is a property of the machine's kernel (its register blocking, remainder
rows), so it is never assumed: before the first call of each (op, shape, dtype, operand layout,
thread count, route) a probe computes a random tile, then each of its rows alone at place 0 of a
zero tile, and compares the bits. Where they differ, that op at that shape runs row by row (the
`rowwise` way) instead, and `fallbacks()` says so, one line each.

Where the route takes one call per product (`Route.whole`), a key whose probe finds a floor F
(kvfid.kernels.invariant.whole) is one stock call over all its rows instead, padded to F below
F: a probe has shown that the call gives every row the bits of its F-row tile. A key with no
floor runs in the route's tiles as above.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import torch

from kvfid.kernels.invariant import route as mode_route
from kvfid.kernels.invariant import whole
from kvfid.kernels.invariant.route import Route

_lock = threading.Lock()
_verdicts: dict[Hashable, str | None] = {}  # (probe key, threads, route) -> None (trusted) or why not


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def trusted(key: Hashable, fn: Callable[[torch.Tensor], torch.Tensor], width: int,
            dtype: torch.dtype, device: torch.device, scale: float = 1.0,
            route: Route | None = None, probe: Callable[[], Callable] | None = None,
            reveal: bool = True) -> bool:
    """Whether tiles of `fn` at this key and route passed their probe (probed on first use, then
    cached); the route defaults to this machine's for `dtype`. The probe: `fn` on random rows of
    `scale`, and, where `reveal`, `probe()` (a product's stock call on a stand-in operand), else
    `fn`, on revealing rows (kvfid.kernels.invariant.whole, "What a probe feeds")."""
    route = route or mode_route.route(dtype, device)
    key = (key, torch.get_num_threads(), route)
    with _lock:
        if key in _verdicts:
            return _verdicts[key] is None
    verdict = whole.place_probe(whole.parts(fn, scale, probe, reveal), route.tile, width, dtype,
                                device)
    with _lock:
        _verdicts[key] = verdict
    return verdict is None


def _stock_call_serves(key: Hashable, rows: torch.Tensor, route: Route) -> bool:
    """Whether `whole.call` would make one call of `fn` on `rows` [M, K] as they are: a stock
    whole-call route whose span for `key` (already probed) makes a call of M rows as they are,
    the rows plain (contiguous from their storage's start). The common case of every decode step,
    decided in a few lookups."""
    if not route.whole or route.widen or rows.device.type != "cpu" or not rows.is_contiguous() \
            or rows.storage_offset():
        return False
    found = whole.probed(key, False)
    return found is not None and found.floor is not None and found.as_they_are(rows.shape[0])


def by_tiles(key: Hashable, fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor,
             scale: float = 1.0, route: Route | None = None,
             probe: Callable[[], Callable] | None = None, reveal: bool = True) -> torch.Tensor:
    """fn over rows [M, K] -> [M, N], the route's tile of rows per call (zero rows pad the last
    tile); row by row where the probe for `key` failed. `scale`, `probe`, `reveal`: what the
    probe feeds (`trusted`)."""
    route = route or mode_route.route(rows.dtype, rows.device)
    if _stock_call_serves(key, rows, route):
        return fn(rows)
    m, width = rows.shape
    served = _whole_span(key, fn, rows, scale, route, probe, reveal)
    if served is not None:
        return whole.call(fn, rows, served)
    if not trusted(key, fn, width, rows.dtype, rows.device, scale, route, probe, reveal):
        return torch.cat([fn(_fresh(rows[i:i + 1])) for i in range(m)])
    return whole.in_tiles(fn, rows, route.tile)


def _whole_span(key: Hashable, fn: Callable, rows: torch.Tensor, scale: float, route: Route,
                probe: Callable[[], Callable] | None = None, reveal: bool = True) -> whole.Span | None:
    """The whole-call span serving `key` where the route takes one call per product and the
    key's probe found a floor (kvfid.kernels.invariant.whole); else None (the tiles serve)."""
    if not route.whole or rows.device.type != "cpu":
        return None
    served = whole.span(key, fn, rows.shape[0], rows.shape[1], rows.dtype, rows.device, scale,
                        route.widen, probe, reveal)
    return served if served.floor is not None else None


def product(key: Hashable, call: Callable, a: torch.Tensor, b: torch.Tensor,
            *extra: torch.Tensor) -> torch.Tensor:
    """`call(tile, b, *extra)` (a stock product of a tile of a's rows) over a [M, K] by tiles, in
    the route of a's dtype: widened, the tile, b and extra (a bias) go in as exact fp32 copies
    (a weight's kept per version, kvfid.kernels.invariant.route.widened) and the product is rounded back.
    Its revealing probes call the stock product on a stand-in of b (zero for extra)."""
    route = mode_route.route(a.dtype, a.device)
    if not route.widen:
        return by_tiles(key, lambda t: call(t, b, *extra), a, route=route,
                        probe=lambda: on_stand_in(call, b, extra))
    wide_b, wide_extra = mode_route.widened(b), tuple(mode_route.widened(e) for e in extra)
    fn = lambda t: call(t.float(), wide_b, *wide_extra).to(a.dtype)     # noqa: E731
    wide = lambda t: call(t, wide_b, *wide_extra)                       # noqa: E731
    # Probed on the fp32 products (before rounding back): equal there, equal rounded.
    served = _whole_span(key, lambda t: wide(t.float()), a, 1.0, route,
                         lambda: _widened(on_stand_in(call, wide_b, wide_extra)))
    if served is not None:      # one call (or its floor's tiles), widened and rounded back once
        return whole.call(wide, a.float(), served).to(a.dtype)
    probe = lambda: _rounded(on_stand_in(call, wide_b, wide_extra), a.dtype)   # noqa: E731
    if not trusted(key, fn, a.shape[1], a.dtype, a.device, route=route, probe=probe):
        return by_tiles(key, fn, a, route=route, probe=probe)          # row by row
    # The same tiles' products, each widened and rounded back once for all rows (both exact and
    # element-wise: the bits of calling `fn` tile by tile, at a fraction of the copies).
    return whole.in_tiles(wide, a.float(), route.tile).to(a.dtype)


def on_stand_in(call: Callable, b: torch.Tensor, extra: tuple = ()) -> Callable:
    """The stock product on a stand-in of b and zero extras: what a product's probe calls."""
    stand_b, zeros = whole.stand_in(b), tuple(torch.zeros_like(e) for e in extra)
    return lambda t: call(t, stand_b, *zeros)


def _widened(fn: Callable) -> Callable:
    return lambda t: fn(t.float())


def _rounded(fn: Callable, dtype: torch.dtype) -> Callable:
    return lambda t: fn(t.float()).to(dtype)


def describe(key: Hashable, route: Route | None = None) -> str:
    """A probe key (kvfid.kernels.invariant.mode: op, width, the other operand's (shape, strides) or None, dtype,
    extras) and route in words, e.g. `mm [32, 576] x [576, 192] (strides (1, 576)) bfloat16`."""
    route = route or Route()
    op, width, layout, dtype, *extra = key
    text = f"{op} [{route.tile}, {width}]"
    if layout is not None:
        text += f" x {list(layout[0])} (strides {layout[1]})"
    text += f" {str(dtype).removeprefix('torch.')}"
    if route.widen and layout is not None:
        text += " widened to fp32"
    return text + (f" {extra}" if extra else "")


def fallbacks() -> list[str]:
    """One line per probed (op, shape) whose tiles were not trusted here (run row by row)."""
    with _lock:
        return [f"{describe(key, route)} at {threads} thread(s): {why}; rowwise there"
                for (key, threads, route), why in _verdicts.items() if why is not None]


def verdicts() -> list[dict]:
    """Every probe run in this process: its key, thread count, route and verdict (None = trusted)."""
    with _lock:
        return [{"call": describe(key, route), "threads": threads, "route": route.spec(), "failed": why}
                for (key, threads, route), why in _verdicts.items()]
