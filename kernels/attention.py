"""Batch-invariant, prefill-decode-invariant causal attention (Triton) and its PyTorch reference.

One kernel serves prefill, chunked prefill and single-token decode. The output for absolute
position t has the same bits however t is reached, because every construction runs the same
arithmetic for t:

* query tiles are aligned to absolute positions: position t is always row `t % BLOCK_M` of query
  tile `t // BLOCK_M` (a decode query is padded up to that tile), so a row never changes its place
  in a tile whatever the chunking;
* key/value tiles have a fixed size (per execution path), start at key 0 and are visited in order
  with an online softmax; `BLOCK_N` is a multiple of `BLOCK_M`, so a query tile never reaches a key
  tile that a decode step of any of its rows would not also reach;
* accumulation is fp32; no split over the key axis, nothing is chosen by looking at the shape.

Rows are independent programs (batch rows and heads are grid axes), so batch size cannot change a
row. The query heads that share one key/value head are stacked into one tile (GQA), so each key
tile is loaded once per group.

Left-padded batches (`first_valid`, a row's first valid key, as transformers pads) keep this. A
program works in its row's *own* positions (absolute position minus the row's padding): its query
tiles, its key tiles and its causal limit are those of the unpadded row, and the key pointer starts
at the first valid key, so pad keys are never loaded and never enter the online softmax. Row b's
program therefore runs the same instructions on the same values as the row alone; only base
pointers differ, so neither its padding nor its neighbours (other programs) can change its bits.
Padded query positions are not computed. A kernel that aligns tiles to padded positions and masks
pad keys is correct but padding-variant (a row's keys fall into other tiles): `align_own=False`
is that twin, kept as the tests' negative control.

Products: on CUDA `tl.dot`. bf16/fp16 operands go in as they are (tensor cores) with fp32
accumulation, and the probabilities P are cast to V's dtype for the PV product, as flash attention
does; fp32 operands use IEEE fp32 (`input_precision="ieee"`, no TF32). The MMA computes each output
element from its row and column alone, in an order fixed by the compiled config, so this keeps the
argument above: the config (tiles, warps, stages) comes from `CONFIGS` by (arch, dtype), never from
the batch or a length. In the Triton interpreter `tl.dot` is a NumPy BLAS product whose bits for a
row can depend on the row's place in the tile (docs/hazards.md), so there the products
are fp32 broadcast multiplies reduced with `tl.sum`, whose order is the same for every row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import FLOAT_DTYPES, LAUNCH_OPTIONS, gpu_arch, triton_runs_on, uses_tl_dot
from .dot import mma

BLOCK_M = 16  # query positions per tile (per query head of the group), on every path


@dataclass(frozen=True)
class AttentionConfig:
    """One execution path's fixed tiling: a function of (arch, dtype), never of batch or length."""

    block_n: int  # keys per tile; a multiple of BLOCK_M (see the module docstring)
    max_tile_rows: int  # query rows per program: group heads are split into chunks of this many
    num_warps: int
    num_stages: int
    use_dot: bool = True


# The interpreter is faster with fewer, larger key tiles; warps and stages mean nothing there.
INTERPRETER_CONFIG = AttentionConfig(block_n=128, max_tile_rows=64, num_warps=4, num_stages=1,
                                     use_dot=False)
# Sized for H100/H200 (and A100) with `kvfid compile`: no config spills, shared memory well within
# the limit. bf16/fp16: 64 query rows (4 heads of a GQA group) share each 64-key tile, one warp
# group (4 warps) on sm_90, 8 warps on sm_80 and sm_100 (4 spill at head dim 128). fp32 keeps IEEE
# products on the CUDA cores: 32 rows x 16 keys over 8 warps (32 keys left an 8-24 B stack on
# sm_80 and sm_100 at head dim 128).
_HALF = {"sm_80": AttentionConfig(block_n=64, max_tile_rows=64, num_warps=8, num_stages=2),
         "sm_90": AttentionConfig(block_n=64, max_tile_rows=64, num_warps=4, num_stages=2),
         # sm_100: the padding-aware kernel spilled 8 B with 4 warps and 2 stages.
         "sm_100": AttentionConfig(block_n=64, max_tile_rows=64, num_warps=8, num_stages=1)}
# sm_80 takes one stage: two left an 8 B spill for the padded prefill; one spills on sm_90/sm_100.
_FP32 = {arch: AttentionConfig(block_n=16, max_tile_rows=32, num_warps=8,
                               num_stages=1 if arch == "sm_80" else 2) for arch in _HALF}
