"""The CPU tile math of kvfid's attention contract: a sequence's positions planned into calls
(native_call.attend computes one), in plain PyTorch at BLAS speed. The native path (native.py:
dense K/V) and the paged path (paged.py: vLLM's paged cache) differ only in how they lay a
sequence's queries and keys out; both hand them to `run_tiles` (the paged path's decode steps of
several requests to `run_stacked`), so a position's bits are one function of its own queries
and keys:

* a query tile holds `tile_m` positions of one sequence aligned to its own positions (position t
  is row t % tile_m of tile t // tile_m), each position as its G query heads (rows t-major, G per
  position: [tile_m * G, D] per key/value head). A tile reads the keys from 0 (with a window or
  a chunk: the lowest key its first position may see, down to a key tile) to the end of the key
  tile of `tile_n` positions that holds it: the keys a tile reads, and so every shape its
  products have, are a function of the tile alone, never of the construction. A tile computed
  alone defines the bits;
* the positions whose tiles read the same keys are computed in one call (their rows stacked)
  where a probe on this machine shows each position gets the bits it gets in its tile computed
  alone (`rows_keep_bits`: per call size, product shape and thread count, the whole call on
  random data against each tile alone); a short call (a decode step) is padded to the fewest
  positions that do (the floor the machine allows); elsewhere tile by tile;
* calls of several sequences with the same shape (decode steps whose keys end in the same key
  tile) are stacked in the products' batch dimension where a probe shows each sequence gets the
  bits it gets alone (`sequences_keep_bits`), else computed one by one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvfid.kernels.attention.native_call import LOG2E, NativeConfig, Pattern, Run, attend, lengths
from kvfid.kernels.invariant.ops import LANES


@dataclass(frozen=True)
class Plan:
    """A sequence's work: its positions begin .. end - 1 in runs that read the same keys."""

    runs: tuple[Run, ...]
    pattern: Pattern
    begin: int
    end: int

    @property
    def start(self) -> int:    # the first key any run reads (own position)
        return self.runs[0].start

    @property
    def stop(self) -> int:     # past the last key any run reads
        return self.runs[-1].stop


