"""Batch-invariant, prefill-decode-invariant causal attention in plain PyTorch (the native CPU path).

The tiling contract of the Triton kernel (kernels/attention/kernel.py), written with torch ops so
a CPU runs it at BLAS speed instead of in the Triton interpreter; the tile math itself is
kernels/attention/native_tiles.py, which the paged path (paged.py) shares:

* query tiles of `tile_m` positions aligned to each row's own positions: position t is row
  `t % tile_m` of query tile `t // tile_m`, a decode query padded up to that tile with zero rows;
* a tile reads the keys from a start fixed by its own first position to the end of the key tile
  of `tile_n` positions that holds it, in spans of `span` positions aligned to absolute positions,
  in order, with an fp32 online softmax across spans; keys absent from the call are zeros and
  masked. Every product a position goes through has a shape fixed by its tile alone (never by
  the batch, the length or the chunking), and the position sits at the same row of it;
* the positions of one key tile share one product where this machine's probe shows each gets
  the bits it gets in its tile alone (native_tiles.rows_keep_bits), a decode step only its own
  rows (padded to the fewest the probe allows), else tile by tile: the same bits either way.

Batch rows are computed one after another, each in its own positions, but for a decode step of
several rows at one position (no padding, no window, chunk, cap or sinks, keys from position 0):
those are stacked in one call's batch dimension where this machine's probe shows each row gets
the bits it gets alone (native_tiles.run_stacked, as the paged path stacks its decode steps), else
one after another. A row's positions are its own: absolute position minus its left padding (`first_valid`, the absolute position
of its first valid key), so neither padding nor neighbours can change its bits. Optional: a
sliding `window` (p - window < k <= p), a `chunk`ed local attention (k // chunk == p // chunk),
logit `softcap` (softcap * tanh(s / softcap), in fp32) and per-head `sinks` (a logit in the
softmax denominator).

Whether a stock bmm really gives a row the same bits at the same place of the same shape is a
property of the machine's BLAS; kvfid.environment.invariance proves it per machine (implementation
`native`) like every other kernel's claim.
"""

from __future__ import annotations

import math

import torch

from kvfid.kernels import FLOAT_DTYPES
from kvfid.kernels.attention.native_call import DEFAULT_CONFIG, NativeConfig, Pattern
from kvfid.kernels.attention.native_tiles import plan, query_scale, run_stacked, run_tiles
from kvfid.kernels.attention.reference import attention_ref  # noqa: F401  (the same contract's reference)
from kvfid.kernels.attention.views import as_visibility, check_visibility, runs
from kvfid.kernels.invariant.mode import stock_ops


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


def _row(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
         pad: int, key_start: int, window: int | None, chunk: int | None, softcap: float | None,
         sinks: torch.Tensor | None, config: NativeConfig) -> None:
    """One batch row: q [Hq, Tq, D], k [Hkv, Tk, D], v [Hkv, Tk, Dv] -> out [Hq, Tq, Dv], in the
    row's own positions (absolute minus `pad`)."""
    n_q, q_len, dim = q.shape
    n_kv, kv_len, _ = k.shape
    group = n_q // n_kv
    key_first = max(key_start - pad, 0)      # own position of the first valid key held
    end = key_start + kv_len - pad           # own positions of the keys end here
    q_first = end - q_len                    # own position of query 0
    valid_first = max(q_first, key_first, 0)
    if valid_first >= end:
        return                               # every query of this row is padding
    work = plan(valid_first, end, Pattern(window, chunk, key_first), config)
    count = end - valid_first
    queries, written = q.unflatten(0, (n_kv, group)), out.unflatten(0, (n_kv, group))
    if count < q_len:                        # [Hkv, G, count, D]: the valid queries
        queries, written = (x.narrow(2, valid_first - q_first, count) for x in (queries, written))
    keys = _keys(k, work.start, work.stop, key_first, end, key_start - pad)
    values = _keys(v, work.start, work.stop, key_first, end, key_start - pad)
    run_tiles(queries.transpose(1, 2), query_scale(scale, softcap), keys, values, work, config,
              written.transpose(1, 2), softcap, sinks)


def _stacked_decode(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    pads: list[int], key_start: int, window: int | None, chunk: int | None,
                    softcap: float | None, sinks: torch.Tensor | None, config: NativeConfig) -> bool:
    """A decode step of B >= 2 rows at one own position, plain causal over keys from position 0,
    in one stacked call (native_tiles.run_stacked: each row's bits those of `_row` on it alone);
    False where it does not apply or the machine's probe refuses stacking (then row by row)."""
    batch, n_q, q_len, _ = q.shape
    if batch < 2 or q_len != 1 or any(pads) or key_start or window is not None or chunk is not None \
            or softcap is not None or sinks is not None:
        return False
    n_kv, end = k.shape[1], k.shape[2]
    work = plan(end - 1, end, Pattern(), config)
    if len(work.runs) != 1:
        return False
    run = work.runs[0]
    keys, values = (_keys(x.flatten(0, 1), run.start, run.stop, 0, end, 0) for x in (k, v))
    queries = q.select(2, 0).unflatten(1, (n_kv, n_q // n_kv))     # [B, Hkv, G, D]
    done = run_stacked(queries, query_scale(scale, softcap), keys, values, (end - 1,) * batch, run,
                       config)
    if done is None:
        return False
    out.select(2, 0).copy_(done.flatten(1, 2))                      # [B, Hq, Dv]
    return True


def _keys(x: torch.Tensor, start: int, stop: int, first: int, end: int, offset: int) -> torch.Tensor:
    """x [Hkv, T, D] (own position offset + i at index i, valid from `first` to `end`) as fp32
    [Hkv, stop - start, D] from own position `start`; absent positions zero."""
    lo, hi = max(start, first), min(stop, end)
    held = x if (lo - offset, hi - lo) == (0, x.shape[1]) else x.narrow(1, lo - offset, hi - lo)
    if (lo, hi) == (start, stop):
        return held.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], stop - start, x.shape[-1])
    out.narrow(1, lo - start, hi - lo).copy_(held)
    if lo > start:
        out[:, :lo - start] = 0.0
    if hi < stop:
        out[:, hi - start:] = 0.0
    return out


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
        if _stacked_decode(out, q, k, v, scale, pads, key_start, window, chunk, softcap, sinks, config):
            return out
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
    padded = first_valid is not None or visibility is not None   # positions never written are zeros
    out = (q.new_zeros if padded else q.new_empty)(*q.shape[:3], v.shape[-1])
    return attention_into(out, q, k, v, scale, first_valid, key_start=key_start, window=window,
                          chunk=chunk, softcap=softcap, sinks=sinks, config=config,
                          visibility=visibility)
