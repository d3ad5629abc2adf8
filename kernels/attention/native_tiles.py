"""The CPU tile math of kvfid's attention contract: one sequence's query tiles over its keys, in
plain PyTorch at BLAS speed. The native path (native.py: dense K/V) and the paged path (paged.py:
vLLM's paged cache) differ only in how they lay a sequence's queries and keys out; both hand them
to `run_tiles`, so a position's bits are one function of its own queries and keys:

* a query tile holds `tile_m` positions of one sequence aligned to its own positions (position t
  is row t % tile_m of tile t // tile_m), each position as its G query heads (rows t-major, G per
  position: [tile_m * G, D] per key/value head). A tile reads the keys from `Plan.start` (0, or
  with a window or a chunk the lowest key its first position may see, down to a key tile) to the
  end of the key tile of `tile_n` positions that holds it: the keys a tile reads, and so every
  shape its products have, are a function of the tile alone, never of the construction;
* keys are read in spans of `span` positions aligned to absolute positions, in order, with an fp32
  online softmax across spans in base 2 (the queries carry log2(e)); within a span a product per
  operand (scores, then probabilities x values), whose reduction over the span's keys is the
  machine BLAS's for that fixed shape. A key a query may not see is -inf, so it weighs exactly 0;
* the query tiles that end in the same key tile read the same keys: they are stacked in one
  product where a probe on this machine shows every tile gets the bits it gets alone (`stacks`:
  per product shape and thread count, the stacked products, row sums and all, against each tile
  computed alone on random data); elsewhere tile by tile, the same bits;
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
class Group:
    """Query tiles first .. first + count - 1 of a sequence, reading keys start .. stop - 1."""

    first: int
    count: int
    start: int
    stop: int


@dataclass(frozen=True)
class Plan:
    """A sequence's work: its query tiles (own positions) in groups that read the same keys."""

    first: int                 # its first query tile
    tiles: int                 # how many
    groups: tuple[Group, ...]
    pattern: Pattern
    begin: int                 # the own positions whose outputs are written: begin .. end - 1
    end: int

    @property
    def start(self) -> int:    # the first key any tile reads (own position)
        return self.groups[0].start

    @property
    def stop(self) -> int:     # past the last key any tile reads
        return self.groups[-1].stop


