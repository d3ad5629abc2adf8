"""Plain-PyTorch reference of `kernels.attention`: the same contract, computed from an explicit
mask in the inputs' dtype (tests pass fp64)."""

from __future__ import annotations

import math

import torch


def visible(q_len: int, kv_len: int, *, key_start: int = 0, first_valid: int = 0,
            window: int | None = None, chunk: int | None = None,
            device: torch.device | None = None) -> torch.Tensor:
    """[q_len, kv_len] bool: which held keys each query sees, in the row's own positions (absolute
    minus `first_valid`); held key j is absolute position key_start + j, queries are the last."""
    keys = torch.arange(kv_len, device=device) + key_start - first_valid
    queries = keys[kv_len - q_len:, None]
    allowed = (keys >= 0) & (keys <= queries)
    if window is not None:
        allowed &= keys > queries - window
    if chunk is not None:
        allowed &= torch.div(keys, chunk, rounding_mode="floor") == torch.div(queries, chunk,
                                                                              rounding_mode="floor")
    return allowed


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  scale: float | None = None, first_valid: torch.Tensor | None = None,
                  key_start: int = 0, window: int | None = None, chunk: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention with the contract of `kernels.attention.attention` (any float dtype):
    q [B, Hq, Tq, Dqk], k [B, Hkv, Tk, Dqk], v [B, Hkv, Tk, Dv] -> [B, Hq, Tq, Dv]; padded query
    positions (own position < 0) are 0. Sinks as gpt-oss's eager attention: a per-head logit
    beside the scores in the softmax, dropped after it."""
    batch, n_q_heads, q_len, head_dim = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = n_q_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [B, Hq, Tk, D]
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale  # [B, Hq, Tq, Tk]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pads = [0] * batch if first_valid is None else first_valid.tolist()
    allowed = torch.stack([visible(q_len, kv_len, key_start=key_start, first_valid=p, window=window,
                                   chunk=chunk, device=q.device) for p in pads])[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(batch, -1, q_len, 1)
        s = torch.cat([s, sink], dim=-1)
    real = allowed.any(-1, keepdim=True)  # [B, 1, Tq, 1]: padded queries see no key
    s = s.masked_fill(~real, 0.0)
    probs = torch.softmax(s, dim=-1)[..., :kv_len]
    out = torch.einsum("bhqk,bhkd->bhqd", probs, v)
    return out.masked_fill(~real, 0.0)
