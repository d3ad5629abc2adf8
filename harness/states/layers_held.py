"""What a cache layer holds beyond its known base class, and what a model's own cache class holds
beside its layers: read by what is there (tensors, dicts of tensors), never by a family's name.

* A subclass of a known attention layer class (DeepSeek-V3.2's `DynamicIndexedLayer`: the
  indexer's key cache; DeepSeek-V4's compressed-attention layers: compressor buffers, compressed
  entries, overlap state) keeps its base's k/v and adds attributes. Each tensor attribute is a
  part named after it (`indexer_keys`); a dict of tensors gives one part per entry
  (`compressed_kv.indexer`). Counters and flags beside them (`entry_count.compressor`,
  `is_indexer_initialized`) are kept to restore the layer (`meta`), not compared: they follow
  from the parts and the positions.
* A model's own cache class (MiniMax's `MiniMaxCache`) may hold per-layer state in a list beside
  `layers` (`linear_cache[i]`): each such list gives layer i a part named after it.

`indexer_keys` and the recorded selection of an indexer (`kvfid_selection`, written by
kvfid.states.selection) have a position axis at dim -2, like k and v (`POSITIONAL_HELD`);
every other held part is compared whole.
"""

from __future__ import annotations

import torch

# Attributes the known base classes own (read and restored by kvfid.states.layers itself).
BASE_ATTRS = frozenset({"keys", "values", "is_initialized", "device", "dtype", "sliding_window",
                        "cumulative_length", "_sliding_window_tensor", "record_past"})
POSITIONAL_HELD = ("indexer_keys", "kvfid_selection")   # kvfid.states.selection
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)


class Unreadable(ValueError):
    """An attribute kvfid cannot read whole (its name and type in the message)."""


def _narrow(t: torch.Tensor, row: int, drop: int, positional: bool,
            batch: int | None) -> torch.Tensor:
    """Row `row` of t along its batch axis: the first of size `batch` (position ids keep theirs
    second: [dims, B, T]); a positional part without its first `drop` positions."""
    if t.dim() and t.shape[0] != batch and batch in t.shape:
        axis = list(t.shape).index(batch)
        t = t.narrow(axis, row, 1)
    elif t.dim():
        t = t[row:row + 1]
    return (t.narrow(-2, drop, t.shape[-2] - drop) if positional and drop else t).clone()


def held(layer, row: int = 0, drop: int = 0) -> tuple[dict, dict]:
    """(parts, meta) of what `layer` holds beyond BASE_ATTRS: tensor parts of batch row `row`
    (a positional one without its first `drop` positions), and the scalars that restore it.
    Unreadable names the first attribute of another kind."""
    parts, meta = {}, {}
    keys = getattr(layer, "keys", None)
    batch = keys.shape[0] if isinstance(keys, torch.Tensor) and keys.dim() else None
    for name, value in vars(layer).items():
        if name in BASE_ATTRS:
            continue
        if isinstance(value, torch.Tensor):
            parts[name] = _narrow(value, row, drop, name in POSITIONAL_HELD, batch)
        elif isinstance(value, dict):
            for key, entry in value.items():
                if isinstance(entry, torch.Tensor):
                    parts[f"{name}.{key}"] = _narrow(entry, row, drop, False, batch)
                elif isinstance(entry, _SCALARS):
                    meta[f"{name}.{key}"] = entry
                else:
                    raise Unreadable(f"{name}[{key!r}] ({type(entry).__name__})")
        elif isinstance(value, _SCALARS):
            meta[name] = value
        else:
            raise Unreadable(f"{name} ({type(value).__name__})")
    return parts, meta


def check_readable(layer) -> None:
    """Unreadable when `layer` holds something `held` cannot read (before any compute)."""
    held(layer)


def restore_held(layer, parts: dict, meta: dict) -> None:
    """Put held parts and meta back into a fresh layer of the same class (own copies)."""
    for name, value in [*meta.items(), *((n, t.clone()) for n, t in parts.items())]:
        if "." in name and isinstance(getattr(layer, name.split(".")[0], None), dict):
            attr, key = name.split(".", 1)
            getattr(layer, attr)[key] = value
        elif name not in BASE_ATTRS:
            setattr(layer, name, value)


def held_tensors(layer) -> list[torch.Tensor]:
    """Every tensor a layer holds beyond BASE_ATTRS (for row checks)."""
    out = []
    for name, value in vars(layer).items():
        if name in BASE_ATTRS:
            continue
        values = value.values() if isinstance(value, dict) else [value]
        out += [t for t in values if isinstance(t, torch.Tensor) and t.numel()]
    return out


# --------------------------------------------------------------------------- the cache's own lists

def cache_lists(cache) -> dict[str, list]:
    """Per-layer lists a cache object holds beside `layers` (entries: a tensor, or [] / None
    for a layer without one)."""
    out = {}
    for name, value in vars(cache).items():
        if name != "layers" and isinstance(value, list) and value and all(
                isinstance(v, torch.Tensor) or v in ([], None) for v in value):
            out[name] = value
    return out


def cache_parts(cache, index: int, row: int = 0) -> dict:
    """Layer `index`'s parts from the cache's own per-layer lists."""
    parts = {}
    for name, entries in cache_lists(cache).items():
        if index < len(entries) and isinstance(entries[index], torch.Tensor):
            parts[name] = entries[index][row:row + 1].clone()
    return parts


def restore_cache_parts(cache, states) -> None:
    """Put every layer's cache-list parts back into a fresh cache of the model's own class."""
    names = {n for s in states for n in s.parts if n in vars(cache)
             and isinstance(vars(cache)[n], list)}
    for name in names:
        setattr(cache, name, [s.parts[name].clone() if name in s.parts else []
                              for s in states])


def cache_length(cache) -> int:
    """Layers a cache covers: its layers, or longer per-layer lists of its own."""
    return max([len(cache.layers), *(len(v) for v in cache_lists(cache).values())])


def mechanisms(layer) -> tuple[str, ...]:
    """What a layer's held state says it computes: `sparse_indexer` (it keeps an indexer's keys:
    each query attends to the keys an indexer selects, folded into the attention mask) and
    `compressed_kv` (it keeps compressed entries that attention reads beside its window)."""
    names = set()
    for name, value in vars(layer).items():
        if name in BASE_ATTRS:
            continue
        names.add(name)
        if isinstance(value, dict):
            names |= {str(key) for key in value}
    out = []
    if any(n.startswith("indexer") for n in names):
        out.append("sparse_indexer")
    if "compressed_kv" in names:
        out.append("compressed_kv")
    return tuple(out)
