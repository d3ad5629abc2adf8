"""Batch-invariant, prefill-decode-invariant causal attention (Triton); its reference is
kvfid.kernels.attention.reference.

One kernel serves prefill, chunked prefill and single-token decode, over a full cache or a window
cache that holds only the last keys (`key_start`: the absolute position of held key 0), with
sliding windows, block-local (chunked) attention, logit softcapping, attention sinks and
different q/k and v head dims. The output for absolute position t has the same bits however t is
reached, because every construction runs the same arithmetic for t:

* query tiles are aligned to absolute positions: position t is always row `t % BLOCK_M` of tile
  `t // BLOCK_M` (a decode query is padded up to it): a row never moves in its tile;
* key/value tiles have a fixed size (per execution path) and sit at absolute multiples of
  `BLOCK_N` (not at the first held key, which moves as a window cache slides), visited in order
  with an online softmax in fp32; a key keeps its column in its tile whatever the cache holds;
* a row's state changes only in key tiles holding keys it sees. The loop of a query tile runs from
  the tile holding its first row's first visible key (window start, chunk start or first valid
  key) to its last row's position, so it can visit tiles that are fully masked for some row (before
  that row's window, after its position). For such a row the update is the identity, bit for bit:
  its scale factor is selected to exactly 1.0 and its added terms to exactly -0.0 (x * 1 == x and
  x + -0.0 == x for every x, signed zeros included). So row t sees the same key tiles, with the
  same values in the same columns, in the same order, in every construction;
* softcapping is applied to the scaled scores in fp32 (`softcap * tanh(s / softcap)`, tanh from
  one exp) before masking; a sink joins the denominator of the final state (tiles.with_sink);
* split path (a config with `segment`, the GPU configs): the key axis is cut into segments of
  `segment` keys at absolute multiples of it; one program per (query tile, segment) runs that
  segment's key tiles from a fresh state and stores (m, l, acc) in fp32, and a merge launch folds
  a query tile's segments in segment order (`merge`: an empty state takes the other as it is, an
  empty segment changes nothing, bit for bit). A row's segments, each one's state and their
  order are functions of its position alone, so the bits stay invariant while the grid grows
  with the context (a decode step at 32k keys runs one program per segment). One segment gives
  the unsplit kernel's bits, so a call whose keys all lie in segment 0 runs the unsplit launch
  (one launch, no workspace); the merge reads and the partial launch writes the real rows only;
* nothing is chosen by looking at the batch or a length (the config depends on arch, dtype and
  the layer's head dim only; a long prefill on the split path runs as query chunks, which the
  invariance makes bit-identical).

A visibility mask (`visibility`, any causal pattern given as a mask: packed branches, trees) is
computed by kvfid.kernels.attention.visible, each query in its view's coordinates, with the same tile
update (tiles.tile_update). Rows are independent programs (batch rows and heads are grid
axes), so batch size cannot change a row. The query heads that share one key/value head are stacked into one tile (GQA), so each key
tile is loaded once per group.

Left-padded batches (`first_valid`, a row's first valid key as an absolute position, as
transformers pads) keep this. A program works in its row's *own* positions (absolute position
minus the row's padding): its query tiles, its key tiles, its window, chunk and causal limits are
those of the unpadded row, and keys before the first valid one are never loaded (masked loads), so
pad keys never enter the online softmax. Row b's program therefore runs the same instructions on
the same values as the row alone; only base pointers differ, so neither its padding nor its
neighbours (other programs) can change its bits. Padded query positions are not computed. Two
twins are kept as the tests' negative controls, each correct but variant: `align_own=False` aligns
tiles to padded positions (padding-variant), `align_absolute=False` aligns key tiles to the first
held key (variant under a window cache).

Products: on CUDA `tl.dot`. bf16/fp16 operands go in as they are (tensor cores) with fp32
accumulation, and the probabilities P are cast to V's dtype for the PV product, as flash attention
does; fp32 operands use IEEE fp32 (`input_precision="ieee"`, no TF32). The MMA computes each output
element from its row and column alone, in an order fixed by the compiled config, so this keeps the
argument above: the config (tiles, warps, stages) comes from `CONFIGS` / `NARROW_CONFIGS` /
`WIDE_CONFIGS` by (arch, dtype, head dim class), never from the batch or a length. In the Triton
interpreter `tl.dot` is a NumPy BLAS product whose bits for a row can depend on the row's place in
the tile (docs/hazards.md), so there the products are fp32 broadcast multiplies reduced with
`tl.sum`, whose order is the same for every row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvfid.kernels import LAUNCH_OPTIONS
from kvfid.kernels.attention.config import (BLOCK_M, CONFIGS, INTERPRETER_CONFIG, MAX_HEAD_DIM,  # noqa: F401
                               NARROW_CONFIGS, NO_WINDOW, WIDE_CONFIGS, AttentionConfig,
                               config_for, config_table, merge_launch, WORKSPACE_BYTES, group_tile_for,
                               head_dim_pad, unsplit)
from kvfid.kernels.attention.reference import attention_ref  # noqa: F401  (the kernel's reference, here)
from kvfid.kernels.attention.checks import check_inputs, check_mechanisms, first_valid_rows
from kvfid.kernels.attention.tiles import merge, tile_scores, tile_update, with_sink
from kvfid.kernels.attention.views import check_visibility
from kvfid.kernels.attention.visible import visible_attention_into
from kvfid.kernels.jit import kernel


@kernel
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sob, soh, sot, sod,
    pad_ptr,  # [B] int64: each row's first valid key (absolute position); read only if PADDED
    sink_ptr,  # [Hq] fp32 sink logits; read only if SINKS
    ws_m_ptr, ws_l_ptr, ws_acc_ptr,  # split path: fp32 segment states [programs, slots, ROWS(, Dv)]
    n_slots,  # split path: segment slots per query tile (grid axis 2 of the partial launch)
    n_kv_heads, n_group_chunks, q_len, kv_len,
    key_start,  # absolute position of held key 0
    window,  # a query at p sees keys > p - window (a huge value: no window)
    chunk,  # block-local: keys k with k // chunk == p // chunk (0: none)
    scale, softcap,
    GROUP: tl.constexpr,  # query heads per key/value head
    GROUP_TILE: tl.constexpr,  # query heads stacked in one program (power of two)
    HEAD_DIM: tl.constexpr,  # q/k head dim
    HEAD_DIM_PAD: tl.constexpr,
    V_DIM: tl.constexpr,  # v (and output) head dim
    V_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    PADDED: tl.constexpr,  # left-padded rows: pad_ptr holds each row's padding
    SOFTCAP: tl.constexpr,  # s = softcap * tanh(s / softcap) on the scaled scores
    SINKS: tl.constexpr,  # a per-head sink logit in the softmax denominator
    SEGMENT: tl.constexpr = 0,  # keys per segment of the split path (0: no split)
    MERGE: tl.constexpr = False,  # split path: merge the segment states instead of reading keys
    ALIGN_OWN: tl.constexpr = True,  # tiles on the row's own positions; False: the padding twin
    ALIGN_ABSOLUTE: tl.constexpr = True,  # tiles from absolute 0; False: from held key 0 (twin)
):
    # Index arithmetic in int64: no overflow on large caches, and the interpreter skips its
    # per-operation int32 overflow checks (a large share of its time otherwise).
    pid = tl.program_id(1).to(tl.int64)  # over batch x kv head x group chunk
    group_chunk = pid % n_group_chunks
    kv_head = (pid // n_group_chunks) % n_kv_heads
    b = pid // (n_group_chunks * n_kv_heads)
    # Coordinates below are the row's own positions (absolute minus its padding `shift`); `lo` is
    # its first valid held key and `origin` the position tiles are aligned to (0 but in the twins).
    if PADDED:
        pad = tl.load(pad_ptr + b).to(tl.int64)
        if ALIGN_OWN:
            shift = pad
            lo = 0
        else:  # the padding-variant twin: tiles on padded positions, pad keys masked
            shift = 0
            lo = pad
    else:
        shift = 0
        lo = 0
    held = key_start - shift  # coordinate of held key 0
    lo = tl.maximum(lo, held)
    end = held + kv_len  # one past the last key
    q_first = end - q_len  # coordinate of query 0 (before lo: padded queries, never computed)
    if ALIGN_ABSOLUTE:
        origin = 0
    else:
        origin = held
    tile = (tl.maximum(q_first, lo) - origin) // BLOCK_M + tl.program_id(0).to(tl.int64)
    if origin + tile * BLOCK_M >= end:
        return  # past its row's last tile (the grid is sized for the most tiles a row can need)

    ROWS: tl.constexpr = GROUP_TILE * BLOCK_M
    rows = tl.arange(0, ROWS).to(tl.int64)
    g = group_chunk * GROUP_TILE + rows // BLOCK_M  # head within the group
    pos = origin + tile * BLOCK_M + rows % BLOCK_M  # coordinate of each query row
    row_ok = (g < GROUP) & (pos >= q_first) & (pos >= lo) & (pos < end)
    # First key each row sees: its first valid key, its window's and its chunk's start.
    row_lo = tl.maximum(lo, pos - window + 1)
    first = origin + tile * BLOCK_M  # the tile's first row: the loop starts at its first key
    tile_lo = tl.maximum(lo, first - window + 1)
    if chunk > 0:
        row_lo = tl.maximum(row_lo, (pos // chunk) * chunk)
        tile_lo = tl.maximum(tile_lo, (first // chunk) * chunk)
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    dv = tl.arange(0, V_DIM_PAD).to(tl.int64)
    q_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    o_mask = row_ok[:, None] & (dv < V_DIM)[None, :]

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, V_DIM_PAD], tl.float32)

    # Key tiles sit at origin + multiples of BLOCK_N. The loop runs from the tile holding the
    # first row's first key to the last row's last key; a tile no key of which a row sees leaves
    # that row's state bit for bit (below), so a row's state is updated by exactly
    # the key tiles holding keys it sees, in order, whatever query tile or chunk it sits in.
    hi = tl.minimum(end, first + BLOCK_M)
    loop_lo = origin + ((tile_lo - origin) // BLOCK_N) * BLOCK_N
    if SEGMENT > 0:
        # The split path: segments of SEGMENT keys at origin + multiples of SEGMENT; the partial
        # launch (grid axis 2: slot) runs one segment's tiles from a fresh state and stores it,
        # the merge launch folds the query tile's segments in order (tiles.merge).
        seg_first = (loop_lo - origin) // SEGMENT
        n_segs = (hi - 1 - origin) // SEGMENT - seg_first + 1
        ws_rows = ((pid * tl.num_programs(0) + tl.program_id(0)) * n_slots) * ROWS + rows
    if MERGE:
        # Only the real rows' states are stored and read (a decode step has one real row of
        # BLOCK_M per head); a padding row merges empty states and is never written out.
        for slot in range(0, n_segs):
            at = ws_rows + slot * ROWS
            acc_s = tl.load(ws_acc_ptr + (at[:, None] * V_DIM_PAD + dv[None, :]),
                            mask=row_ok[:, None], other=0.0)
            m_s = tl.load(ws_m_ptr + at, mask=row_ok, other=float("-inf"))
            m_i, l_i, acc = merge(m_i, l_i, acc, m_s, tl.load(ws_l_ptr + at, mask=row_ok, other=0.0),
                                  acc_s)
    else:
        if SEGMENT > 0:
            slot = tl.program_id(2).to(tl.int64)
            if slot >= n_segs:
                return  # past this query tile's last segment
            seg_lo = origin + (seg_first + slot) * SEGMENT
            loop_lo = tl.maximum(loop_lo, seg_lo)
            hi = tl.minimum(hi, seg_lo + SEGMENT)
        # [ROWS, D]
        q_rows = b * sqb + (kv_head * GROUP + g) * sqh + (pos - q_first) * sqt
        q = tl.load(q_ptr + (q_rows[:, None] + d[None, :] * sqd), mask=q_mask, other=0.0)
        if not USE_DOT:
            q = q.to(tl.float32)
        k_base = k_ptr + (b * skb + kv_head * skh - held * skt + d[None, :] * skd)  # [1, D]
        v_base = v_ptr + (b * svb + kv_head * svh - held * svt + dv[None, :] * svd)
        for start in range(loop_lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
            held_ok = (cols >= lo) & (cols < end)
            # [BLOCK_N, D]
            k = tl.load(k_base + cols[:, None] * skt, mask=held_ok[:, None] & (d < HEAD_DIM)[None, :],
                        other=0.0)
            v = tl.load(v_base + cols[:, None] * svt, mask=held_ok[:, None] & (dv < V_DIM)[None, :],
                        other=0.0)
            s = tile_scores(q, k, scale, softcap, SOFTCAP, USE_DOT, ROWS, BLOCK_N)  # [ROWS, BLOCK_N]
            keep = (cols[None, :] >= row_lo[:, None]) & (cols[None, :] <= pos[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_i, l_i, acc = tile_update(m_i, l_i, acc, s, v, USE_DOT)

    if SINKS and (MERGE or SEGMENT == 0):  # the sink joins the denominator of the final state
        sink = tl.load(sink_ptr + kv_head * GROUP + g, mask=g < GROUP, other=0.0).to(tl.float32)
        l_i, acc = with_sink(m_i, l_i, acc, sink)
    if SEGMENT > 0 and not MERGE:
        at = ws_rows + slot * ROWS
        tl.store(ws_m_ptr + at, m_i, mask=row_ok)
        tl.store(ws_l_ptr + at, l_i, mask=row_ok)
        tl.store(ws_acc_ptr + (at[:, None] * V_DIM_PAD + dv[None, :]), acc, mask=row_ok[:, None])
    else:
        out = acc / l_i[:, None]
        o_rows = b * sob + (kv_head * GROUP + g) * soh + (pos - q_first) * sot
        tl.store(o_ptr + (o_rows[:, None] + dv[None, :] * sod), out.to(o_ptr.dtype.element_ty),
                 mask=o_mask)


def attention_into(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float | None = None, first_valid: torch.Tensor | None = None, *,
                   key_start: int = 0, window: int | None = None, chunk: int | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None,
                   align_own: bool = True, align_absolute: bool = True,
                   config: AttentionConfig | None = None,
                   visibility: torch.Tensor | None = None) -> torch.Tensor:
    """`attention` written into `out` ([B, Hq, Tq, Dv], any strides); returns `out`. Padded query
    positions are not written. `visibility` ([B, Tq, Tk] bool): the mask instead of the
    positions' pattern (kvfid.kernels.attention.visible). `align_own=False` (tiles on padded positions) and
    `align_absolute=False` (key tiles from held key 0) are the control twins: correct, but
    padding- and window-cache-variant (for tests only). `config` overrides the path's tiling (tests
    run the GPU configs in the interpreter)."""
    check_inputs(q, k, v)
    batch, n_q_heads, q_len, head_dim = q.shape
    n_kv_heads, kv_len, v_dim = k.shape[1], k.shape[2], v.shape[-1]
    key_start = int(key_start)
    check_mechanisms(n_q_heads, key_start, window, chunk, softcap, sinks)
    pad = first_valid_rows(first_valid, batch, key_start, kv_len, q.device)
    if out.shape != (batch, n_q_heads, q_len, v_dim):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(batch, n_q_heads, q_len, v_dim)}")
    if q_len == 0 or batch == 0 or n_q_heads == 0:
        return out
    if visibility is not None:
        check_visibility(first_valid, window, chunk, align_own and align_absolute)
        return visible_attention_into(out, q, k, v, visibility, scale, softcap=softcap, sinks=sinks,
                                      config=config)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    group = n_q_heads // n_kv_heads
    config = config or config_for(q.device, q.dtype, max(head_dim, v_dim))
    group_tile = group_tile_for(group, config)
    n_group_chunks = triton.cdiv(group, group_tile)
    programs = batch * n_kv_heads * n_group_chunks
    slots = _segment_slots(config, kv_len, window, chunk)
    if slots and key_start + kv_len <= config.segment:
        # Every key of the call lies in segment 0, so every query tile has one segment, and one
        # segment merged into an empty state is taken as it is: the unsplit launch's bits, in one
        # launch and without a workspace (tests/attention/test_kernel_attention_split.py).
        config, slots = unsplit(config), 0
    rows, v_pad = group_tile * BLOCK_M, head_dim_pad(v_dim)
    if slots:
        # The split path's workspace grows with the query tiles; a long prefill runs as chunks
        # of queries, each over the keys up to its last query: the same bits per position.
        per_tile = programs * slots * rows * (v_pad + 2) * 4
        step = max(1, WORKSPACE_BYTES // per_tile - 1) * BLOCK_M
        if q_len > step:
            for first in range(0, q_len, step):
                last = min(q_len, first + step)
                keys = kv_len - (q_len - last)
                attention_into(out[:, :, first:last], q[:, :, first:last], k[:, :, :keys],
                               v[:, :, :keys], scale, first_valid, key_start=key_start,
                               window=window, chunk=chunk, softcap=softcap, sinks=sinks,
                               align_own=align_own, align_absolute=align_absolute, config=config)
            return out
    # The most query tiles q_len positions can straddle (each row starts at its own tile; programs
    # past a row's last tile do nothing).
    tiles = (q_len + BLOCK_M - 2) // BLOCK_M + 1
    sink_values = None if sinks is None else sinks.to(device=q.device, dtype=torch.float32).contiguous()
    if slots:
        ws_m, ws_l = (torch.empty(programs * tiles * slots * rows, dtype=torch.float32, device=q.device)
                      for _ in range(2))
        ws_acc = torch.empty(programs * tiles * slots * rows * v_pad, dtype=torch.float32,
                             device=q.device)
    else:
        ws_m = ws_l = ws_acc = q  # placeholders (never read)
    args = (
        q, k, v, out,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        pad if pad is not None else q,  # placeholder pointers when unused (never read)
        sink_values if sink_values is not None else q,
        ws_m, ws_l, ws_acc, max(slots, 2),  # (2, not 1: an i32 argument in every launch)
        n_kv_heads, n_group_chunks, q_len, kv_len, key_start,
        NO_WINDOW if window is None else int(window), 0 if chunk is None else int(chunk),
        scale, 1.0 if softcap is None else float(softcap))
    constexprs = dict(
        GROUP=group, GROUP_TILE=group_tile,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim), V_DIM=v_dim, V_DIM_PAD=v_pad,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, USE_DOT=config.use_dot,
        PADDED=pad is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        SEGMENT=config.segment, ALIGN_OWN=align_own, ALIGN_ABSOLUTE=align_absolute,
        **LAUNCH_OPTIONS)
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if slots:  # every segment's state, then their merge in segment order
        _attention_kernel[(tiles, programs, slots)](*args, **constexprs, **launch, MERGE=False)
        _attention_kernel[(tiles, programs)](*args, **constexprs, **merge_launch(v_pad, rows), MERGE=True)
    else:
        _attention_kernel[(tiles, programs)](*args, **constexprs, **launch)
    return out


def _segment_slots(config: AttentionConfig, kv_len: int, window, chunk) -> int:
    """Segment slots per query tile on the split path (0: no split): the most segments one query
    tile's keys can touch (a window or chunk bounds them; a tile's rows span BLOCK_M positions and
    its first key tile starts up to BLOCK_N before its first key)."""
    if not config.segment:
        return 0
    span = min(x for x in (kv_len, window and window + BLOCK_M, chunk and chunk + BLOCK_M) if x)
    return (span + config.block_n) // config.segment + 2


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              scale: float | None = None, first_valid: torch.Tensor | None = None,
              key_start: int = 0, window: int | None = None, chunk: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              config: AttentionConfig | None = None,
              visibility: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention (or under `visibility`, as in `attention_into`); q [B, Hq, Tq, Dqk] are the last Tq positions of k [B, Hkv, Tk, Dqk],
    v [B, Hkv, Tk, Dv]; returns [B, Hq, Tq, Dv]. Held key j is absolute position key_start + j.
    Bits per position do not depend on batch, construction or what a window cache still holds.
    `first_valid` [B] (absolute) left-pads rows (their padded queries are 0); the mechanisms are
    described in kvfid.kernels.hf; `config`: as in `attention_into`."""
    empty = torch.zeros if first_valid is not None or visibility is not None else torch.empty
    out = empty((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device=q.device)
    return attention_into(out, q, k, v, scale, first_valid, key_start=key_start, window=window,
                          chunk=chunk, softcap=softcap, sinks=sinks, config=config,
                          visibility=visibility)
