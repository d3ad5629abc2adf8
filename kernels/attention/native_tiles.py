"""The CPU tile math of kvfid's attention contract: one sequence's query tiles over its keys, in
plain PyTorch at BLAS speed. The native path (native.py: dense K/V) and the paged path (paged.py:
vLLM's paged cache) differ only in how they lay a sequence's queries and keys out; both hand them
to `run_tiles`, so a position's bits are one function of its own queries and keys:

* a query tile holds `tile_m` positions of one sequence aligned to its own positions (position t
  is row t % tile_m of tile t // tile_m), each position as its G query heads (rows t-major, G per
  position: [tile_m * G, D] per key/value head). A tile reads the keys from 0 (with a window or
  a chunk: the lowest key its first position may see, down to a key tile) to the end of the key
  tile of `tile_n` positions that holds it: the keys a tile reads, and so every shape its
  products have, are a function of the tile alone, never of the construction;
* keys are read in spans of `span` positions aligned to absolute positions, in order, with an fp32
  online softmax across spans in base 2 (the queries carry log2(e)); within a span a product per
  operand (scores, then probabilities x values), whose reduction over the span's keys is the
  machine BLAS's for that fixed shape. A key a query may not see is -inf, so it weighs exactly 0;
* the positions whose tiles read the same keys are computed in one call (their rows stacked)
  where a probe on this machine shows each position gets the bits it gets in its tile computed
  alone (`rows_keep_bits`: per call size, product shape and thread count, the whole call on
  random data against each tile alone); a short call (a decode step) is padded to the fewest
  positions that do (the floor the machine allows); elsewhere tile by tile;
* exp2 (and tanh under a soft cap) run only on contiguous calls of a multiple of LANES elements,
  at most BLOCK per call where more than one thread could split a call: every element takes the
  vector body (kvfid.kernels.invariant.ops: the scalar tail rounds differently). max, +, -, *, /
  and masking round the same on every path.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvfid.kernels.invariant.ops import BLOCK, LANES

# The online softmax's floor: a row that has seen no key yet (its first span fully masked under
# a window or a chunk) keeps a finite maximum, so exp2(-inf - FLOOR) = 0 and nothing is NaN.
FLOOR = -1e30
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class NativeConfig:
    """The fixed tiling: never a function of batch or length."""

    tile_m: int = 16   # query positions per tile (per query head), as the Triton kernel's BLOCK_M
    tile_n: int = 64   # keys per key tile (a multiple of tile_m): a tile reads to the end of its key tile
    span: int = 512    # keys per span of the online softmax (a multiple of tile_n)

    def __post_init__(self) -> None:
        if self.tile_m < 1 or self.tile_n % self.tile_m:
            raise ValueError(f"tile_n ({self.tile_n}) must be a positive multiple of tile_m ({self.tile_m})")
        if self.span < self.tile_n or self.span % self.tile_n:
            raise ValueError(f"span ({self.span}) must be a positive multiple of tile_n ({self.tile_n})")


DEFAULT_CONFIG = NativeConfig()


@dataclass(frozen=True)
class Pattern:
    """Which keys a query at own position p sees: k <= p, k >= key_first (the first key held),
    p - window < k with a window, k // chunk == p // chunk with a chunk."""

    window: int | None = None
    chunk: int | None = None
    key_first: int = 0

    def lowest(self, position: int) -> int:
        """The lowest key the pattern lets a query at `position` see (key_first aside)."""
        low = 0
        if self.window is not None:
            low = max(low, position - self.window + 1)
        if self.chunk is not None:
            low = max(low, position // self.chunk * self.chunk)
        return low

    def hidden(self, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """positions [M, 1], keys [1, w] -> [M, w] True where the key is hidden from the query."""
        keep = (keys <= positions) & (keys >= self.key_first)
        if self.window is not None:
            keep &= keys > positions - self.window
        if self.chunk is not None:
            keep &= keys // self.chunk == positions // self.chunk
        return ~keep


@dataclass(frozen=True)
class Run:
    """Own positions lo .. hi - 1 of a sequence, in tiles that read the same keys start .. stop - 1."""

    lo: int
    hi: int
    start: int
    stop: int


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
    lengths = _lengths(run, config)
    if aligned or rows_keep_bits(*shape, n, lengths):
        return ((run.lo, n, run),)
    for padded in range(n + 1, tm):
        if rows_keep_bits(*shape, padded, lengths):
            return ((run.lo, padded, run),)
    return tuple((tile * tm, tm, run) for tile in range(run.lo // tm, (run.hi - 1) // tm + 1))


@functools.lru_cache(maxsize=4096)
def _pieces(run: Run, config: NativeConfig) -> tuple[tuple[int, int], ...]:
    """The spans a run reads, cut at multiples of `span` (absolute), each [from, to)."""
    cuts = list(range((run.start // config.span + 1) * config.span, run.stop, config.span))
    edges = [run.start, *cuts, run.stop]
    return tuple(zip(edges, edges[1:]))


def _lengths(run: Run, config: NativeConfig) -> tuple[tuple[bool, int], ...]:
    """The product shapes a run's pieces take: (later piece?, keys)."""
    return tuple((i > 0, b - a) for i, (a, b) in enumerate(_pieces(run, config)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, base: int, lo: int, n: int, run: Run,
           pattern: Pattern, config: NativeConfig, softcap: float | None, sinks: torch.Tensor | None,
           out: torch.Tensor, begin: int, end: int, scores: torch.Tensor | None = None) -> None:
    """One call: q [Hkv, n * G, D], the rows of own positions lo .. lo + n - 1 (G each), over the
    keys run.start .. run.stop - 1 of k, v (index 0 at own position `base`); the outputs of its
    positions in the run and in begin .. end - 1 written to out[:, position - begin] ([Hkv, *, G, Dv]).
    `scores`: a flat fp32 buffer to compute each piece's scores in (else fresh)."""
    heads, m_rows, _ = q.shape
    group_size, tn = m_rows // n, config.tile_n
    plain = pattern.window is None and pattern.chunk is None and pattern.key_first <= run.start
    # keys every row of the call sees need no mask: [open_from, stop - tile_n)
    open_from = run.start if plain else min(max(run.start, pattern.key_first, pattern.lowest(lo + n - 1)),
                                            run.stop - tn)
    m = l = acc = alpha = None
    for a, b in _pieces(run, config):
        whole = a == base and b - a == k.shape[1]
        s = (scores.narrow(0, 0, heads * m_rows * (b - a)).view(heads, m_rows, b - a) if scores is not None
             else torch.empty(heads, m_rows, b - a))
        torch.bmm(q, (k if whole else k.narrow(1, a - base, b - a)).transpose(1, 2), out=s)  # [Hkv, M, b - a]
        if softcap is not None:
            s.div_(softcap)
            _lane_uniform(torch.tanh, s)
            s.mul_(softcap * LOG2E)
        if plain:   # only the diagonal key tile, the last of the last piece: a fixed additive mask
            if b == run.stop:
                s.narrow(2, b - tn - a, tn).add_(_causal(n, group_size, tn, lo - (b - tn)))
        else:
            for x, y in ((a, min(b, open_from)), (max(a, run.stop - tn), b)):
                if x < y:
                    s.narrow(2, x - a, y - x).masked_fill_(_hidden(lo, n, group_size, pattern, x, y), float("-inf"))
        top = s.amax(-1)                                                     # [Hkv, M]
        if not plain:
            top.clamp_min_(FLOOR)
        if m is not None:
            torch.maximum(m, top, out=top)
            alpha = _lane_uniform(torch.exp2, m - top)
        m = top
        s.sub_(m.unsqueeze(-1))
        _lane_uniform(torch.exp2, s, scores)
        total = torch.sum(s, -1, out=torch.empty(heads, m_rows))
        values = v if whole else v.narrow(1, a - base, b - a)
        if acc is None:
            l, acc = total, torch.bmm(s, values)                              # [Hkv, M, Dv]
        else:
            l.mul_(alpha).add_(total)
            acc.mul_(alpha.unsqueeze(-1)).baddbmm_(s, values)
    if sinks is not None:  # a per-head logit in the denominator only
        sink = (sinks.float() * LOG2E).view(heads, 1, group_size).expand(heads, n, group_size).reshape(heads, m_rows)
        top = torch.maximum(m, sink)
        alpha = _lane_uniform(torch.exp2, m - top)
        l.mul_(alpha).add_(_lane_uniform(torch.exp2, sink - top))
        acc.mul_(alpha.unsqueeze(-1))
    first, last = max(begin, run.lo, lo), min(end, run.hi, lo + n)
    if first < last:
        acc, l = acc.view(heads, n, group_size, acc.shape[-1]), l.view(heads, n, group_size, 1)
        if last - first < n:
            acc, l = acc.narrow(1, first - lo, last - first), l.narrow(1, first - lo, last - first)
        torch.div(acc, l, out=out if last - first == out.shape[1] else out.narrow(1, first - begin, last - first))


def _hidden(lo: int, n: int, group_size: int, pattern: Pattern, x: int, y: int) -> torch.Tensor:
    """[n * G, y - x] True where a row's query (own positions lo ..) may not see the key (x ..)."""
    positions = torch.arange(lo, lo + n).repeat_interleave(group_size)
    return pattern.hidden(positions[:, None], torch.arange(x, y)[None, :])


@functools.lru_cache(maxsize=256)
def _causal(positions: int, group_size: int, width: int, offset: int) -> torch.Tensor:
    """Rows of `positions` consecutive queries (G rows each) from key `offset` of a [width] slice:
    -inf where the key is after the query, else 0 (added: a visible score stays as it is)."""
    own = (offset + torch.arange(positions)).repeat_interleave(group_size)[:, None]
    return torch.zeros(positions * group_size, width).masked_fill_(torch.arange(width)[None, :] > own,
                                                                    float("-inf"))


def _lane_uniform(fn, x: torch.Tensor, room: torch.Tensor | None = None) -> torch.Tensor:
    """fn (element-wise, in place through out=) over contiguous x: on calls of a multiple of LANES
    elements, at most BLOCK per call where a thread split could land inside one (one thread: no
    split), so no element is in a scalar tail; returns x. `room`: a flat buffer x starts at whose
    following elements may be overwritten (the call is rounded up inside it instead of copied)."""
    flat = x.view(-1)
    n = flat.numel()
    whole = -(-n // LANES) * LANES
    if room is not None and whole <= room.numel() and flat.data_ptr() == room.data_ptr():
        flat = room.narrow(0, 0, whole)
    if flat.numel() % LANES == 0 and (whole <= BLOCK or torch.get_num_threads() == 1):
        fn(flat, out=flat)
        return x
    work = flat if flat.numel() == whole else torch.cat([flat, flat.new_zeros(whole - n)])
    step = whole if torch.get_num_threads() == 1 else BLOCK
    for i in range(0, whole, step):
        part = work[i:i + step]
        fn(part, out=part)
    if work is not flat:
        flat.copy_(work[:n])
    return x


@functools.lru_cache(maxsize=None)
def rows_keep_bits(heads: int, group_size: int, dim: int, v_dim: int, config: NativeConfig, threads: int,
                   positions: int, lengths: tuple[tuple[bool, int], ...]) -> bool:
    """Whether a call of `positions` consecutive positions gives each, on this machine at this
    thread count, the bits it gets in its tile computed alone, for every piece shape in `lengths`
    (probed once per shape)."""
    return all(_rows_probe(heads, group_size, dim, v_dim, config, threads, positions, later, keys)
               for later, keys in lengths)


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
