"""Which keys each query selected, for sparse attention: an indexer's top-k choice recorded as a
part of its layer's state (`kvfid_selection`), so constructions compare it like any other part.

A sparse-attention indexer (DeepSeek-V3.2's DSA) is a module with a `layer_idx`, called with the
cache, that returns integer key indices [B, S, k]; it is found by that output, never by a
family's name. `recorded_selections(model)` hooks every module with a `layer_idx` (one whose
output is not key indices drops its hook after its first call): after an indexer's call the
selected keys of each query, restricted to the keys it may see (position <= its own; a prefill
row of fewer than k visible keys selects masked ones too), sorted and padded with -1 to the
indexer's `index_topk`, are appended to `cache.layers[layer_idx].kvfid_selection` [B, T, K].
Compared as a part with positions (`first_position`: the first query whose selection differs;
`n_diff`: how many selected slots differ). Restores the modules on exit.
"""

from __future__ import annotations

import contextlib

import torch

ATTRIBUTE = "kvfid_selection"


def _visible_sorted(indices: torch.Tensor, first: int, width: int) -> torch.Tensor:
    """indices [B, S, k] of queries at positions first..first+S-1 -> [B, S, width]: the visible
    keys in increasing order, then -1."""
    positions = torch.arange(first, first + indices.shape[1], device=indices.device)
    idx = indices.long()
    visible = idx <= positions[None, :, None]
    big = torch.iinfo(torch.int64).max
    ordered = torch.sort(torch.where(visible, idx, big), dim=-1).values
    ordered = torch.where(ordered == big, -1, ordered)
    if ordered.shape[-1] < width:
        ordered = torch.nn.functional.pad(ordered, (0, width - ordered.shape[-1]), value=-1)
    return ordered[..., :width]


def _selects_keys(output) -> bool:
    """An indexer's output: integer key indices [B, S, k]."""
    return (isinstance(output, torch.Tensor) and output.dim() == 3
            and not output.is_floating_point() and not output.is_complex())


def _record(module, args, kwargs, output) -> None:
    cache = next((a for a in [*args, *kwargs.values()] if hasattr(a, "layers")), None)
    if cache is None or module.layer_idx >= len(cache.layers):
        return
    layer = cache.layers[module.layer_idx]
    keys = getattr(layer, "indexer_keys", None)
    keys = keys if isinstance(keys, torch.Tensor) else getattr(layer, "keys", None)
    if not isinstance(keys, torch.Tensor):
        return
    total = keys.shape[1] if keys.dim() == 3 else keys.shape[-2]   # keys seen, this call included
    width = int(getattr(module, "index_topk", output.shape[-1]))
    new = _visible_sorted(output, total - output.shape[1], width)
    before = getattr(layer, ATTRIBUTE, None)
    setattr(layer, ATTRIBUTE, new if before is None else torch.cat([before, new], dim=1))


@contextlib.contextmanager
def recorded_selections(model: torch.nn.Module):
    """Within the block, every indexer's selection is recorded in its cache layer. A hooked module
    whose output is not key indices (an attention, a recurrent mixer: every call returns the same
    kind of output) loses its hook after that call, so the rest of the block calls it unhooked."""
    handles = {}

    def hook(module, args, kwargs, output) -> None:
        if _selects_keys(output):
            _record(module, args, kwargs, output)
        elif id(module) in handles:
            handles.pop(id(module)).remove()

    for m in model.modules():
        if isinstance(getattr(m, "layer_idx", None), int) and id(m) not in handles:
            handles[id(m)] = m.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        for handle in handles.values():
            handle.remove()


def unpadded(selection: torch.Tensor, pad: int) -> torch.Tensor:
    """A left-padded row's recorded selection [1, T, K] in the row's own positions: key indices
    shifted by `pad`, pad keys (masked, chosen only when fewer than K keys were visible) dropped
    like masked keys, visible ones first in increasing order, then -1."""
    if not pad:
        return selection
    shifted = torch.where(selection >= pad, selection - pad, torch.full_like(selection, -1))
    big = torch.iinfo(torch.int64).max
    ordered = torch.sort(torch.where(shifted < 0, big, shifted.long()), dim=-1).values
    return torch.where(ordered == big, -1, ordered).to(selection.dtype)
