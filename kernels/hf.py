"""transformers registration of the Triton attention as attention implementation "kvfid_triton".

`register()` puts two functions into transformers' public interfaces under one name:

* the attention function (`AttentionInterface`), which calls `kernels.attention`; the kernel applies
  causality itself from absolute positions (queries are the last positions of the keys), so the
  harness's unpadded batches need no mask;
* a mask function (`masking_utils.AttentionMaskInterface`). Without one, transformers skips mask
  creation for the name and a padding mask would be dropped silently. Ours builds the mask the
  stock `sdpa` way and returns None when it is exactly the causal pattern the kernel applies
  anyway; anything else (padding, a sliding window shorter than the keys, a static cache's unfilled
  slots) is passed on, and the attention function refuses it with a clear error.

Uses only names public in transformers 5.17 through 5.2x.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import attention_into

NAME = "kvfid_triton"


def _kernel_pattern(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: query i (absolute position kv_len - q_len + i) sees key j <= it."""
    q_pos = torch.arange(q_len, device=device) + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]


def _is_kernel_pattern(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """True when a 4-D mask (bool, True = attend; or additive float) is exactly the kernel's causal one."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        return False
    pattern = _kernel_pattern(q_len, kv_len, mask.device).expand(mask.shape)
    if mask.dtype == torch.bool:
        return torch.equal(mask, pattern)
    if not mask.is_floating_point():
        return False
    blocked = mask[~pattern]
    return torch.equal(mask == 0, pattern) and bool((blocked <= torch.finfo(mask.dtype).min / 2).all())


def kvfid_triton_mask(*args, **kwargs) -> torch.Tensor | None:
    """Mask function for `AttentionMaskInterface`: None when the kernel's own causality is the mask."""
    kwargs["allow_is_causal_skip"] = False  # always materialize, so it can be inspected
    mask = sdpa_mask(*args, **kwargs)  # [B, 1, q, kv] bool
    if mask is None:
        return None
    q_len, kv_len = mask.shape[-2:]
    return None if _is_kernel_pattern(mask, q_len, kv_len) else mask


def kvfid_triton_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query [B, Hq, T, D], key/value [B, Hkv, S, D] -> ([B, T, Hq, D], None)."""
    batch, n_q_heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if dropout:
        raise ValueError(f"{NAME}: attention dropout ({dropout}) is not supported; use the model in eval mode")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{NAME}: logit softcapping is not supported")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{NAME}: an additive position bias is not supported")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError(f"{NAME}: only causal (decoder) attention is supported")
    window = kwargs.get("sliding_window")
    if window is not None and window < kv_len:
        raise ValueError(
            f"{NAME}: sliding-window attention (window {window} < {kv_len} keys) is not supported; "
            "the kernel attends to every earlier position")
    if attention_mask is not None and not _is_kernel_pattern(attention_mask, q_len, kv_len):
        raise ValueError(
            f"{NAME}: got an attention mask that is not the plain causal pattern (padding, a custom "
            "mask, or a static cache with unfilled slots). The kernel applies causality from absolute "
            "positions and cannot honour other masks; feed unpadded batches with a dynamic cache.")
    out = torch.empty((batch, q_len, n_q_heads, head_dim), dtype=query.dtype, device=query.device)
    attention_into(out.transpose(1, 2), query, key, value, scaling)  # writes [B, Hq, T, D] view
    return out, None


def register() -> str:
    """Register the attention and mask functions as "kvfid_triton" (idempotent); returns the name."""
    AttentionInterface.register(NAME, kvfid_triton_attention)
    AttentionMaskInterface.register(NAME, kvfid_triton_mask)
    return NAME
