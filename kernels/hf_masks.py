"""What a transformers attention mask tells kvfid's kernels: where the held keys sit and what each
query sees (kvfid.kernels.hf's factory calls `place_keys` before every kernel call).

Three kinds of mask are served. None or the plain causal pattern: the kernel's own causality.
Causal with left padding (and the layer's window or chunk): the kernel's positions' pattern
(kvfid.kernels.attention.reference.visible, the one statement of it), read as each row's padding; a
window the call does not pass (the model states it in its mask alone) is read from the mask. Any
other mask in which every query sees itself and no later key (a visibility mask: packed branches,
a tree's ancestors, documents): passed to the kernel as it is (kvfid.kernels.attention.views), where the
kernel serves `visibility`; on a sliding-window or chunked layer it is refused, since the mask is
then not the whole pattern. Right padding, a static cache's unfilled slots below a query, a
bidirectional mask: refused in one line before compute.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import sdpa_mask

from kvfid.kernels import KernelRefusal
from kvfid.kernels.attention.reference import visible
from kvfid.kernels.attention.views import as_visibility, check_causal


def _kernel_pattern(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: query i (absolute position kv_len - q_len + i) sees key j <= it."""
    return visible(torch.zeros(1, dtype=torch.long, device=device), q_len, kv_len)[0]


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """A 4-D mask as bool (True = attend), or None when it is neither bool nor a 0 / -inf float mask."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() and bool((mask[mask != 0] <= torch.finfo(mask.dtype).min / 2).all()):
        return mask == 0
    return None


def _is_kernel_pattern(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """True when a 4-D mask (bool, True = attend; or additive float) is exactly the plain causal one."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        return False
    allowed = _allowed(mask)
    return allowed is not None and torch.equal(
        allowed, _kernel_pattern(q_len, kv_len, mask.device).expand(mask.shape))


