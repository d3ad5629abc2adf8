"""Plain-PyTorch reference of `kvfid.kernels.attention.kernel`: the same contract, computed from an explicit
mask in the inputs' dtype (tests pass fp64). `visible` is the one statement of the pattern the
kernels apply from positions (kvfid.kernels.hf checks masks against it); `segment_mask` states a
visibility given by segments."""

from __future__ import annotations

import math

import torch


def visible(own_start: torch.Tensor, q_len: int, kv_len: int, window: int | None = None,
            chunk: int | None = None) -> torch.Tensor:
    """[B, q_len, kv_len] bool: which held keys each query sees, from each row's own position of
    held key 0 (`own_start` [B]: absolute position of held key 0 minus the row's left padding;
    negative own positions are padding); queries are the last q_len held keys."""
    keys = own_start[:, None, None] + torch.arange(kv_len, device=own_start.device)  # [B, 1, kv]
    queries = keys[:, :, kv_len - q_len:].transpose(1, 2)  # [B, q, 1]
    allowed = (keys >= 0) & (keys <= queries)
    if window is not None:
        allowed &= keys > queries - window
    if chunk is not None:
        allowed &= torch.div(keys, chunk, rounding_mode="floor") == torch.div(queries, chunk,
                                                                              rounding_mode="floor")
    return allowed


def segment_mask(segment_ids: torch.Tensor, sees: torch.Tensor, q_len: int | None = None) -> torch.Tensor:
    """[B, q_len, Tk] bool: a visibility given by segments. `segment_ids` [B, Tk] is each held key's
    segment, `sees` [S, S] bool which segments each segment sees; causal within them (held key j
    is seen by query i only if j <= i's index). Queries are the last q_len keys (default all)."""
    kv_len = segment_ids.shape[-1]
    q_len = kv_len if q_len is None else q_len
    seg = segment_ids.long()
    allowed = sees.to(torch.bool)[seg[:, kv_len - q_len:, None], seg[:, None, :]]  # [B, q, kv]
    index = torch.arange(kv_len, device=seg.device)
    return allowed & (index[None, None, :] <= index[kv_len - q_len:, None])


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  scale: float | None = None, first_valid: torch.Tensor | None = None,
                  key_start: int = 0, window: int | None = None, chunk: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None,
                  visibility: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention with the contract of `kvfid.kernels.attention.kernel.attention` (any float dtype):
    q [B, Hq, Tq, Dqk], k [B, Hkv, Tk, Dqk], v [B, Hkv, Tk, Dv] -> [B, Hq, Tq, Dv]; padded query
    positions (own position < 0) are 0. Sinks as gpt-oss's eager attention: a per-head logit
    beside the scores in the softmax, dropped after it. `visibility` [B, Tq, Tk] bool, if given,
    is the mask itself (True: the query sees the key)."""
    batch, n_q_heads, q_len, head_dim = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = n_q_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [B, Hq, Tk, D]
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale  # [B, Hq, Tq, Tk]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if visibility is not None:
        allowed = visibility.to(device=q.device, dtype=torch.bool)[:, None]  # [B, 1, Tq, Tk]
    else:
        pads = torch.zeros(batch, dtype=torch.long) if first_valid is None else first_valid.long().cpu()
        allowed = visible(key_start - pads, q_len, kv_len, window, chunk).to(q.device)[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(batch, -1, q_len, 1)
        s = torch.cat([s, sink], dim=-1)
    real = allowed.any(-1, keepdim=True)  # [B, 1, Tq, 1]: padded queries see no key
    s = s.masked_fill(~real, 0.0)
    probs = torch.softmax(s, dim=-1)[..., :kv_len]
    out = torch.einsum("bhqk,bhkd->bhqd", probs, v)
    return out.masked_fill(~real, 0.0)
