"""What a transformers attention mask tells kvfid's kernels: where the held keys sit and what each
query sees (kvfid.kernels.hf's factory calls `place_keys` before every kernel call).

Three kinds of mask are served. None or the plain causal pattern: the kernel's own causality.
Causal with left padding (and the layer's window): the kernel's positions' pattern
(kvfid.kernels.attention.reference.visible, the one statement of it), read as each row's padding; a
window the call does not pass (the model states it in its mask alone) is read from the mask. Any
other mask in which every query sees itself and no later key (a visibility mask: packed branches,
a tree's ancestors, documents): passed to the kernel as it is (kvfid.kernels.attention.views), where the
kernel serves `visibility`; on a sliding-window layer it is refused, since the mask is then not
the whole pattern. Right padding, a static cache's unfilled slots below a query, a
bidirectional mask: refused in one line before compute.

Two patterns are always given as a visibility, so their queries take one path in every
construction: a chunked layer's (`chunk_visibility`: each query in its chunk's coordinates, its
place in its chunk read from the position ids or else from the mask), and an indexer's selection
(`indices`: the mask's pattern narrowed to the keys selected, a query that was not given itself
and a padded query that sees nothing included).
"""

from __future__ import annotations

import torch
from transformers.masking_utils import sdpa_mask

from kvfid.kernels import KernelRefusal
from kvfid.kernels.attention.reference import visible
from kvfid.kernels.attention.views import as_visibility, check_causal, check_sees_itself


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
    """Mask function for `AttentionMaskInterface`: None when the kernel's own causality is the
    mask, unless the caller asked for the mask whatever it is (`allow_is_causal_skip=False`: a
    sparse indexer scores under it; the plain causal pattern is read as None here anyway)."""
    keep = kwargs.get("allow_is_causal_skip", True) is False
    kwargs["allow_is_causal_skip"] = False  # always materialize, so it can be inspected
    mask = sdpa_mask(*args, **kwargs)  # [B, 1, q, kv] bool
    if mask is None or keep:
        return mask
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
               device: torch.device, selection: torch.Tensor | None = None) -> dict:
    """The kernel's placement keywords for one call: `key_start` and `first_valid` (the
    positions' pattern; with `window` when only the mask states the layer's sliding window), or
    `visibility` [B, q, kv] bool (any other causal mask a kernel serving "visibility" takes; a
    chunked layer's pattern, with `chunk` None: see `chunk_visibility`; the mask's pattern
    narrowed to an indexer's `selection` [B, q, k] of held key indexes); refuses every other
    mask before compute."""
    if chunk is not None or selection is not None:
        if "visibility" not in serves:
            raise KernelRefusal(f"{name}: a chunked layer or a sparse selection is computed under "
                                "its visibility, which this kernel does not serve")
        if chunk is not None and selection is not None:
            raise KernelRefusal(f"{name}: a sparse selection on a chunked layer is not supported")
    if chunk is not None:
        visibility = chunk_visibility(name, mask, position_ids, batch, q_len, kv_len, window, chunk)
        return {"visibility": visibility.to(device), "chunk": None, "window": None}
    placed = _placed(name, mask, position_ids, batch, q_len, kv_len, window, serves, device,
                     sparse=selection is not None)
    if selection is None:
        return placed
    if placed.get("visibility") is None:   # the positions' pattern (window: refused in _placed)
        pads = placed.get("first_valid")
        own = placed["key_start"] - (0 if pads is None else pads.cpu())
        placed = {"visibility": visible(torch.as_tensor(own).expand(batch), q_len, kv_len)}
    chosen = _selected(name, selection, batch, q_len, kv_len)
    return {"visibility": (placed["visibility"].cpu() & chosen).to(device)}


# The last mask-free placement: every layer of one forward passes the same position ids, so the
# layers after the first compare the ids with the last call's (one op) instead of reading them
# again (several). Keyed by the ids' values (a copy: inference tensors keep no version counter,
# and a caller may update its ids in place) and the call's shape.
_last_placed: tuple | None = None


def _placed(name: str, mask: torch.Tensor | None, position_ids, batch: int, q_len: int,
            kv_len: int, window: int | None, serves: frozenset[str], device: torch.device,
            sparse: bool = False) -> dict:
    """`place_keys` for a layer that is not chunked: the positions' pattern or a visibility."""
    global _last_placed
    if mask is not None or not isinstance(position_ids, torch.Tensor):
        return _placed_now(name, mask, position_ids, batch, q_len, kv_len, window, serves, device,
                           sparse)
    key = (position_ids.dtype, position_ids.device, batch, q_len, kv_len, window, serves, device,
           sparse)
    last = _last_placed
    if last is not None and last[0] == key and torch.equal(last[1], position_ids):
        return dict(last[2])
    placed = _placed_now(name, mask, position_ids, batch, q_len, kv_len, window, serves, device,
                         sparse)
    _last_placed = (key, position_ids.clone(), dict(placed))
    return placed


