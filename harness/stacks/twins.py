"""Deliberately variant twins: the negative controls of every invariance check.

Stock ops are batch-variant on some CPUs and invariant on others (a stock bf16 mm that differs by
batch on an Intel Xeon gave identical rows on an AMD EPYC), so a check shown able to fail only by
a stock op proves nothing on a machine where that op happens to be invariant. Each twin here
computes its op correctly (within the dtype's tolerance) but chooses its reduction split from the
shape of the call, as split-K GEMMs and split-KV decode kernels do: one split for a row alone or
a full prefill, two or more for rows in a batch or for a decode step or chunk. Partial results
are rounded to the op's dtype before they are combined, so the split changes bits on every
machine: every invariance test must catch its twin.

`register_hf()` makes the attention twin a transformers attention implementation, the model-level
control (backend `twin`).
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

HF_NAME = "kvfid_twin"


def _splits(rows: int, extra: int = 0) -> int:
    """1 for a single row; 2 or 3 (by parity) for several rows; `extra` more on top."""
    return (1 if rows == 1 else 2 + rows % 2) + extra


def _split_sum(x: torch.Tensor, splits: int, round_to: torch.dtype) -> torch.Tensor:
    """Sum of fp32 x over its last dim in `splits` contiguous parts, each part rounded to
    `round_to` before the parts are added (in order, in fp32)."""
    parts = [p.sum(-1).to(round_to).float() for p in torch.tensor_split(x, splits, dim=-1)]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def matmul_twin(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` by split-K, the split count chosen from the number of rows."""
    rows = x.numel() // max(1, x.shape[-1])
    out = None
    for part in torch.tensor_split(torch.arange(x.shape[-1], device=x.device), _splits(rows)):
        partial = x[..., part] @ weight[:, part].t()  # [..., N] in x's dtype
        out = partial if out is None else out + partial
    return out


def rms_norm_twin(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm with its mean of squares split by the number of rows."""
    rows = x.numel() // max(1, x.shape[-1])
    h = x.float()
    variance = _split_sum(h * h, _splits(rows), x.dtype) / x.shape[-1]
    return weight * (h * torch.rsqrt(variance[..., None] + eps)).to(x.dtype)


def _softmax_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.numel() // max(1, x.shape[-1])
    h = x.float()
    shifted = h - h.amax(-1, keepdim=True)
    return shifted, _split_sum(shifted.exp(), _splits(rows), x.dtype)[..., None]


def softmax_twin(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with its normalizer split by the number of rows."""
    shifted, total = _softmax_parts(x)
    return (shifted.exp() / total).to(x.dtype)


def log_softmax_twin(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim with its normalizer split by the number of rows."""
    shifted, total = _softmax_parts(x)
    return (shifted - total.log()).to(x.dtype)


def attention_twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention (q [B, Hq, Tq, D] the last Tq positions of k, v [B, Hkv, Tk, D]) by
    split-KV: one key split for a single full prefill, more for a batch or for fewer queries than
    keys; partial outputs rounded to q's dtype, then combined. `mask`: an optional extra bool
    (True = attend) or additive mask broadcastable to [B, Hq, Tq, Tk]."""
    batch, n_q_heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = n_q_heads // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).float() for t in (k, v))  # [B, Hq, Tk, D]
    s = q.float() @ k.transpose(-1, -2) * scale  # [B, Hq, Tq, Tk]
    q_pos = torch.arange(q_len, device=q.device) + (kv_len - q_len)
    s = s.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > q_pos[:, None], float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    splits = _splits(batch, extra=int(q_len < kv_len))
    maxima, sums, outs = [], [], []
    for part in torch.tensor_split(torch.arange(kv_len, device=q.device), splits):
        s_part = s[..., part]  # [B, Hq, Tq, Tk/splits]
        m = s_part.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a split a row cannot see
        p = (s_part - m).exp()
        maxima.append(m)
        sums.append(p.sum(-1, keepdim=True).to(q.dtype).float())
        outs.append((p @ v[:, :, part]).to(q.dtype).float())  # [B, Hq, Tq, D]
    top = torch.stack(maxima).amax(0)
    weights = [(m - top).exp() for m in maxima]
    numerator = sum(w * o for w, o in zip(weights, outs))
    denominator = sum(w * l for w, l in zip(weights, sums))
    return (numerator / denominator).to(q.dtype)


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: [B, Hq, T, D] in, ([B, T, Hq, D], None) out. A sparse
    indexer's `indices` [B, T, k] (held keys per query, DeepSeek-V3.2 passes them beside the
    causal mask to every implementation but eager and sdpa) narrow the mask."""
    indices = kwargs.get("indices")
    if indices is not None:
        kv_len = key.shape[2]
        chosen = torch.zeros(*indices.shape[:2], kv_len + 1, dtype=torch.bool, device=query.device)
        chosen.scatter_(-1, torch.where(indices < 0, kv_len, indices.long()), True)
        chosen = chosen[:, None, :, :kv_len]  # [B, 1, T, kv]
        if attention_mask is None:
            attention_mask = chosen
        elif attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & chosen
        else:
            attention_mask = attention_mask.masked_fill(~chosen, float("-inf"))
    out = attention_twin(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def register_hf() -> str:
    """Register the attention twin with transformers (with the stock sdpa mask function, so a
    padding mask still arrives); returns its name."""
    AttentionInterface.register(HF_NAME, _hf_attention)
    AttentionMaskInterface.register(HF_NAME, sdpa_mask)
    return HF_NAME