def left_padding(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor | None:
    """[B] first valid key per row when a 4-D mask ([B or 1, H or 1, q, kv]; bool, True = attend,
    or additive float) is exactly causal with left padding; None for any other mask."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        return None
    allowed = _allowed(mask)
    if allowed is None:
        return None
    pad = _held_padding(allowed)
    if pad is None:
        return None
    return pad if torch.equal(allowed, visible(-pad, q_len, kv_len)[:, None].expand(
        allowed.shape)) else None


def _held_padding(allowed: torch.Tensor) -> torch.Tensor | None:
    """[B] held keys the last query does not see before its first visible one (its left padding,
    or all keys for a row with none), from a bool mask [B, H, q, kv]; None if heads disagree."""
    last = allowed[..., -1, :]  # [B, H, kv]
    kv_len = last.shape[-1]
    first = torch.where(last.any(-1), last.int().argmax(-1), torch.full_like(last[..., 0], kv_len,
                                                                            dtype=torch.long))
    return first[:, 0] if bool((first == first[:, :1]).all()) else None


def kvfid_mask(*args, **kwargs) -> torch.Tensor | None:
    """Mask function for `AttentionMaskInterface`: None when the kernel's own causality is the mask."""
    kwargs["allow_is_causal_skip"] = False  # always materialize, so it can be inspected
    mask = sdpa_mask(*args, **kwargs)  # [B, 1, q, kv] bool
    if mask is None:
        return None
    q_len, kv_len = mask.shape[-2:]
    return None if _is_kernel_pattern(mask, q_len, kv_len) else mask


def own_starts(position_ids: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """[B] own position of each row's held key 0, from the queries' position ids; None without them."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
            or position_ids.dtype.is_floating_point or position_ids.shape[0] not in (1, batch):
        return None
    return (position_ids[:, -1].to(torch.long) - (kv_len - 1)).expand(batch)


def place_keys(name: str, mask: torch.Tensor | None, position_ids, batch: int, q_len: int,
               kv_len: int, window: int | None, chunk: int | None, serves: frozenset[str],
               device: torch.device) -> dict:
    """The kernel's placement keywords for one call: `key_start` and `first_valid` (the
    positions' pattern; with `window` when only the mask states the layer's sliding window), or
    `visibility` [B, q, kv] bool (any other causal mask a kernel serving "visibility" takes);
    refuses every other mask before compute."""
    own = _own_positions(name, mask, position_ids, batch, q_len, kv_len, window, chunk)
    allowed = None if own is not None else _allowed(mask) if mask.dim() == 4 \
        and tuple(mask.shape[-2:]) == (q_len, kv_len) else None   # read only when not the pattern
    found = {}
    if allowed is not None and window is None and chunk is None \
            and "sliding_window" in serves and own_starts(position_ids, batch, kv_len) is not None:
        # A layer whose window only its mask states (the call passes no `sliding_window`): the
        # window is the most keys a query sees, if the mask is exactly that window's pattern.
        seen = int(allowed.sum(-1).max())
        if seen < kv_len:
            own = _own_positions(name, mask, position_ids, batch, q_len, kv_len, seen, None)
            found = {"window": seen} if own is not None else {}
    if own is not None:
        key_start = max(0, int(own.max()))
        first_valid = key_start - own  # [B] absolute position of each row's first valid key
        return {"key_start": key_start,
                "first_valid": first_valid.to(device) if bool(first_valid.any()) else None, **found}
    if allowed is None or "visibility" not in serves:
        raise _mask_error(name)
    if window is not None or chunk is not None:
        raise KernelRefusal(f"{name}: a visibility mask on a sliding-window or chunked layer is not "
                             "supported (the kernel takes the mask as the whole pattern)")
    try:
        visibility = as_visibility(allowed, batch, q_len, kv_len)
        check_causal(visibility)
    except (ValueError, TypeError) as error:
        raise KernelRefusal(f"{name}: {error}") from None
    return {"visibility": visibility.to(device)}


def _own_positions(name: str, mask: torch.Tensor | None, position_ids, batch: int, q_len: int,
                   kv_len: int, window: int | None, chunk: int | None) -> torch.Tensor | None:
    """[B] (CPU) own position of each row's held key 0 when the mask is the pattern the kernel
    applies from positions (causal, left padding, window, chunk); None for any other mask."""
    own = own_starts(position_ids, batch, kv_len)
    if own is None and (chunk is not None or window is not None):
        raise KernelRefusal(f"{name}: a sliding-window or chunked layer needs position_ids in the "
                             "attention kwargs (to place the held keys)")
    own = torch.zeros(batch, dtype=torch.long) if own is None else own.cpu()
    if mask is None or _is_kernel_pattern(mask, q_len, kv_len):
        # No padding: a held key 0 below own position 0 means position ids that are not held
        # indexes (a stage program's parallel branches), so the keys start at 0.
        return own.clamp(min=0)
    allowed = _allowed(mask) if mask.dim() == 4 and tuple(mask.shape[-2:]) == (q_len, kv_len) else None
    if allowed is None:
        return None
    allowed = allowed.cpu()

    def matches(starts: torch.Tensor) -> bool:
        return torch.equal(allowed, visible(starts, q_len, kv_len, window, chunk)[:, None]
                           .expand(allowed.shape))

    if matches(own):  # position ids count each row's own positions (generate, kvfid's co-batches)
        return own
    # Else one padded-absolute range for every row (a plain forward with a mask): a row's padding
    # is what its last query does not see before the first key its window or chunk would show.
    first = _held_padding(allowed)
    if first is None or not bool((own == own[:1]).all()):
        return None
    first = first.expand(batch)
    local = torch.zeros(batch, dtype=torch.long)
    if window is not None:
        local = torch.full((batch,), max(0, kv_len - window))
    if chunk is not None:
        last = own + kv_len - 1
        local = torch.maximum(local, (torch.div(last, chunk, rounding_mode="floor") * chunk - own).clamp(min=0))
    own = torch.where(first == kv_len, -kv_len, torch.where(first > local, -first, own))
    return own if matches(own) else None


def _mask_error(name: str) -> KernelRefusal:
    return KernelRefusal(
        f"{name}: got an attention mask that is neither the plain causal pattern nor causal with "
        "left padding (and the layer's window or chunk) nor a visibility mask this kernel serves "
        "(a custom mask, or a static cache with unfilled slots). Feed left-padded batches with a "
        "dynamic cache, or a visibility mask to a kernel that serves one.")