def _placed_now(name: str, mask: torch.Tensor | None, position_ids, batch: int, q_len: int,
                kv_len: int, window: int | None, serves: frozenset[str], device: torch.device,
                sparse: bool = False) -> dict:
    own = _own_positions(name, mask, position_ids, batch, q_len, kv_len, window, None)
    allowed = None if own is not None else _allowed(mask) if mask.dim() == 4 \
        and tuple(mask.shape[-2:]) == (q_len, kv_len) else None   # read only when not the pattern
    found = {}
    if allowed is not None and window is None \
            and "sliding_window" in serves and own_starts(position_ids, batch, kv_len) is not None:
        # A layer whose window only its mask states (the call passes no `sliding_window`): the
        # window is the most keys a query sees, if the mask is exactly that window's pattern.
        seen = int(allowed.sum(-1).max())
        if seen < kv_len:
            own = _own_positions(name, mask, position_ids, batch, q_len, kv_len, seen, None)
            found = {"window": seen} if own is not None else {}
    if sparse and (window is not None or found):
        raise KernelRefusal(f"{name}: a sparse selection on a sliding-window layer is not supported")
    if own is not None:
        key_start = max(0, int(own.max()))
        first_valid = key_start - own  # [B] absolute position of each row's first valid key
        return {"key_start": key_start,
                "first_valid": first_valid.to(device) if bool(first_valid.any()) else None, **found}
    if allowed is None or "visibility" not in serves:
        raise _mask_error(name)
    if window is not None:
        raise KernelRefusal(f"{name}: a visibility mask on a sliding-window or chunked layer is not "
                             "supported (the kernel takes the mask as the whole pattern)")
    try:
        visibility = as_visibility(allowed, batch, q_len, kv_len)
        check_causal(visibility)
        if not sparse:   # under a selection, a padded query sees nothing and a query may skip itself
            check_sees_itself(visibility)
    except (ValueError, TypeError) as error:
        raise KernelRefusal(f"{name}: {error}") from None
    return {"visibility": visibility.to(device)}


def _selected(name: str, selection, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """[B, q, kv] bool: the held keys an indexer selected for each query (`indices` [B or 1, q, k],
    held key indexes; negative entries select nothing)."""
    if not isinstance(selection, torch.Tensor) or selection.dim() != 3 \
            or selection.dtype.is_floating_point or selection.shape[0] not in (1, batch) \
            or selection.shape[1] != q_len:
        shape = tuple(selection.shape) if isinstance(selection, torch.Tensor) else type(selection).__name__
        raise KernelRefusal(f"{name}: a sparse selection (`indices`) must be integer [B={batch}, "
                            f"q={q_len}, k]; got {shape}")
    picked = selection.long().cpu()
    if bool((picked >= kv_len).any()):
        raise KernelRefusal(f"{name}: a sparse selection (`indices`) names a key past the "
                            f"{kv_len} held ones")
    chosen = torch.zeros(picked.shape[0], q_len, kv_len + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(picked < 0, kv_len, picked), True)   # a negative: slot kv_len
    return chosen[..., :kv_len].expand(batch, q_len, kv_len)


def chunk_visibility(name: str, mask: torch.Tensor | None, position_ids, batch: int, q_len: int,
                     kv_len: int, window: int | None, chunk: int) -> torch.Tensor:
    """[B, q, kv] bool (CPU): what each query of a chunked (block-local) layer sees, which the
    kernels compute in each view's coordinates: a query's place in its chunk, never the chunk's
    number. From the position ids when the call has them; else from the mask (Llama 4's attention
    call carries no positions): the keys a query sees are its chunk's up to itself, so their
    number is its place in its chunk plus one, and a row's first unpadded query is own position 0.
    The chunk's number cannot be read (a window cache holds the same keys at position p and
    p + chunk), and the kernels' bits do not depend on it. Refused in one line when the mask is
    not such a pattern."""
    if own_starts(position_ids, batch, kv_len) is not None:
        own = _own_positions(name, mask, position_ids, batch, q_len, kv_len, window, chunk)
    else:
        own = _chunk_places(mask, batch, q_len, kv_len, window, chunk)
        if own is None:
            raise KernelRefusal(
                f"{name}: a chunked layer's call carries no position_ids, and its mask is not "
                f"the pattern of chunks of {chunk} from which each query's place in its chunk "
                "can be read (a mask of more keys than a chunk, or another mask)")
    if own is None:
        raise KernelRefusal(f"{name}: a visibility mask on a sliding-window or chunked layer is not "
                             "supported (the kernel takes the mask as the whole pattern)")
    return visible(own, q_len, kv_len, window, chunk)


def _chunk_places(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
                  window: int | None, chunk: int) -> torch.Tensor | None:
    """[B] own position of held key 0 (modulo the chunk where no padding is held) read from a
    chunked layer's mask alone; None when the mask is not exactly a chunk pattern."""
    if mask is None:   # the plain causal pattern (kvfid_mask): every held key in the last query's
        # chunk, which the cache holds from its start, so held key 0 starts it
        return torch.zeros(batch, dtype=torch.long) if kv_len <= chunk else None
    allowed = _allowed(mask) if mask.dim() == 4 and tuple(mask.shape[-2:]) == (q_len, kv_len) else None
    if allowed is None or not bool((allowed == allowed[:, :1]).all()):
        return None
    allowed = allowed[:, 0].cpu().expand(batch, q_len, kv_len)   # [B, q, kv]
    real = allowed.any(-1)   # [B, q]: a query that sees no key is padding
    first_real = torch.where(real.any(-1), real.int().argmax(-1), torch.full((batch,), q_len))
    last_place = allowed[:, -1].sum(-1) - 1   # the last query's place in its chunk
    own = torch.where(first_real > 0, -(kv_len - q_len + first_real),
                      torch.remainder(last_place - (kv_len - 1), chunk))
    return own if torch.equal(allowed, visible(own, q_len, kv_len, window, chunk)) else None


def _own_positions(name: str, mask: torch.Tensor | None, position_ids, batch: int, q_len: int,
                   kv_len: int, window: int | None, chunk: int | None) -> torch.Tensor | None:
    """[B] (CPU) own position of each row's held key 0 when the mask is the pattern the kernel
    applies from positions (causal, left padding, window, chunk); None for any other mask."""
    own = own_starts(position_ids, batch, kv_len)
    if own is None and (chunk is not None or window is not None):
        raise KernelRefusal(f"{name}: a sliding-window layer needs position_ids in the attention "
                             "kwargs (to place the held keys)")
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