CONFIGS = {(arch, dtype): _FP32[arch] if dtype == torch.float32 else _HALF[arch]
           for arch in _HALF for dtype in FLOAT_DTYPES}


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sob, soh, sot, sod,
    pad_ptr,  # [B] int64: each row's first valid (unpadded) key position; read only if PADDED
    n_kv_heads, n_group_chunks, q_len, kv_len, scale,
    GROUP: tl.constexpr,  # query heads per key/value head
    GROUP_TILE: tl.constexpr,  # query heads stacked in one program (power of two)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    PADDED: tl.constexpr,  # left-padded rows: pad_ptr holds each row's padding
    ALIGN_OWN: tl.constexpr = True,  # tiles on the row's own positions; False: the control twin
):
    # Index arithmetic in int64: no overflow on large caches, and the interpreter skips its
    # per-operation int32 overflow checks (a large share of its time otherwise).
    pid = tl.program_id(1).to(tl.int64)  # over batch x kv head x group chunk
    chunk = pid % n_group_chunks
    kv_head = (pid // n_group_chunks) % n_kv_heads
    b = pid // (n_group_chunks * n_kv_heads)
    # Positions below are the row's own (`shift` = its left padding subtracted), so tiles start at
    # its first valid key; `lo` is the first valid key in those coordinates (0 but in the twin).
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
    end = kv_len - shift  # keys of this row, in its coordinates
    q_first = end - q_len  # position of query 0 (negative: padded queries, never computed)
    tile = tl.maximum(tl.maximum(q_first, lo), 0) // BLOCK_M + tl.program_id(0).to(tl.int64)
    if tile * BLOCK_M >= end:
        return  # past its row's last tile (padded launches size the grid for the longest row)

    ROWS: tl.constexpr = GROUP_TILE * BLOCK_M
    rows = tl.arange(0, ROWS).to(tl.int64)
    g = chunk * GROUP_TILE + rows // BLOCK_M  # head within the group
    pos = tile * BLOCK_M + rows % BLOCK_M  # position of each query row
    row_ok = (g < GROUP) & (pos >= q_first) & (pos >= lo) & (pos < end)
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    if HEAD_DIM_PAD == HEAD_DIM:
        row_mask = row_ok[:, None]
    else:
        row_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]

    # [ROWS, D]
    q_rows = b * sqb + (kv_head * GROUP + g) * sqh + (pos - q_first) * sqt
    q = tl.load(q_ptr + (q_rows[:, None] + d[None, :] * sqd), mask=row_mask, other=0.0)
    if not USE_DOT:
        q = q.to(tl.float32)
    o_rows = b * sob + (kv_head * GROUP + g) * soh + (pos - q_first) * sot
    k_base = k_ptr + (b * skb + kv_head * skh + shift * skt + d[None, :] * skd)  # [1, D]
    v_base = v_ptr + (b * svb + kv_head * svh + shift * svt + d[None, :] * svd)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)

    # Keys this tile can see end at its last row (or the last key); with BLOCK_N % BLOCK_M == 0
    # this is the same key-tile count a decode step of any row of the tile computes.
    hi = tl.minimum(end, (tile + 1) * BLOCK_M)
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
        if HEAD_DIM_PAD == HEAD_DIM:
            kv_mask = (cols < end)[:, None]
        else:
            kv_mask = (cols < end)[:, None] & (d < HEAD_DIM)[None, :]
        # [BLOCK_N, D]
        k = tl.load(k_base + cols[:, None] * skt, mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svt, mask=kv_mask, other=0.0)
        # [ROWS, BLOCK_N]; fp32 accumulation either way
        if USE_DOT:
            s = mma(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], tl.float32))
        else:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        # Keys past a row's position are masked; for real rows that also covers keys >= kv_len.
        keep = cols[None, :] <= pos[:, None]
        if PADDED and not ALIGN_OWN:
            keep = keep & (cols[None, :] >= lo)
        s = tl.where(keep, s * scale, float("-inf"))
        # Every row sees its first valid key in the first tile, so m_new is finite from there on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = mma(p.to(v.dtype), v, tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32))
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(o_ptr + (o_rows[:, None] + d[None, :] * sod), out.to(o_ptr.dtype.element_ty), mask=row_mask)



def config_for(device: torch.device, dtype: torch.dtype) -> AttentionConfig:
    """The fixed tiling on `device` for `dtype`: a function of the execution path only."""
    return CONFIGS[(gpu_arch(device), dtype)] if uses_tl_dot(device) else INTERPRETER_CONFIG


