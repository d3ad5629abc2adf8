"""The tiled mode's route per dtype: how many rows each stock call takes, and in which dtype a
product is computed, chosen from timings on the running machine and kept per machine.

A constant measured on one CPU is wrong on another: a 32-row bf16 matmul ([32, 576] x [576, 1536])
costs little more than one row on an AMX Xeon and many times more on an AVX2-only EPYC, where a
one-row bf16 product also costs many times the fp32 one (the figures: docs/environment.md, "The
tiled mode's route"). So before the first tiled call of a dtype the mode times the candidate routes
on that product: the stock kernel at each tile size of `TILES`, and, for bf16 and fp16, the product
**widened**: the exact fp32 copies of the half-precision inputs multiplied by the fp32 kernel and
rounded back once (bf16 x bf16 products are exact in fp32; only the fp32 accumulation order, fixed
by the tile's shape, decides the bits). Each candidate runs the tiled mode's own loop (`in_tiles`:
padding, copies, a call per tile) on a decode row (padded to the tile) and on a prefill of
`PREFILL_ROWS` rows, and is scored by its worse ratio to the stock kernel (one row; one call of all
the rows). The timing is **interleaved**: each of `ROUNDS` rounds runs the stock kernel and every
candidate once (in a rotated order), and a score is taken from each call's fastest time, so that
load which comes and goes on a shared machine (preemption only adds time) slows no candidate more
than another; while a score lies near the margin, the timing goes on (up to `MORE` times as many
rounds).

Where the stock kernel's probe finds **a floor of one row** (every row has the same bits at every
row count probed: kvfid.kernels.invariant.whole), the route is that kernel itself, one call per
product (`whole:1`), taken without timing: each product is the stock call, so it costs what stock
costs at every row count and every shape. A timing on one product cannot promise that: a route
faster on the timed product, whose weight stays in cache, can cost more in a model's decode step,
whose weights stream from memory (at twice the bytes, widened to fp32; measured:
docs/environment.md, "The tiled mode's route").

Otherwise the rule is **hysteresis toward the order of `candidates()`** (stock before widened, larger tiles
first): the earliest route whose score is within `NEAR` of the best wins, so a later route
displaces an earlier one only when it is clearly faster; and the tiles lie a factor 4 apart, so
that where a tile's cost grows with its rows the candidates' scores lie far from the margin.
A rule without them (every tile size, a narrower margin, consecutive calls) chose different
routes on one machine from one process to the next; this one chooses the same route each time
(the choosings counted: docs/environment.md, "The tiled mode's route").

The choice changes result bits (another tile shape, another kernel), so it is made once per
machine and kept in `$KVFID_CACHE/tiled-routes.json` (default `~/.cache/kvfid`) under
`machine_key()` (CPU model, the capability torch dispatches to, the ISA variables oneDNN/ATen/MKL
read, torch version, threads, the rule's version `RULE`); every later process on that machine
reads it back instead of timing again. `KVFID_TILED_ROUTE` pins routes (`bf16=widen:1,fp32=16`): nothing is timed or kept.
The probes of kvfid.kernels.invariant.tiled still check every (op, shape) of the chosen route bit by bit.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvfid.kernels.invariant import machine, whole
from kvfid.kernels.invariant.whole import in_tiles

TILES = (1, 4, 16, 64)      # a factor 4 apart: where cost grows with rows, scores lie far apart
DEFAULT_TILE = 32           # the route off the CPU (and of a CPU store kept before TILES changed)
WIDTH, OUT = 576, 1536      # the timed product: SmolLM2's MLP up projection
PREFILL_ROWS = 64           # the prefill the score weighs (the model bench's 64 tokens)
NEAR = 1.5                  # a route within this factor of the best score counts as a tie
ROUNDS = 11                 # interleaved timing rounds (a candidate's score: its fastest calls)
MORE = 3                    # at most this many times ROUNDS while a score is near the margin
# The selection rule's version, part of machine_key: a route kept under an earlier rule (other
# candidates, another margin) is timed again, not reused beside fresh choices under one key.
RULE = 5
BAND = 1.15                 # "near the margin": within this factor of best * NEAR
PIN_ENV = "KVFID_TILED_ROUTE"
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Route:
    """How a product of rows runs: `whole`, one stock call over all rows where a shape's probe
    finds a floor (kvfid.kernels.invariant.whole; `tile` rows a call for a shape where none is
    found), else in tiles of `tile` rows; `widen`: half-precision products widened to fp32."""

    tile: int = DEFAULT_TILE
    widen: bool = False
    whole: bool = False

    def text(self) -> str:
        how = (f"one call per product where probed, else tiles of {self.tile}" if self.whole
               else f"tiles of {self.tile}")
        return f"{'widened to fp32' if self.widen else 'stock'}, {how}"

    def spec(self) -> str:
        return f"{'widen:' if self.widen else ''}{'whole:' if self.whole else ''}{self.tile}"

    @classmethod
    def from_spec(cls, spec: str) -> "Route":
        """`[widen:][whole:]TILE` -> Route; ValueError for anything else."""
        *words, tile = spec.strip().split(":")
        if words not in ([], ["widen"], ["whole"], ["widen", "whole"]) or not tile.isdigit() \
                or int(tile) < 1:
            raise ValueError(f"{spec!r} is not [widen:][whole:]TILE")
        return cls(int(tile), widen="widen" in words, whole="whole" in words)


def candidates(dtype: torch.dtype, floors: dict[bool, int | None] | None = None) -> list[Route]:
    """In order of preference at a tie: stock before widened; within each, one call per product
    (where `floors`, the timed product's floor stock and widened, has one) before tiles, larger
    tiles first (fewer calls)."""
    floors = floors or {}
    tiles = sorted(TILES, reverse=True)
    half = dtype in (torch.bfloat16, torch.float16)
    routes = []
    for widen in (False, True) if half else (False,):
        if floors.get(widen) is not None:
            routes.append(Route(floors[widen], widen=widen, whole=True))
        routes += [Route(t, widen=widen) for t in tiles]
    return routes


def score(decode_ms: float, prefill_ms: float, stock_decode_ms: float, stock_prefill_ms: float) -> float:
    """A route's worse ratio to stock: one decode row, and PREFILL_ROWS rows of a prefill."""
    return max(decode_ms / stock_decode_ms, prefill_ms / stock_prefill_ms)


def choose(scores: dict[Route, float], order: list[Route]) -> Route:
    """The earliest route of `order` whose score is within NEAR of the best one."""
    scores = {r: s for r, s in scores.items() if r in order}
    best = min(scores.values())
    return next(r for r in order if r in scores and scores[r] <= best * NEAR)


def near_margin(scores: dict[Route, float], order: list[Route]) -> bool:
    """Whether a route up to the chosen one scores within BAND of the margin (best * NEAR), where
    noise could tip the choice: then the timing goes on."""
    edge = min(scores.values()) * NEAR
    chosen = order.index(choose(scores, order))
    return any(1 / BAND < scores[r] / edge < BAND for r in order[:chosen + 1] if r in scores)


# ---- timing ------------------------------------------------------------------------------------

def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _timed_product(dtype: torch.dtype):
    """The timed product's weight [K, N] (as F.linear passes it), its fp32 copy, PREFILL_ROWS rows
    of input, and the product stock and widened (by `widen`)."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(OUT, WIDTH, generator=gen) * WIDTH ** -0.5).to(dtype).t()  # [K, N] as F.linear
    wide = w.float()
    rows = torch.randn(PREFILL_ROWS, WIDTH, generator=gen).to(dtype)
    return w, wide, rows, {False: lambda t: torch.mm(t, w),
                           True: lambda t: torch.mm(t.float(), wide).to(dtype)}


def measure(dtype: torch.dtype) -> dict:
    """This machine's route for `dtype` (run under kvfid.kernels.invariant.mode's stock block, so
    torch.mm is the stock kernel): the timed product's floors, stock and widened; where the
    stock floor is one row, the stock call itself (`whole:1`, untimed); else `timed`'s choice."""
    w, _, rows, products = _timed_product(dtype)
    half = dtype in (torch.bfloat16, torch.float16)
    stand = whole.stand_in(w)   # what a revealing probe multiplies (whole, "What a probe feeds")
    wide_stand = stand.float()
    probes = {False: lambda t: torch.mm(t, stand),
              True: lambda t: torch.mm(t.float(), wide_stand).to(dtype)}
    floors = {widen: whole.floor_of(products[widen], WIDTH, dtype, rows.device,
                                    probe=lambda widen=widen: probes[widen])
              for widen in ((False, True) if half else (False,))}
    if floors[False] == 1:
        return {"route": asdict(Route(1, whole=True)), "floors": _floor_names(floors),
                "rule": "the stock kernel gives a row the same bits at every row count probed "
                        "(a floor of one row): each product is the stock call, untimed",
                "product": f"[T, {WIDTH}] x [{WIDTH}, {OUT}]", "prefill_rows": PREFILL_ROWS,
                "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return timed(dtype, floors)


def _floor_names(floors: dict[bool, int | None]) -> dict[str, int | None]:
    return {("widened" if widen else "stock"): floor for widen, floor in floors.items()}


def timed(dtype: torch.dtype, floors: dict[bool, int | None]) -> dict:
    """Time every candidate route of `dtype` (given the timed product's `floors`) on a decode row
    and a PREFILL_ROWS prefill, each as it runs: one call (a decode row padded to the floor,
    stock and widened) or the tiled loop, in ROUNDS interleaved rounds; the chosen route, the
    scores, the floors and the median timings."""
    w, _, rows, products = _timed_product(dtype)
    order = candidates(dtype, floors)

    def calls(route: Route | None):
        if route is None:
            return lambda: torch.mm(rows[:1], w), lambda: torch.mm(rows, w)
        fn = products[route.widen]
        if route.whole:
            served = whole.Span(route.tile, PREFILL_ROWS, PREFILL_ROWS)
            return lambda: whole.call(fn, rows[:1], served), lambda: whole.call(fn, rows, served)
        return lambda: in_tiles(fn, rows[:1], route.tile), lambda: in_tiles(fn, rows, route.tile)

    timed = {r: calls(r) for r in [None, *order]}
    for decode, prefill in timed.values():      # warm-up: first calls, packed weights, caches
        decode(), prefill()
    times = {r: ([], []) for r in timed}
    for n in range(ROUNDS * MORE):
        for route in [None, *order[n % len(order):], *order[:n % len(order)]]:
            for each, fn in zip(times[route], timed[route]):
                each.append(_ms(fn))
        if (n + 1) % ROUNDS == 0:
            fastest = {r: (min(d), min(p)) for r, (d, p) in times.items()}
            scores = {r: score(*fastest[r], *fastest[None]) for r in order}
            if not near_margin(scores, order):
                break
    median = {r: (_median(d), _median(p)) for r, (d, p) in times.items()}
    chosen = choose(scores, order)
    return {"route": asdict(chosen), "stock_ms": {"decode": round(median[None][0], 4),
                                                  "prefill": round(median[None][1], 4)},
            "costs_ms": {r.spec(): [round(d, 4), round(p, 4)] for r, (d, p) in median.items() if r},
            "scores": {r.spec(): round(s, 3) for r, s in scores.items()},
            "floors": _floor_names(floors),
            "rule": f"the earliest route within {NEAR}x of the best score (fastest of {n + 1} rounds)",
            "product": f"[T, {WIDTH}] x [{WIDTH}, {OUT}]", "prefill_rows": PREFILL_ROWS,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


# ---- where routes are kept ---------------------------------------------------------------------

def machine_key(threads: int | None = None) -> str:
    """What a route depends on (kvfid.kernels.invariant.machine: CPU model, dispatch capability,
    ISA variables, torch version, threads) and the rule that chose it (RULE)."""
    return machine.machine_key(f"rule {RULE}", threads)


def store_path() -> Path:
    return machine.cache_dir() / "tiled-routes.json"


def pinned() -> dict[torch.dtype, Route]:
    """Routes pinned by KVFID_TILED_ROUTE (`bf16=widen:1,fp32=whole:16`); a bad value is
    refused."""
    text = os.environ.get(PIN_ENV, "").strip()
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, spec = part.partition("=")
        dtype = next((d for d, n in NAMES.items() if n == name.strip()), None)
        try:
            route = Route.from_spec(spec)
        except ValueError:
            route = None
        if dtype is None or route is None or (route.widen and dtype == torch.float32):
            raise ValueError(f"{PIN_ENV}: {part!r} is not DTYPE=[widen:][whole:]TILE "
                             "(bf16, fp16; fp32 not widened)")
        out[dtype] = route
    return out


_lock = threading.RLock()
_routes: dict[tuple, Route] = {}        # (dtype, threads) -> this process's route
_records: dict[str, dict] = {}          # "bf16@t1" -> how that route was chosen
_stock_block = contextlib.nullcontext   # kvfid.kernels.invariant.mode sets its stock_ops(): timing sees stock kernels


def use_stock_block(block) -> None:
    """The context in which torch's ops run their stock kernels (kvfid.kernels.invariant.mode.stock_ops)."""
    global _stock_block
    _stock_block = block


def _choose_now(dtype: torch.dtype, threads: int) -> tuple[Route, dict]:
    pins = pinned()
    if dtype in pins:
        return pins[dtype], {"route": asdict(pins[dtype]), "source": f"pinned by {PIN_ENV}"}
    path, key, name = store_path(), machine_key(), NAMES[dtype]
    try:
        with machine.locked(path):
            kept = machine.read_json(path)
            mine = kept.setdefault(key, {})
            source = f"kept in {path}"
            if name not in mine:
                with _stock_block():
                    mine[name] = measure(dtype)
                machine.write_json(path, kept)
                source = f"timed now, kept in {path}"
    except OSError as err:      # no writable store: this process's own timing (said in the source)
        with _stock_block():
            mine = {name: measure(dtype)}
        source = f"timed now, NOT kept ({path}: {err.strerror or err}); pin it with {PIN_ENV}"
    return Route(**mine[name]["route"]), {**mine[name], "source": source, "machine": key}


def route(dtype: torch.dtype, device: torch.device) -> Route:
    """The route of a tiled call: on a CPU, this machine's for `dtype` at this thread count
    (chosen on first use: pinned, kept, or timed now and kept); elsewhere the default."""
    if device.type != "cpu" or dtype not in NAMES:
        return Route()
    threads = torch.get_num_threads()
    found = _routes.get((dtype, threads))
    if found is None:
        with _lock:
            if (dtype, threads) not in _routes:
                chosen, record = _choose_now(dtype, threads)
                _records[f"{NAMES[dtype]}@t{threads}"] = record
                _routes[dtype, threads] = chosen
            found = _routes[dtype, threads]
    return found


def kept() -> dict[str, dict]:
    """The routes kept for this machine at any thread count ("bf16@t1" -> record), read without
    timing: what a tiled call here takes unless KVFID_TILED_ROUTE pins another (for the
    environment record)."""
    store = machine.read_json(store_path())
    return {f"{name}@t{n}": record for n in range(1, (os.cpu_count() or 1) + 1)
            for name, record in store.get(machine_key(n), {}).items()}


def routes() -> dict[str, dict]:
    """How each (dtype, threads) route used in this process was chosen (for the kernel table
    and the bench headline)."""
    with _lock:
        return {name: dict(record) for name, record in _records.items()}


# ---- widened operands --------------------------------------------------------------------------

_widened: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}


def widened(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, exactly, with t's strides. A view of a Parameter (a weight) is widened once per
    version of it and kept while the Parameter lives (each view of it apart: the parts of a merged
    projection); anything else is widened at each call."""
    base = t._base if t._base is not None else t
    if not isinstance(base, torch.nn.Parameter):
        return t.float()
    key = (id(base), base._version, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    hit = _widened.get(key)
    if hit is not None and hit[0]() is base:
        return hit[1]
    wide = t.float()
    for old in [k for k in _widened if k[0] == id(base) and k[1] != base._version]:
        del _widened[old]                                   # an older version of this weight
    _widened[key] = (weakref.ref(base, lambda _, k=key: _widened.pop(k, None)), wide)
    return wide