@functools.lru_cache(maxsize=1024)
def plan(begin: int, end: int, pattern: Pattern, config: NativeConfig) -> Plan:
    """Own positions begin .. end - 1 by the keys their tiles read: a tile t reads from its first
    position's lowest key (down to a key tile) to the end of the key tile that holds it."""
    tm, tn = config.tile_m, config.tile_n
    runs: list[Run] = []
    for tile in range(begin // tm, (end - 1) // tm + 1):
        start = pattern.lowest(tile * tm) // tn * tn
        stop = (tile * tm // tn + 1) * tn
        lo, hi = max(begin, tile * tm), min(end, (tile + 1) * tm)
        if runs and (runs[-1].start, runs[-1].stop) == (start, stop):
            runs[-1] = Run(runs[-1].lo, hi, start, stop)
        else:
            runs.append(Run(lo, hi, start, stop))
    return Plan(tuple(runs), pattern, begin, end)


@functools.lru_cache(maxsize=64)
def query_scale(scale: float, softcap: float | None) -> torch.Tensor:
    """What the queries are multiplied by, as a one-element fp32 tensor (a product with it is
    computed in fp32 whatever the queries' dtype): the scores come out in base 2 (a soft cap is
    applied to the natural scores, then converted)."""
    return torch.tensor([scale if softcap is not None else scale * LOG2E], dtype=torch.float32)


def run_tiles(queries: torch.Tensor, factor: torch.Tensor, k: torch.Tensor, v: torch.Tensor, work: Plan,
              config: NativeConfig, out: torch.Tensor, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> None:
    """queries [Hkv, work.end - work.begin, G, D] (any float dtype): a sequence's queries at own
    positions begin .. end - 1, multiplied by `factor` (query_scale) into fp32 rows; k [Hkv,
    work.stop - work.start, D], v [..., Dv] fp32: its keys from own position work.start (absent
    keys zero); sinks [Hq] or None -> out [Hkv, work.end - work.begin, G, Dv] (any dtype and
    strides). Each position gets the bits it gets in its tile computed alone."""
    heads, _, group_size, dim = queries.shape
    shape = (heads, group_size, dim, v.shape[-1], config, torch.get_num_threads())
    calls = _calls(work.runs[0], shape) if len(work.runs) == 1 else \
        tuple(call for run in work.runs for call in _calls(run, shape))
    widest = max(n for _, n, _ in calls)
    # one buffer for every call's query rows and one for every piece's scores: fresh memory for
    # each would be paged in each time
    rows = torch.empty(heads, widest, group_size, dim)
    size = heads * widest * group_size * max(min(config.span, r.stop - r.start) for r in work.runs)
    scores = torch.empty(-(-size // LANES) * LANES)     # room to round every exp2 call up to LANES
    for lo, n, run in calls:
        q = rows.narrow(1, 0, n)                                        # [Hkv, n, G, D]
        first, last = max(work.begin, run.lo, lo), min(work.end, run.hi, lo + n)   # the run's own positions
        if last - first < n:
            q.zero_()                                                   # absent positions: zero rows
        torch.mul(queries.narrow(1, first - work.begin, last - first), factor,
                  out=q.narrow(1, first - lo, last - first))
        attend(q.view(heads, -1, dim), k, v, work.start, lo, n, run, work.pattern, config, softcap,
               sinks, out, work.begin, work.end, scores)


@functools.lru_cache(maxsize=4096)
def _calls(run: Run, shape: tuple) -> tuple[tuple[int, int, Run], ...]:
    """How a run is computed: (first position, positions, run) per call. The run in one call where
    the probe shows each position keeps its tile's bits; a short run padded to the fewest positions
    that do; else its tiles one by one (each tile alone: its bits by definition)."""
    config = shape[4]
    tm, n = config.tile_m, run.hi - run.lo
    aligned = run.lo % tm == 0 and n == tm
    shapes = lengths(run, config)
    if aligned or rows_keep_bits(*shape, n, shapes):
        return ((run.lo, n, run),)
    for padded in range(n + 1, tm):
        if rows_keep_bits(*shape, padded, shapes):
            return ((run.lo, padded, run),)
    return tuple((tile * tm, tm, run) for tile in range(run.lo // tm, (run.hi - 1) // tm + 1))


@functools.lru_cache(maxsize=None)
def rows_keep_bits(heads: int, group_size: int, dim: int, v_dim: int, config: NativeConfig, threads: int,
                   positions: int, shapes: tuple[tuple[bool, int], ...]) -> bool:
    """Whether a call of `positions` consecutive positions gives each, on this machine at this
    thread count, the bits it gets in its tile computed alone, for every piece shape in `shapes`
    (probed once per shape)."""
    return all(_rows_probe(heads, group_size, dim, v_dim, config, threads, positions, later, keys)
               for later, keys in shapes)


@functools.lru_cache(maxsize=None)
def _rows_probe(heads: int, group_size: int, dim: int, v_dim: int, config: NativeConfig,
                threads: int, positions: int, later: bool, keys: int) -> bool:
    """A key tile's positions (random data) whose last piece reads `keys` keys, as the first piece
    or after a first piece of one key tile (`later`): its last `positions` (those that see the
    most keys) in one call against each tile computed alone."""
    tm, tn = config.tile_m, config.tile_n
    start, stop = (config.span - tn, config.span + keys) if later else (0, keys)
    run, lo = Run(stop - tn, stop, start, stop), stop - tn
    generator = torch.Generator().manual_seed(positions * 7919 + keys)
    q = torch.randn(heads, tn, group_size, dim, generator=generator)
    k = torch.randn(heads, stop - start, dim, generator=generator)
    v = torch.randn(heads, stop - start, v_dim, generator=generator)
    alone = torch.empty(heads, tn, group_size, v_dim)
    for at in range(0, tn, tm):
        attend(q.narrow(1, at, tm).reshape(heads, -1, dim), k, v, start, lo + at, tm, run, Pattern(),
               config, None, None, alone, lo, stop)
    together = torch.empty(heads, positions, group_size, v_dim)
    first = stop - positions
    attend(q.narrow(1, first - lo, positions).reshape(heads, -1, dim), k, v, start, first, positions, run,
           Pattern(), config, None, None, together, first, stop)
    return torch.equal(together, alone.narrow(1, first - lo, positions))


def run_stacked(queries: torch.Tensor, factor: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: tuple[int, ...], run: Run, config: NativeConfig) -> torch.Tensor | None:
    """Decode steps of S sequences whose query at own position positions[s] reads keys run.start ..
    run.stop - 1 (plain causal): queries [S, Hkv, G, D] (any float dtype), k [S * Hkv, run.stop -
    run.start, D], v [..., Dv] fp32 (absent keys zero) -> [S, Hkv, G, Dv] fp32, each sequence's
    bits those of run_tiles on it alone; None where the probe refuses stacking them (compute them
    one by one then)."""
    count, heads, group_size, dim = queries.shape
    shape = (heads, group_size, dim, v.shape[-1], config, torch.get_num_threads())
    ((lo, n, _),) = _calls(Run(positions[0], positions[0] + 1, run.start, run.stop), shape)
    if lo != positions[0] or not sequences_keep_bits(*shape, count, n, lengths(run, config)):
        return None
    rows = queries.new_zeros(count, heads, n, group_size, dim, dtype=torch.float32)
    torch.mul(queries, factor, out=rows.select(2, 0))
    size = count * heads * n * group_size * min(config.span, run.stop - run.start)
    done = attend(rows.view(count * heads, n * group_size, dim), k, v, run.start, positions, n, run,
                  Pattern(), config, None, None, None, 0, 0, torch.empty(-(-size // LANES) * LANES))
    return done.view(count, heads, n, group_size, -1).select(2, 0)


@functools.lru_cache(maxsize=None)
def sequences_keep_bits(heads: int, group_size: int, dim: int, v_dim: int, config: NativeConfig, threads: int,
                        count: int, positions: int, shapes: tuple[tuple[bool, int], ...]) -> bool:
    """Whether `count` sequences' calls of `positions` positions stacked in one call's batch
    dimension give each, on this machine at this thread count, the bits it gets alone, for every
    piece shape in `shapes` (probed once per shape)."""
    return all(_sequences_probe(heads, group_size, dim, v_dim, config, threads, count, positions, later, keys)
               for later, keys in shapes)


@functools.lru_cache(maxsize=None)
def _sequences_probe(heads: int, group_size: int, dim: int, v_dim: int, config: NativeConfig,
                     threads: int, count: int, positions: int, later: bool, keys: int) -> bool:
    """`count` sequences (random data, each its own keys and query position in the last key tile)
    whose last piece reads `keys` keys (after a first piece of one key tile if `later`): stacked
    against each alone."""
    tn = config.tile_n
    start, stop = (config.span - tn, config.span + keys) if later else (0, keys)
    run = Run(stop - tn, stop, start, stop)
    generator = torch.Generator().manual_seed(count * 7919 + positions * 31 + keys)
    q = torch.randn(count * heads, positions * group_size, dim, generator=generator)
    k = torch.randn(count * heads, stop - start, dim, generator=generator)
    v = torch.randn(count * heads, stop - start, v_dim, generator=generator)
    where = tuple(int(x) for x in torch.randint(stop - tn, stop - positions + 1, (count,), generator=generator))
    together = attend(q, k, v, start, where, positions, run, Pattern(), config, None, None, None, 0, 0)
    for i, lo in enumerate(where):
        at = slice(i * heads, (i + 1) * heads)
        alone = attend(q[at], k[at], v[at], start, (lo,), positions, run, Pattern(), config, None, None, None, 0, 0)
        if not torch.equal(alone, together[at]):
            return False
    return True
