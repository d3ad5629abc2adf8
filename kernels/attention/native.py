"""Batch-invariant, prefill-decode-invariant causal attention in plain PyTorch (the native CPU path).

The same tiling contract as the Triton kernel (kernels/attention/kernel.py), written with torch ops so a
CPU runs it at BLAS speed instead of in the Triton interpreter:

* query tiles of `tile_m` positions aligned to each row's own positions: position t is row
  `t % tile_m` of query tile `t // tile_m`, a decode query padded up to that tile with zero rows;
* key/value tiles of `tile_n` positions (a multiple of `tile_m`), aligned the same way, zero-filled
  where a key is absent, visited in order with an fp32 online softmax;
* every product is one `torch.bmm` of one fixed shape per model, [Hkv, G * tile_m, D] x
  [Hkv, D, tile_n] (G query heads per key/value head stacked as rows) and [Hkv, G * tile_m,
  tile_n] x [Hkv, tile_n, Dv], on fresh fp32 tiles; every elementwise op and row reduction also
  runs on tensors of that one shape. No call ever sees a shape that depends on the batch, the
  length or the chunking, and a row sits at the same place of the same shape in every
  construction, so the BLAS call it goes through is the same call.

Batch rows are computed one after another (a row never shares a product with another row), each in
its own positions: absolute position minus its left padding (`first_valid`, the absolute position
of its first valid key), so neither padding nor neighbours can change its bits. A key tile that is
fully masked for a row is an exact no-op of the online softmax (the state stays bit for bit), so
the tiles a row really reads are the same in every construction. Optional: a sliding `window`
(p - window < k <= p), a `chunk`ed local attention (k // chunk == p // chunk), logit `softcap`
(softcap * tanh(s / softcap), in fp32) and per-head `sinks` (a logit in the softmax denominator).

Whether a stock bmm really gives a row the same bits at the same place of the same shape is a
property of the machine's BLAS; kvfid.environment.invariance proves it per machine (implementation
`native`) like every other kernel's claim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfid.kernels import FLOAT_DTYPES
from kvfid.kernels.attention.reference import attention_ref  # noqa: F401  (the same contract's reference)
from kvfid.kernels.attention.views import as_visibility, check_visibility, runs
from kvfid.kernels.invariant.mode import stock_ops


@dataclass(frozen=True)
class NativeConfig:
    """The fixed tiling: never a function of batch or length."""

    tile_m: int = 16  # query positions per tile (per query head), as the Triton kernel's BLOCK_M
    tile_n: int = 64  # keys per tile; a multiple of tile_m

    def __post_init__(self) -> None:
        if self.tile_m < 1 or self.tile_n % self.tile_m:
            raise ValueError(f"tile_n ({self.tile_n}) must be a positive multiple of tile_m ({self.tile_m})")


DEFAULT_CONFIG = NativeConfig()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D q, k, v [B, H, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    (bq, hq, tq, dq), (bk, hkv, tk, dk) = q.shape, k.shape
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on batch, heads or length")
    if bq != bk or dq != dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if tq > tk:
        raise ValueError(f"queries ({tq}) must be the last positions of the keys ({tk}): Tq <= Tk")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention supports {FLOAT_DTYPES} with one dtype for q, k, v; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must be [Hq={hq}]; got {tuple(sinks.shape)}")


def _first_valid(first_valid: torch.Tensor | None, batch: int) -> list[int]:
    if first_valid is None:
        return [0] * batch
    if first_valid.shape != (batch,) or first_valid.dtype.is_floating_point:
        raise ValueError(f"first_valid must be integer [B={batch}]; got {first_valid.dtype}"
                         f"{tuple(first_valid.shape)}")
    pads = [int(p) for p in first_valid.tolist()]
    if min(pads, default=0) < 0:
        raise ValueError(f"first_valid must be >= 0; got {pads}")
    return pads


def _tiles(x: torch.Tensor, first: int, n_tiles: int, tile: int, start: int) -> torch.Tensor:
    """x [H, G, T, D] (position `start` + i at index i) as fp32 tiles [n_tiles, H, G * tile, D]
    covering positions first*tile .. (first+n_tiles)*tile - 1 (rows g-major); absent positions
    are zeros."""
    heads, group, length, dim = x.shape
    out = torch.zeros(heads, group, n_tiles * tile, dim, dtype=torch.float32, device=x.device)
    lo, hi = max(first * tile, start), min((first + n_tiles) * tile, start + length)
    if hi > lo:
        out[:, :, lo - first * tile:hi - first * tile] = x[:, :, lo - start:hi - start]
    out = out.view(heads, group, n_tiles, tile, dim).permute(2, 0, 1, 3, 4)
    return out.reshape(n_tiles, heads, group * tile, dim)  # a contiguous copy


# The online softmax's starting maximum: finite, so a row that has seen no key yet needs no
# special case (exp(-inf - floor) = 0, exp(floor - floor) = 1: a fully masked tile changes nothing).
_FLOOR = -1e30


def _row(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
         pad: int, key_start: int, window: int | None, chunk: int | None, softcap: float | None,
         sinks: torch.Tensor | None, config: NativeConfig) -> None:
    """One batch row: q [Hq, Tq, D], k [Hkv, Tk, D], v [Hkv, Tk, Dv] -> out [Hq, Tq, Dv]."""
    n_q, q_len, _ = q.shape
    n_kv, kv_len, _ = k.shape
    group, tm, tn, dev = n_q // n_kv, config.tile_m, config.tile_n, q.device
    key_first = max(key_start - pad, 0)  # own position of the first valid key present
    end = key_start + kv_len - pad  # own positions of the keys end here
    q_first = end - q_len  # own position of query 0
    valid_first = max(q_first, key_first, 0)
    if valid_first >= end:
        return  # every query of this row is padding

    def lowest_key(position: int) -> int:
        """The first key any query at or after `position` can see (window and chunk limits)."""
        low = key_first
        if window is not None:
            low = max(low, position - window + 1)
        if chunk is not None:
            low = max(low, position // chunk * chunk)
        return low

    first_qt, last_qt = valid_first // tm, (end - 1) // tm
    first_kt, last_kt = lowest_key(first_qt * tm) // tn, (end - 1) // tn
    # Queries scaled once, in their fixed tiles; keys and values in theirs (absent ones zero).
    q_own = _tiles(q.reshape(n_kv, group, q_len, -1) * scale if scale != 1.0 else
                   q.reshape(n_kv, group, q_len, -1), first_qt, last_qt - first_qt + 1, tm, q_first)
    k_own = _tiles(k[:, None], first_kt, last_kt - first_kt + 1, tn, key_start - pad)
    v_own = _tiles(v[:, None], first_kt, last_kt - first_kt + 1, tn, key_start - pad)
    k_own = k_own.transpose(2, 3)  # [n, Hkv, D, tn]
    rows = torch.arange(tm, device=dev).repeat(group)[:, None]  # [G*tm, 1] offset in the tile
    cols = torch.arange(tn, device=dev)[None, :]  # [1, tn]
    sink = None
    if sinks is not None:  # [Hkv, G * tm]: each row's head's sink logit
        sink = sinks.float().reshape(n_kv, group, 1).expand(n_kv, group, tm).reshape(n_kv, group * tm)
    results = []
    for qt in range(first_qt, last_qt + 1):
        tile = q_own[qt - first_qt]  # [Hkv, G*tm, D]
        m = torch.full((n_kv, group * tm), _FLOOR, device=dev)
        l = torch.zeros(n_kv, group * tm, device=dev)
        acc = torch.zeros(n_kv, group * tm, v.shape[-1], device=dev)
        low = lowest_key(qt * tm)
        for kt in range(low // tn, (min((qt + 1) * tm, end) - 1) // tn + 1):
            s = torch.bmm(tile, k_own[kt - first_kt])  # [Hkv, G*tm, tn]
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            # Keys every row of the tile may see need no mask (masking them would change nothing).
            if (kt + 1) * tn > qt * tm or kt * tn < low or window is not None or chunk is not None:
                pos, key_pos = qt * tm + rows, kt * tn + cols  # own positions [G*tm, 1], [1, tn]
                keep = (key_pos <= pos) & (key_pos >= key_first) & (key_pos < end)
                if window is not None:
                    keep &= key_pos > pos - window
                if chunk is not None:
                    keep &= key_pos // chunk == pos // chunk
                s = s.masked_fill(~keep, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = torch.addcmul(p.sum(-1), l, alpha)
            acc = torch.baddbmm(acc * alpha[..., None], p, v_own[kt - first_kt])  # [Hkv, G*tm, Dv]
            m = m_new
        if sink is not None:
            m_all = torch.maximum(m, sink)
            alpha = torch.exp(m - m_all)
            l = torch.addcmul(torch.exp(sink - m_all), l, alpha)
            acc = acc * alpha[..., None]
        results.append(acc / l[..., None])
    done = torch.stack(results).view(-1, n_kv, group, tm, v.shape[-1])  # [n_qt, Hkv, G, tm, Dv]
    done = done.permute(1, 2, 0, 3, 4).reshape(n_q, -1, v.shape[-1])  # [Hq, n_qt*tm, Dv]
    lo = valid_first - first_qt * tm
    out[:, valid_first - q_first:] = done[:, lo:lo + end - valid_first].to(out.dtype)


def attention_into(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float | None = None, first_valid: torch.Tensor | None = None, *,
                   key_start: int = 0, window: int | None = None, chunk: int | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None,
                   config: NativeConfig | None = None,
                   visibility: torch.Tensor | None = None) -> torch.Tensor:
    """`attention` written into `out` ([B, Hq, Tq, Dv], any strides); returns `out`. Padded query
    positions (before a row's `first_valid`) are not written. `visibility` [B, Tq, Tk] bool: the
    mask instead of the positions' pattern, each run of queries over its view's keys alone
    (kvfid.kernels.attention.views), so a query's bits are those of the causal path over the keys it
    sees; fully invisible key tiles are never computed."""
    _check(q, k, v, sinks)
    expected = (*q.shape[:3], v.shape[-1])
    if tuple(out.shape) != expected:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {expected}")
    if window is not None and window < 1 or chunk is not None and chunk < 1:
        raise ValueError(f"window and chunk must be positive; got {window}, {chunk}")
    pads = _first_valid(first_valid, q.shape[0])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    config = config or DEFAULT_CONFIG
    if visibility is not None:
        check_visibility(first_valid, window, chunk, True)
        row_runs = runs(as_visibility(visibility.to(q.device), *q.shape[:1], q.shape[2], k.shape[2]))
        with stock_ops():
            for b, row in enumerate(row_runs):
                for run in row:  # its queries are the last keys of its view
                    at = slice(run.first, run.first + run.count)
                    _row(out[b, :, at], q[b, :, at], k[b][:, run.keys], v[b][:, run.keys], scale, 0,
                         0, None, None, softcap, sinks, config)
        return out
    with stock_ops():  # every call below has a fixed shape already: no mode override needed
        for b, pad in enumerate(pads):
            _row(out[b], q[b], k[b], v[b], scale, pad, key_start, window, chunk, softcap, sinks, config)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              scale: float | None = None, first_valid: torch.Tensor | None = None,
              key_start: int = 0, window: int | None = None, chunk: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              config: NativeConfig | None = None,
              visibility: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention (or under `visibility`, as in `attention_into`); q [B, Hq, Tq, Dqk] are the last Tq positions of k [B, Hkv, Tk, Dqk],
    v [B, Hkv, Tk, Dv]; k[:, :, 0] is at absolute position `key_start`. Returns [B, Hq, Tq, Dv]
    in q's dtype, with bits per position independent of batch size and of how the positions were
    split into prefill, chunks or decode steps. `first_valid` [B]: row b's first valid key
    (absolute position; earlier keys are padding, never read; those queries are 0)."""
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    return attention_into(out, q, k, v, scale, first_valid, key_start=key_start, window=window,
                          chunk=chunk, softcap=softcap, sinks=sinks, config=config,
                          visibility=visibility)
