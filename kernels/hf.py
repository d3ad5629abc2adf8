"""transformers registration of the Triton attention as attention implementation "kvfid_triton".

`register()` puts two functions into transformers' public interfaces under one name:

* the attention function (`AttentionInterface`), which calls `kernels.attention`; the kernel applies
  causality itself from positions (queries are the last positions of the keys), so unpadded
  batches need no mask, and left padding is passed to it as each row's first valid key;
* a mask function (`masking_utils.AttentionMaskInterface`). Without one, transformers skips mask
  creation for the name and a padding mask would be dropped silently. Ours builds the mask the
  stock `sdpa` way and returns None when it is exactly the causal pattern the kernel applies
  anyway; anything else is passed on. The attention function accepts exactly one other pattern,
  causal with left padding (transformers' padded batches: row b sees keys `first_valid[b] <= j <=
  its position`), and refuses every other mask before any compute (a sliding window shorter than
  the keys, right padding, a static cache's unfilled slots, custom masks).

Uses only names public in transformers 5.17 through 5.2x.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import attention_into

NAME = "kvfid_triton"

# The layer mechanisms this attention serves (names of harness.protocol.serving.MECHANISMS:
# sliding_window, chunked_attention, softcap, sinks, split_head_dims, recurrent). kvfid refuses,
# before any compute, a model with a layer mechanism not listed here.
SERVES: frozenset[str] = frozenset()


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


def left_padding(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor | None:
    """[B] first valid key per row when a 4-D mask ([B or 1, H or 1, q, kv]; bool, True = attend,
    or additive float) is exactly causal with left padding; None for any other mask."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        return None
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point() and bool((mask[mask != 0] <= torch.finfo(mask.dtype).min / 2).all()):
        allowed = mask == 0
    else:
        return None
    pad = kv_len - allowed[..., -1, :].sum(-1)  # [B, H] (a fully padded row: kv_len)
    if not bool((pad == pad[:, :1]).all()):
        return None
    pad = pad[:, 0]  # [B]
    keys = torch.arange(kv_len, device=mask.device)
    q_pos = torch.arange(q_len, device=mask.device) + (kv_len - q_len)
    expected = (keys >= pad[:, None, None]) & (keys[None, None, :] <= q_pos[None, :, None])  # [B, q, kv]
    return pad if torch.equal(allowed, expected[:, None].expand(allowed.shape)) else None


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
    *,
    align_own: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query [B, Hq, T, D], key/value [B, Hkv, S, D] -> ([B, T, Hq, D], None).
    `align_own=False` gives the kernel's padding-variant twin (the tests' negative control)."""
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
    first_valid = None
    if attention_mask is not None and not _is_kernel_pattern(attention_mask, q_len, kv_len):
        first_valid = left_padding(attention_mask, q_len, kv_len)  # [B]
        if first_valid is None:
            raise ValueError(
                f"{NAME}: got an attention mask that is neither the plain causal pattern nor causal "
                "with left padding (right padding, a custom mask, or a static cache with unfilled "
                "slots). The kernel cannot honour other masks; feed left-padded batches with a "
                "dynamic cache.")
        first_valid = first_valid.expand(batch)
    # Padded query positions are not computed by the kernel: zeros, not uninitialized memory.
    empty = torch.empty if first_valid is None else torch.zeros
    out = empty((batch, q_len, n_q_heads, head_dim), dtype=query.dtype, device=query.device)
    attention_into(out.transpose(1, 2), query, key, value, scaling, first_valid,  # writes [B, Hq, T, D] view
                   align_own=align_own)
    return out, None


def register() -> str:
    """Register the attention and mask functions as "kvfid_triton" (idempotent); returns the name."""
    AttentionInterface.register(NAME, kvfid_triton_attention)
    AttentionMaskInterface.register(NAME, kvfid_triton_mask)
    return NAME
