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
from .attention_reference import attention_ref  # noqa: F401  (the kernel's reference, here)
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
# Head dims above 128 (up to 256: Gemma): fewer query rows and keys per tile, so the fp32
# accumulator and the Q tile fit in registers without spilling.
_WIDE_HALF = {arch: AttentionConfig(block_n=32, max_tile_rows=32, num_warps=8, num_stages=1)
              for arch in _HALF}
_WIDE_FP32 = {arch: AttentionConfig(block_n=16, max_tile_rows=16, num_warps=8, num_stages=1)
              for arch in _HALF}
WIDE_CONFIGS = {(arch, dtype): _WIDE_FP32[arch] if dtype == torch.float32 else _WIDE_HALF[arch]
                for arch in _HALF for dtype in FLOAT_DTYPES}


@triton.jit
def _tanh(x):
    """tanh from one exp, the same arithmetic on every path: sign(x) (1 - e) / (1 + e), e = exp(-2|x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sob, soh, sot, sod,
    pad_ptr,  # [B] int64: each row's first valid key (absolute position); read only if PADDED
    sink_ptr,  # [Hq] fp32 sink logits; read only if SINKS
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

    # [ROWS, D]
    q_rows = b * sqb + (kv_head * GROUP + g) * sqh + (pos - q_first) * sqt
    q = tl.load(q_ptr + (q_rows[:, None] + d[None, :] * sqd), mask=q_mask, other=0.0)
    if not USE_DOT:
        q = q.to(tl.float32)
    o_rows = b * sob + (kv_head * GROUP + g) * soh + (pos - q_first) * sot
    k_base = k_ptr + (b * skb + kv_head * skh - held * skt + d[None, :] * skd)  # [1, D]
    v_base = v_ptr + (b * svb + kv_head * svh - held * svt + dv[None, :] * svd)

    if SINKS:  # the sink is the softmax's first term: m = sink, l = exp(sink - m) = 1
        m_i = tl.load(sink_ptr + kv_head * GROUP + g, mask=g < GROUP, other=0.0).to(tl.float32)
        l_i = tl.full([ROWS], 1.0, tl.float32)
    else:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, V_DIM_PAD], tl.float32)

    # Key tiles sit at origin + multiples of BLOCK_N. The loop runs from the tile holding the
    # first row's first key to the last row's last key; a tile no key of which a row sees leaves
    # that row's state bit for bit (the selects below), so a row's state is updated by exactly
    # the key tiles holding keys it sees, in order, whatever query tile or chunk it sits in.
    hi = tl.minimum(end, first + BLOCK_M)
    for start in range(origin + ((tile_lo - origin) // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
        held_ok = (cols >= lo) & (cols < end)
        # [BLOCK_N, D]
        k = tl.load(k_base + cols[:, None] * skt, mask=held_ok[:, None] & (d < HEAD_DIM)[None, :],
                    other=0.0)
        v = tl.load(v_base + cols[:, None] * svt, mask=held_ok[:, None] & (dv < V_DIM)[None, :],
                    other=0.0)
        # [ROWS, BLOCK_N]; fp32 accumulation either way
        if USE_DOT:
            s = mma(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], tl.float32))
        else:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = s * scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        keep = (cols[None, :] >= row_lo[:, None]) & (cols[None, :] <= pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_tile = tl.max(s, axis=1)
        live = m_tile > float("-inf")  # the row sees a key of this tile
        m_new = tl.maximum(m_i, m_tile)
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # no inf - inf before its first key
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = tl.where(live, l_i * alpha + tl.sum(p, axis=1), l_i)
        if USE_DOT:
            pv = mma(p.to(v.dtype), v, tl.zeros([ROWS, V_DIM_PAD], tl.float32))
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = tl.where(live[:, None], acc * alpha[:, None] + pv, acc)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(o_ptr + (o_rows[:, None] + dv[None, :] * sod), out.to(o_ptr.dtype.element_ty),
             mask=o_mask)


def config_for(device: torch.device, dtype: torch.dtype, head_dim: int = 128) -> AttentionConfig:
    """The fixed tiling on `device` for `dtype` and the layer's widest head dim: a function of the
    execution path and the model, never of batch or length."""
    if not uses_tl_dot(device):
        return INTERPRETER_CONFIG
    table = WIDE_CONFIGS if head_dim > 128 else CONFIGS
    return table[(gpu_arch(device), dtype)]


def group_tile_for(group: int, config: AttentionConfig) -> int:
    """Query heads of a GQA group stacked in one program (a power of two, at most the config's rows)."""
    return min(triton.next_power_of_2(group), max(1, config.max_tile_rows // BLOCK_M))


def head_dim_pad(head_dim: int) -> int:
    """The head dim a tile holds: tl.dot needs a reduction dim of at least 16, so tiny head dims
    are padded with masked zeros."""
    return max(16, triton.next_power_of_2(head_dim))


MAX_HEAD_DIM = 256
NO_WINDOW = 1 << 62  # the window argument when there is none (no position is that far back)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D q, k, v [B, H, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on batch, heads and length; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    (bq, hq, tq, dq), (bk, hkv, tk, dk) = q.shape, k.shape
    if bq != bk or dq != dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if max(dq, v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported; got {dq} and {v.shape[-1]}")
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


def _check_mechanisms(n_q_heads: int, key_start: int, window, chunk, softcap, sinks) -> None:
    if key_start < 0:
        raise ValueError(f"key_start must be >= 0; got {key_start}")
    for name, value in (("window", window), ("chunk", chunk)):
        if value is not None and int(value) < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be > 0; got {softcap}")
    if sinks is not None and tuple(sinks.shape) != (n_q_heads,):
        raise ValueError(f"sinks must be [Hq={n_q_heads}]; got {tuple(sinks.shape)}")


def attention_into(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float | None = None, first_valid: torch.Tensor | None = None, *,
                   key_start: int = 0, window: int | None = None, chunk: int | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None,
                   align_own: bool = True, align_absolute: bool = True,
                   config: AttentionConfig | None = None) -> torch.Tensor:
    """`attention` written into `out` ([B, Hq, Tq, Dv], any strides); returns `out`. Padded query
    positions are not written. `align_own=False` (tiles on padded positions) and
    `align_absolute=False` (key tiles from held key 0) are the control twins: correct, but
    padding- and window-cache-variant (for tests only). `config` overrides the path's tiling (tests
    run the GPU configs in the interpreter)."""
    _check(q, k, v)
    batch, n_q_heads, q_len, head_dim = q.shape
    n_kv_heads, kv_len, v_dim = k.shape[1], k.shape[2], v.shape[-1]
    key_start = int(key_start)
    _check_mechanisms(n_q_heads, key_start, window, chunk, softcap, sinks)
    pad = _first_valid(first_valid, batch, key_start, kv_len, q.device)
    if out.shape != (batch, n_q_heads, q_len, v_dim):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(batch, n_q_heads, q_len, v_dim)}")
    if q_len == 0 or batch == 0 or n_q_heads == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    group = n_q_heads // n_kv_heads
    config = config or config_for(q.device, q.dtype, max(head_dim, v_dim))
    group_tile = group_tile_for(group, config)
    n_group_chunks = triton.cdiv(group, group_tile)
    # The most query tiles q_len positions can straddle (each row starts at its own tile; programs
    # past a row's last tile do nothing).
    tiles = (q_len + BLOCK_M - 2) // BLOCK_M + 1
    grid = (tiles, batch * n_kv_heads * n_group_chunks)
    sink_values = None if sinks is None else sinks.to(device=q.device, dtype=torch.float32).contiguous()
    _attention_kernel[grid](
        q, k, v, out,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        pad if pad is not None else q,  # placeholder pointers when unused (never read)
        sink_values if sink_values is not None else q,
        n_kv_heads, n_group_chunks, q_len, kv_len, key_start,
        NO_WINDOW if window is None else int(window), 0 if chunk is None else int(chunk),
        scale, 1.0 if softcap is None else float(softcap),
        GROUP=group, GROUP_TILE=group_tile,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
        V_DIM=v_dim, V_DIM_PAD=head_dim_pad(v_dim),
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, USE_DOT=config.use_dot,
        num_warps=config.num_warps, num_stages=config.num_stages,
        PADDED=pad is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        ALIGN_OWN=align_own, ALIGN_ABSOLUTE=align_absolute, **LAUNCH_OPTIONS,
    )
    return out


def _first_valid(first_valid: torch.Tensor | None, batch: int, key_start: int, kv_len: int,
                 device: torch.device) -> torch.Tensor | None:
    """Validated per-row padding (absolute first valid key) as contiguous int64 [B] on `device`;
    None when there is none."""
    if first_valid is None:
        return None
    if first_valid.shape != (batch,) or first_valid.dtype.is_floating_point:
        raise ValueError(f"first_valid must be integer [B={batch}]; got {first_valid.dtype}"
                         f"{tuple(first_valid.shape)}")
    if bool((first_valid < 0).any()):
        raise ValueError(f"first_valid must be >= 0; got {first_valid.tolist()}")
    # A row padded past every key so far (a chunk of pure padding) has no valid key yet.
    return first_valid.to(device=device, dtype=torch.int64).clamp(max=key_start + kv_len).contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              scale: float | None = None, first_valid: torch.Tensor | None = None,
              key_start: int = 0, window: int | None = None, chunk: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              config: AttentionConfig | None = None) -> torch.Tensor:
    """Causal attention; q [B, Hq, Tq, Dqk] are the last Tq positions of k [B, Hkv, Tk, Dqk],
    v [B, Hkv, Tk, Dv]; returns [B, Hq, Tq, Dv] in q's dtype. Held key j is absolute position
    `key_start + j`. Bits per position are independent of batch size, of how the positions were
    split into prefill, chunks or decode steps and of how many earlier keys a window cache still
    holds. `first_valid` [B] (int, >= 0; absolute positions) left-pads row b: keys before it are
    never read and those query positions are 0; a row's valid positions get the bits they get
    unpadded. `window`, `chunk`, `softcap`, `sinks`: see kernels.hf; `config`: as in
    `attention_into`.
    """
    empty = torch.zeros if first_valid is not None else torch.empty
    out = empty((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device=q.device)
    return attention_into(out, q, k, v, scale, first_valid, key_start=key_start, window=window,
                          chunk=chunk, softcap=softcap, sinks=sinks, config=config)
