"""The attention kernel under a visibility mask (Triton): each query in its view's coordinates.

`kvfid.kernels.attention.views` turns a [B, Tq, Tk] bool mask into runs of queries that share one
ordered list of visible keys (a view) and plans one program per (run, query tile). A program
works in view coordinates: its rows are view positions `tile * BLOCK_M + r` (row `c % BLOCK_M`
of tile `c // BLOCK_M`, whatever call computes the query: prefill, chunk or decode step), its key
tiles are view positions at multiples of BLOCK_N, gathered from the held keys through the view
(`keys`: coordinate -> held index), visited in order with the same online softmax as the causal
kernel (tiles.tile_update), causal in view coordinates. A key no row of the program sees
is never loaded: invisible tiles are skipped because they are not in the view at all.

So a query's bits depend on its query and its visible keys in order, never on keys it cannot see
(their values, their number, their place): under the interpreter's config they equal the causal
kernel's (kvfid.kernels.attention.kernel) over the visible keys alone. The GPU configs' split path (fixed key
segments) is not taken here: a view's keys are read by one program per query tile, so on a GPU
the bits equal the causal kernel's with `segment=0`. Softcap, sinks, GQA stacking and Dv != Dqk
are served as in the causal kernel; windows, chunks and left padding are not (left padding is
invisible keys: give it in the mask).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvfid.kernels import LAUNCH_OPTIONS
from kvfid.kernels.attention.config import BLOCK_M, AttentionConfig, config_for, group_tile_for, head_dim_pad
from kvfid.kernels.attention.tiles import tile_scores, tile_update, with_sink
from kvfid.kernels.attention.views import as_visibility, runs, tile_plan
from kvfid.kernels.jit import kernel


@kernel
def _visible_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sob, soh, sot, sod,
    plan_ptr,  # [B, P, 5] int64 (tile, first query, first coordinate, count, key offset)
    keys_ptr,  # [total] int64: each view's held indexes, concatenated
    sink_ptr,  # [Hq] fp32 sink logits; read only if SINKS
    n_kv_heads, n_group_chunks, per_row,
    scale, softcap,
    GROUP: tl.constexpr, GROUP_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, V_DIM: tl.constexpr, V_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    pid = tl.program_id(1).to(tl.int64)  # over batch x kv head x group chunk
    group_chunk = pid % n_group_chunks
    kv_head = (pid // n_group_chunks) % n_kv_heads
    b = pid // (n_group_chunks * n_kv_heads)
    entry = plan_ptr + (b * per_row + tl.program_id(0).to(tl.int64)) * 5
    tile = tl.load(entry)
    q_first = tl.load(entry + 1)  # query index of the run's first query
    c_first = tl.load(entry + 2)  # its view coordinate
    count = tl.load(entry + 3)
    view = keys_ptr + tl.load(entry + 4)
    if count == 0:
        return  # past this row's last program
    c_end = c_first + count  # the view's length: the run's last query is its last key

    ROWS: tl.constexpr = GROUP_TILE * BLOCK_M
    rows = tl.arange(0, ROWS).to(tl.int64)
    g = group_chunk * GROUP_TILE + rows // BLOCK_M  # head within the group
    pos = tile * BLOCK_M + rows % BLOCK_M  # view coordinate of each row
    row_ok = (g < GROUP) & (pos >= c_first) & (pos < c_end)
    query = q_first + (pos - c_first)  # query index of each row
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    dv = tl.arange(0, V_DIM_PAD).to(tl.int64)
    q_rows = b * sqb + (kv_head * GROUP + g) * sqh + query * sqt
    q = tl.load(q_ptr + (q_rows[:, None] + d[None, :] * sqd),
                mask=row_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [ROWS, D]
    if not USE_DOT:
        q = q.to(tl.float32)
    k_base = k_ptr + (b * skb + kv_head * skh + d[None, :] * skd)  # [1, D]
    v_base = v_ptr + (b * svb + kv_head * svh + dv[None, :] * svd)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, V_DIM_PAD], tl.float32)
    hi = tl.minimum(c_end, tile * BLOCK_M + BLOCK_M)  # one past the tile's last row
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N).to(tl.int64)  # view coordinates
        col_ok = cols < hi
        held = tl.load(view + cols, mask=col_ok, other=0)  # [BLOCK_N] held index of each
        # [BLOCK_N, D], gathered through the view
        k = tl.load(k_base + held[:, None] * skt, mask=col_ok[:, None] & (d < HEAD_DIM)[None, :],
                    other=0.0)
        v = tl.load(v_base + held[:, None] * svt, mask=col_ok[:, None] & (dv < V_DIM)[None, :],
                    other=0.0)
        s = tile_scores(q, k, scale, softcap, SOFTCAP, USE_DOT, ROWS, BLOCK_N)  # [ROWS, BLOCK_N]
        s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))  # causal in the view
        m_i, l_i, acc = tile_update(m_i, l_i, acc, s, v, USE_DOT)

    if SINKS:
        sink = tl.load(sink_ptr + kv_head * GROUP + g, mask=g < GROUP, other=0.0).to(tl.float32)
        l_i, acc = with_sink(m_i, l_i, acc, sink)
    out = acc / l_i[:, None]
    o_rows = b * sob + (kv_head * GROUP + g) * soh + query * sot
    tl.store(o_ptr + (o_rows[:, None] + dv[None, :] * sod), out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dv < V_DIM)[None, :])


def visible_attention_into(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           visibility: torch.Tensor, scale: float | None = None, *,
                           softcap: float | None = None, sinks: torch.Tensor | None = None,
                           config: AttentionConfig | None = None) -> torch.Tensor:
    """Attention under `visibility` ([B, Tq, Tk] bool or transformers' [B, 1, Tq, Tk]; queries
    are the last Tq keys) written into `out` [B, Hq, Tq, Dv]; inputs checked by the caller
    (kvfid.kernels.attention.kernel.attention_into)."""
    batch, n_q_heads, q_len, head_dim = q.shape
    n_kv_heads, kv_len, v_dim = k.shape[1], k.shape[2], v.shape[-1]
    mask = as_visibility(visibility.to(q.device), batch, q_len, kv_len)
    plan = tile_plan(runs(mask), BLOCK_M, q.device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    group = n_q_heads // n_kv_heads
    config = config or config_for(q.device, q.dtype, max(head_dim, v_dim))
    group_tile = group_tile_for(group, config)
    n_group_chunks = triton.cdiv(group, group_tile)
    sink_values = None if sinks is None else sinks.to(device=q.device, dtype=torch.float32).contiguous()
    grid = (plan.per_row, batch * n_kv_heads * n_group_chunks)
    _visible_kernel[grid](
        q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        plan.programs, plan.keys, sink_values if sink_values is not None else q,
        n_kv_heads, n_group_chunks, plan.per_row,
        scale, 1.0 if softcap is None else float(softcap),
        GROUP=group, GROUP_TILE=group_tile, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
        V_DIM=v_dim, V_DIM_PAD=head_dim_pad(v_dim), BLOCK_M=BLOCK_M, BLOCK_N=config.block_n,
        USE_DOT=config.use_dot, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **LAUNCH_OPTIONS)
    return out