def group_tile_for(group: int, config: AttentionConfig) -> int:
    """Query heads of a GQA group stacked in one program (a power of two, at most the config's rows)."""
    return min(triton.next_power_of_2(group), max(1, config.max_tile_rows // BLOCK_M))


def head_dim_pad(head_dim: int) -> int:
    """The head dim a tile holds: tl.dot needs a reduction dim of at least 16, so tiny head dims
    are padded with masked zeros."""
    return max(16, triton.next_power_of_2(head_dim))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D q, k, v [B, H, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    (bq, hq, tq, dq), (bk, hkv, tk, dk) = q.shape, k.shape
    if bq != bk or dq != dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if tq > tk:
        raise ValueError(f"queries ({tq}) must be the last positions of the keys ({tk}): Tq <= Tk")
    if not triton_runs_on(q.device):
        raise ValueError(f"attention: tensors on {q.device} need CUDA or the Triton interpreter "
                         "(TRITON_INTERPRET=1 set before triton is imported)")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention supports {FLOAT_DTYPES} with one dtype for q, k, v; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")


def attention_into(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float | None = None, first_valid: torch.Tensor | None = None, *,
                   key_start: int = 0, window: int | None = None, chunk: int | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None,
                   align_own: bool = True, config: AttentionConfig | None = None) -> torch.Tensor:
    """`attention` written into `out` ([B, Hq, Tq, D], any strides); returns `out`. Padded query
    positions (before a row's `first_valid`) are not written. `align_own=False` is the control
    twin that aligns tiles to padded positions (padding-variant; for tests only). `config`
    overrides the path's tiling (tests run the GPU configs in the interpreter)."""
    _unserved(key_start, window, chunk, softcap, sinks)
    _check(q, k, v)
    pad = _first_valid(first_valid, q.shape[0], k.shape[2], q.device)
    batch, n_q_heads, q_len, head_dim = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    if out.shape != q.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    if q_len == 0 or batch == 0 or n_q_heads == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    group = n_q_heads // n_kv_heads
    config = config or config_for(q.device, q.dtype)
    group_tile = group_tile_for(group, config)
    n_group_chunks = triton.cdiv(group, group_tile)
    # Query tiles per row: exact without padding; with it, the most q_len positions can straddle
    # (each row starts at its own tile; programs past a row's last tile do nothing).
    tiles = ((kv_len - 1) // BLOCK_M - (kv_len - q_len) // BLOCK_M + 1 if pad is None
             else (q_len + BLOCK_M - 2) // BLOCK_M + 1)
    grid = (tiles, batch * n_kv_heads * n_group_chunks)
    _attention_kernel[grid](
        q, k, v, out,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        pad if pad is not None else q,  # a placeholder pointer when unpadded (never read)
        n_kv_heads, n_group_chunks, q_len, kv_len, scale,
        GROUP=group, GROUP_TILE=group_tile,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, USE_DOT=config.use_dot,
        num_warps=config.num_warps, num_stages=config.num_stages,
        PADDED=pad is not None, ALIGN_OWN=align_own, **LAUNCH_OPTIONS,
    )
    return out


def _unserved(key_start: int, window, chunk, softcap, sinks) -> None:
    """Refuse what this kernel does not serve yet (the shared interface names it)."""
    for what, given in (("key_start != 0", key_start != 0), ("window", window is not None),
                        ("chunk", chunk is not None), ("softcap", softcap is not None),
                        ("sinks", sinks is not None)):
        if given:
            raise ValueError(f"attention: {what} is not served by the Triton kernel yet")


def _first_valid(first_valid: torch.Tensor | None, batch: int, kv_len: int,
                 device: torch.device) -> torch.Tensor | None:
    """Validated per-row padding as contiguous int64 [B] on `device`; None when there is none."""
    if first_valid is None:
        return None
    if first_valid.shape != (batch,) or first_valid.dtype.is_floating_point:
        raise ValueError(f"first_valid must be integer [B={batch}]; got {first_valid.dtype}"
                         f"{tuple(first_valid.shape)}")
    if bool((first_valid < 0).any()):
        raise ValueError(f"first_valid must be >= 0; got {first_valid.tolist()}")
    # A row padded past every key so far (a chunk of pure padding) has no valid key yet.
    return first_valid.to(device=device, dtype=torch.int64).clamp(max=kv_len).contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              scale: float | None = None, first_valid: torch.Tensor | None = None,
              key_start: int = 0, window: int | None = None, chunk: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              config: AttentionConfig | None = None) -> torch.Tensor:
    """Causal attention; q [B, Hq, Tq, D] are the last Tq positions of k, v [B, Hkv, Tk, D].

    Returns [B, Hq, Tq, D] in q's dtype. Bits per position are independent of batch size and of
    how the positions were split into prefill, chunks or decode steps. `first_valid` [B] (int, >= 0)
    left-pads row b: keys before `first_valid[b]` are never read and those query positions are 0;
    a row's valid positions get the bits they get unpadded (see the module docstring). `config`:
    as in `attention_into`.
    """
    empty = torch.zeros_like if first_valid is not None else torch.empty_like
    out = empty(q, memory_format=torch.contiguous_format)
    return attention_into(out, q, k, v, scale, first_valid, key_start=key_start, window=window,
                          chunk=chunk, softcap=softcap, sinks=sinks, config=config)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  scale: float | None = None, first_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch causal attention with the same contract as `attention` (any float dtype)."""
    if first_valid is not None:  # each row alone over its valid keys, left-padded with zeros
        out = torch.zeros_like(q)
        kv_len = k.shape[2]
        for b, pad in enumerate(first_valid.tolist()):
            n = min(q.shape[2], kv_len - pad)  # valid queries of row b
            if n > 0:
                out[b:b + 1, :, q.shape[2] - n:] = attention_ref(
                    q[b:b + 1, :, q.shape[2] - n:], k[b:b + 1, :, pad:], v[b:b + 1, :, pad:], scale=scale)
        return out
    _, n_q_heads, q_len, head_dim = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = n_q_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [B, Hq, Tk, D]
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale  # [B, Hq, Tq, Tk]
    q_pos = torch.arange(q_len, device=q.device) + (kv_len - q_len)
    k_pos = torch.arange(kv_len, device=q.device)
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, dim=-1), v)
