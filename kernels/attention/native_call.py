"""One call of kvfid's CPU attention tile math (under native_tiles.py, which plans the calls):
the rows of a run of positions of one sequence (or of several sequences with the same keys' shape,
stacked in the product's batch dimension) over the keys their tiles read, in plain PyTorch.

* keys are read in spans of `span` positions aligned to absolute positions, in order, with an fp32
  online softmax across spans in base 2 (the queries carry log2(e)); within a span a product per
  operand (scores, then probabilities x values), whose reduction over the span's keys is the
  machine BLAS's for that fixed shape. A key a query may not see is -inf (a cached additive mask
  for the causal diagonal key tile), so it weighs exactly 0;
* exp2 (and tanh under a soft cap) run only on contiguous calls of a multiple of LANES elements,
  at most BLOCK per call where more than one thread could split a call: every element takes the
  vector body (kvfid.kernels.invariant.ops: the scalar tail rounds differently). max, +, -, *, /
  and masking round the same on every path.

Whether the rows of a call keep the bits they get elsewhere (another row count, another batch) is
the machine's BLAS's property, which native_tiles.py probes; nothing here assumes it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvfid.kernels.invariant.ops import lane_uniform_

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


@functools.lru_cache(maxsize=4096)
def pieces(run: Run, config: NativeConfig) -> tuple[tuple[int, int], ...]:
    """The spans a run reads, cut at multiples of `span` (absolute), each [from, to)."""
    cuts = list(range((run.start // config.span + 1) * config.span, run.stop, config.span))
    edges = [run.start, *cuts, run.stop]
    return tuple(zip(edges, edges[1:]))


def lengths(run: Run, config: NativeConfig) -> tuple[tuple[bool, int], ...]:
    """The product shapes a run's pieces take: (later piece?, keys)."""
    return tuple((i > 0, b - a) for i, (a, b) in enumerate(pieces(run, config)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, base: int, lo: int | tuple[int, ...], n: int,
           run: Run, pattern: Pattern, config: NativeConfig, softcap: float | None, sinks: torch.Tensor | None,
           out: torch.Tensor | None, begin: int, end: int, scores: torch.Tensor | None = None) -> torch.Tensor | None:
    """One call: q [Hkv, n * G, D], the rows of own positions lo .. lo + n - 1 (G each), over the
    keys run.start .. run.stop - 1 of k, v (index 0 at own position `base`); the outputs of its
    positions in the run and in begin .. end - 1 written to out[:, position - begin] ([Hkv, *, G, Dv]).
    Several sequences at once (plain causal only): `lo` a tuple, one first position per sequence,
    q, k, v [S * Hkv, ...] (sequence-major), `out` None: returns [S * Hkv, n * G, Dv].
    `scores`: a flat fp32 buffer to compute each piece's scores in (else fresh)."""
    heads, m_rows, _ = q.shape
    group_size, tn = m_rows // n, config.tile_n
    plain = pattern.window is None and pattern.chunk is None and pattern.key_first <= run.start
    if isinstance(lo, tuple) and not (plain and softcap is None and sinks is None and out is None):
        raise ValueError("several sequences in one call: plain causal attention, returned, only")
    # keys every row of the call sees need no mask: [open_from, stop - tile_n)
    open_from = run.start if plain else min(max(run.start, pattern.key_first, pattern.lowest(lo + n - 1)),
                                            run.stop - tn)
    m = l = acc = alpha = None
    for a, b in pieces(run, config):
        whole = a == base and b - a == k.shape[1]
        s = (scores.narrow(0, 0, heads * m_rows * (b - a)).view(heads, m_rows, b - a) if scores is not None
             else torch.empty(heads, m_rows, b - a))
        torch.bmm(q, (k if whole else k.narrow(1, a - base, b - a)).transpose(1, 2), out=s)  # [Hkv, M, b - a]
        if softcap is not None:
            s.div_(softcap)
            lane_uniform_(torch.tanh, s)
            s.mul_(softcap * LOG2E)
        if plain:   # only the diagonal key tile, the last of the last piece: a fixed additive mask
            if b == run.stop and isinstance(lo, tuple):
                s.view(len(lo), -1, m_rows, b - a).narrow(3, b - tn - a, tn).add_(
                    _causal_each(n, group_size, tn, tuple(x - (b - tn) for x in lo)))
            elif b == run.stop:
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
            alpha = lane_uniform_(torch.exp2, m - top)
        m = top
        s.sub_(m.unsqueeze(-1))
        lane_uniform_(torch.exp2, s, scores)
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
        alpha = lane_uniform_(torch.exp2, m - top)
        l.mul_(alpha).add_(lane_uniform_(torch.exp2, sink - top))
        acc.mul_(alpha.unsqueeze(-1))
    if out is None:
        return acc.div_(l.unsqueeze(-1))
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
def _causal_each(positions: int, group_size: int, width: int, offsets: tuple[int, ...]) -> torch.Tensor:
    """_causal per sequence, stacked: [S, 1, positions * G, width]."""
    return torch.stack([_causal(positions, group_size, width, x) for x in offsets])[:, None]


@functools.lru_cache(maxsize=256)
def _causal(positions: int, group_size: int, width: int, offset: int) -> torch.Tensor:
    """Rows of `positions` consecutive queries (G rows each) from key `offset` of a [width] slice:
    -inf where the key is after the query, else 0 (added: a visible score stays as it is)."""
    own = (offset + torch.arange(positions)).repeat_interleave(group_size)[:, None]
    return torch.zeros(positions * group_size, width).masked_fill_(torch.arange(width)[None, :] > own,
                                                                    float("-inf"))