@functools.lru_cache(maxsize=1024)
def plan(valid_first: int, end: int, pattern: Pattern, config: NativeConfig) -> Plan:
    """The tiles holding own positions valid_first .. end - 1, grouped by the keys they read."""
    tm, tn = config.tile_m, config.tile_n
    first, last = valid_first // tm, (end - 1) // tm
    groups: list[Group] = []
    for tile in range(first, last + 1):
        start = pattern.lowest(tile * tm) // tn * tn
        stop = (tile * tm // tn + 1) * tn
        if groups and (groups[-1].start, groups[-1].stop) == (start, stop):
            g = groups[-1]
            groups[-1] = Group(g.first, g.count + 1, start, stop)
        else:
            groups.append(Group(tile, 1, start, stop))
    return Plan(first, last - first + 1, tuple(groups), pattern, valid_first, end)


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
    positions begin .. end - 1, multiplied by `factor` (query_scale) into fp32 tiles (absent
    positions zero); k [Hkv, work.stop - work.start, D], v [..., Dv] fp32: its keys from own
    position work.start (absent keys zero); sinks [Hq] or None -> out [Hkv, work.end -
    work.begin, G, Dv] (any dtype and strides)."""
    heads, _, group_size, dim = queries.shape
    tm = config.tile_m
    rows = tm * group_size
    threads = torch.get_num_threads()
    # one buffer for every group's query tiles and one for every piece's scores: fresh memory for
    # each would be paged in each time
    widest = max(g.count for g in work.groups)
    tiles = torch.empty(heads, widest * tm, group_size, dim)
    scores = torch.empty(heads * widest * rows * max(min(config.span, g.stop - g.start) for g in work.groups))
    for g in work.groups:
        together = g.count == 1 or stacks(heads, group_size, dim, v.shape[-1], config, threads,
                                          g.count, _lengths(g, config))
        for one in [g] if together else [Group(t, 1, g.start, g.stop) for t in range(g.first, g.first + g.count)]:
            lo, hi = max(work.begin, one.first * tm), min(work.end, (one.first + one.count) * tm)
            q = tiles.narrow(1, 0, one.count * tm)                      # [Hkv, count * tm, G, D]
            if hi - lo < one.count * tm:
                q.zero_()
            torch.mul(queries.narrow(1, lo - work.begin, hi - lo), factor,
                      out=q.narrow(1, lo - one.first * tm, hi - lo))
            attend(q.view(heads, -1, dim), k, v, work.start, one, work.pattern, config, softcap, sinks,
                   out, work.begin, work.end, scores)


def _pieces(g: Group, config: NativeConfig) -> list[tuple[int, int]]:
    """The spans a group reads, cut at multiples of `span` (absolute), each [from, to)."""
    cuts = list(range((g.start // config.span + 1) * config.span, g.stop, config.span))
    edges = [g.start, *cuts, g.stop]
    return list(zip(edges, edges[1:]))


def _lengths(g: Group, config: NativeConfig) -> tuple[tuple[bool, int], ...]:
    """The product shapes a group's pieces take: (later piece?, keys)."""
    return tuple((i > 0, b - a) for i, (a, b) in enumerate(_pieces(g, config)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, base: int, g: Group, pattern: Pattern,
           config: NativeConfig, softcap: float | None, sinks: torch.Tensor | None,
           out: torch.Tensor, begin: int, end: int, scores: torch.Tensor | None = None) -> None:
    """One group: q [Hkv, count * tile_m * G, D] over k, v (index 0 at own position `base`);
    its outputs at own positions begin .. end - 1 written to out[:, position - begin] ([Hkv, *, G, Dv]).
    `scores`: a flat fp32 buffer to compute each piece's scores in (else fresh)."""
    heads, m_rows, _ = q.shape
    group_size = m_rows // (g.count * config.tile_m)
    tn = config.tile_n
    plain = pattern.window is None and pattern.chunk is None and pattern.key_first <= g.start
    last_position = (g.first + g.count) * config.tile_m - 1
    # keys every row of the group sees need no mask: [open_from, stop - tile_n)
    open_from = g.start if plain else min(max(g.start, pattern.key_first, pattern.lowest(last_position)),
                                          g.stop - tn)
    m = l = acc = alpha = None
    for a, b in _pieces(g, config):
        whole = a == base and b - a == k.shape[1]
        s = (scores.narrow(0, 0, heads * m_rows * (b - a)).view(heads, m_rows, b - a) if scores is not None
             else torch.empty(heads, m_rows, b - a))
        torch.bmm(q, (k if whole else k.narrow(1, a - base, b - a)).transpose(1, 2), out=s)  # [Hkv, M, b - a]
        if softcap is not None:
            s.div_(softcap)
            _lane_uniform(torch.tanh, s)
            s.mul_(softcap * LOG2E)
        if plain:   # only the diagonal key tile, the last of the last piece: a fixed additive mask
            if b == g.stop:
                s.narrow(2, b - tn - a, tn).add_(_causal(g.count * config.tile_m, group_size, tn,
                                                          g.first * config.tile_m - (b - tn)))
        else:
            for lo, hi in ((a, min(b, open_from)), (max(a, g.stop - tn), b)):
                if lo < hi:
                    s.narrow(2, lo - a, hi - lo).masked_fill_(_hidden(g, pattern, config, group_size, lo, hi),
                                                              float("-inf"))
        top = s.amax(-1)                                                     # [Hkv, M]
        if not plain:
            top.clamp_min_(FLOOR)
        if m is not None:
            torch.maximum(m, top, out=top)
            alpha = _lane_uniform(torch.exp2, m - top)
        m = top
        s.sub_(m.unsqueeze(-1))
        _lane_uniform(torch.exp2, s)
        total = torch.sum(s, -1, out=torch.empty(heads, m_rows))
        values = v if whole else v.narrow(1, a - base, b - a)
        if acc is None:
            l, acc = total, torch.bmm(s, values)                              # [Hkv, M, Dv]
        else:
            l.mul_(alpha).add_(total)
            acc.mul_(alpha.unsqueeze(-1)).baddbmm_(s, values)
    if sinks is not None:  # a per-head logit in the denominator only
        sink = (sinks.float() * LOG2E).view(heads, 1, group_size).expand(heads, m_rows // group_size,
                                                                         group_size).reshape(heads, m_rows)
        top = torch.maximum(m, sink)
        alpha = _lane_uniform(torch.exp2, m - top)
        l.mul_(alpha).add_(_lane_uniform(torch.exp2, sink - top))
        acc.mul_(alpha.unsqueeze(-1))
    tm = config.tile_m
    lo, hi = max(begin, g.first * tm), min(end, (g.first + g.count) * tm)
    if lo < hi:
        first, count = lo - g.first * tm, hi - lo
        acc, l = acc.view(heads, -1, group_size, acc.shape[-1]), l.view(heads, -1, group_size, 1)
        if count < acc.shape[1]:
            acc, l = acc.narrow(1, first, count), l.narrow(1, first, count)
        torch.div(acc, l, out=out if count == out.shape[1] else out.narrow(1, lo - begin, count))


def _hidden(g: Group, pattern: Pattern, config: NativeConfig, group_size: int, lo: int, hi: int) -> torch.Tensor:
    """[count * tile_m * G, hi - lo] True where a row's query may not see the key."""
    positions = (g.first * config.tile_m + torch.arange(g.count * config.tile_m)).repeat_interleave(group_size)
    return pattern.hidden(positions[:, None], torch.arange(lo, hi)[None, :])


@functools.lru_cache(maxsize=256)
def _causal(positions: int, group_size: int, width: int, offset: int) -> torch.Tensor:
    """Rows of `positions` consecutive queries (G rows each) from key `offset` of a [width] slice:
    -inf where the key is after the query, else 0 (added: a visible score stays as it is)."""
    own = (offset + torch.arange(positions)).repeat_interleave(group_size)[:, None]
    return torch.zeros(positions * group_size, width).masked_fill_(torch.arange(width)[None, :] > own,
                                                                    float("-inf"))


def _lane_uniform(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (element-wise, in place through out=) over contiguous x: on calls of a multiple of LANES
    elements, at most BLOCK per call where a thread split could land inside one (one thread: no
    split), so no element is in a scalar tail; returns x."""
    flat = x.view(-1)
    n = flat.numel()
    if n % LANES == 0 and (n <= BLOCK or torch.get_num_threads() == 1):
        return fn(x, out=x)
    whole = -(-n // LANES) * LANES
    work = flat if whole == n else torch.cat([flat, flat.new_zeros(whole - n)])
    step = whole if torch.get_num_threads() == 1 else BLOCK
    for i in range(0, whole, step):
        part = work[i:i + step]
        fn(part, out=part)
    if work is not flat:
        flat.copy_(work[:n])
    return x


@functools.lru_cache(maxsize=None)
def stacks(heads: int, group_size: int, dim: int, v_dim: int, config: NativeConfig, threads: int,
           count: int, lengths: tuple[tuple[bool, int], ...]) -> bool:
    """Whether `count` query tiles stacked in one product get, on this machine at this thread
    count, the bits each gets alone, for every piece shape in `lengths` (probed once per shape)."""
    return all(_stacks_probe(heads, group_size, dim, v_dim, config, threads, count, later, keys)
               for later, keys in lengths)


@functools.lru_cache(maxsize=None)
def _stacks_probe(heads: int, group_size: int, dim: int, v_dim: int, config: NativeConfig,
                  threads: int, count: int, later: bool, keys: int) -> bool:
    """`count` tiles (random data) whose last piece reads `keys` keys, as the first piece or
    after a first piece of one key tile (`later`), stacked against each tile alone."""
    tm, tn, rows = config.tile_m, config.tile_n, config.tile_m * group_size
    start, stop = (config.span - tn, config.span + keys) if later else (0, keys)
    first = (stop - tn) // tm                      # the group's tiles end in the last key tile
    generator = torch.Generator().manual_seed(count * 7919 + keys)
    q = torch.randn(heads, count * rows, dim, generator=generator)
    k = torch.randn(heads, stop - start, dim, generator=generator)
    v = torch.randn(heads, stop - start, v_dim, generator=generator)
    together = torch.empty(heads, count * tm, group_size, v_dim)
    attend(q, k, v, start, Group(first, count, start, stop), Pattern(), config, None, None,
           together, first * tm, (first + count) * tm)
    for i in range(count):
        alone = torch.empty(heads, tm, group_size, v_dim)
        at = (first + i) * tm
        attend(q[:, i * rows:(i + 1) * rows].clone(), k, v, start, Group(first + i, 1, start, stop),
               Pattern(), config, None, None, alone, at, at + tm)
        if not torch.equal(alone, together[:, i * tm:(i + 1) * tm]):
            return False
    return True
