"""Layer states: what one layer of a transformers dynamic cache holds at a boundary, by kind.

Each cache layer is read as named parts, in a fixed order:

* `k`, `v` -- keys and values [1, H, T, D] over T held positions. Kind `full` holds every position
  of the prefix; kind `window` (a `DynamicSlidingWindowLayer`: sliding-window and chunked
  attention) holds only the last ones, from absolute position `start`; kind `latent` is what an
  MLA layer caches in those two slots (its compressed KV and its rotary key, one head each).
* `recurrent`, `conv` -- a linear-attention / state-space layer's recurrent state and its
  short-convolution state (`LinearAttentionCacheLayerMixin`): no position axis; a layer with
  several states names the later ones `recurrent.1`, `conv.1`, ...

The kinds come from the cache layer classes transformers builds from the config (its own
`DynamicCache(config=...)`) and from config fields (`kv_lora_rank` for MLA), never from a family's
name. A cache layer class not listed in `KNOWN` (a state kvfid cannot read whole) is refused
before any compute (`UnknownLayer`, exit 3), so no verdict is given over a partial state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.errors import Unavailable

POSITIONAL = ("k", "v")          # parts with a position axis (dim -2)
RECURRENT = ("recurrent", "conv")
PART_NAMES = POSITIONAL + RECURRENT


class UnknownLayer(Unavailable, ValueError):
    """A cache layer kvfid does not know how to read whole (exit 3, before compute)."""


@dataclass(frozen=True)
class LayerState:
    """One layer's state: its kind, its parts (name -> tensor, batch row 1), and the absolute
    position of the first held key (`start`; 0 for a layer that holds the whole prefix)."""

    kind: str
    parts: dict = field(default_factory=dict)
    start: int = 0
    cache_class: str = "DynamicLayer"

    @property
    def held(self) -> int | None:
        """Positions the k/v parts hold (None for a layer without them)."""
        return self.parts["k"].shape[-2] if "k" in self.parts else None

    @property
    def span(self) -> tuple[int, int] | None:
        """The absolute positions [start, end) the k/v parts cover."""
        return None if self.held is None else (self.start, self.start + self.held)

    def replace(self, **parts) -> "LayerState":
        return LayerState(self.kind, {**self.parts, **parts}, self.start, self.cache_class)


# --------------------------------------------------------------------------- known cache classes

def _classes():
    from transformers import cache_utils as cu

    attention = {cu.DynamicLayer: "full", cu.DynamicSlidingWindowLayer: "window"}
    recurrent = {cu.LinearAttentionLayer: None,
                 cu.LinearAttentionAndFullAttentionLayer: "full",
                 cu.LinearAttentionAndSlidingWindowAttentionLayer: "window"}
    return attention, recurrent


def known_classes() -> tuple[str, ...]:
    attention, recurrent = _classes()
    return tuple(c.__name__ for c in [*attention, *recurrent])


def latent(config) -> bool:
    """An MLA model: the cache holds a compressed latent (config `kv_lora_rank`), not K/V."""
    return getattr(config, "kv_lora_rank", None) is not None


def layer_kind(layer, config) -> str:
    """`full`, `window`, `latent`, `recurrent`, or `recurrent+full` / `recurrent+window` for a
    hybrid layer; UnknownLayer for a class kvfid does not know (exact class, not a subclass: a
    subclass may hold more than its parent)."""
    attention, recurrent = _classes()
    cls = type(layer)
    if cls in attention:
        kind = attention[cls]
        return "latent" if kind == "full" and latent(config) else kind
    if cls in recurrent:
        return "recurrent" + (f"+{recurrent[cls]}" if recurrent[cls] else "")
    raise UnknownLayer(f"cache layer {cls.__name__} holds a state kvfid does not know; "
                       f"known: {', '.join(known_classes())}")


def cache_layers(config) -> list:
    """The cache layers transformers builds for this config (no weights, no compute)."""
    import transformers
    from transformers import DynamicCache

    try:
        return list(DynamicCache(config=config).layers)
    except KeyError as err:   # a layer type this transformers builds no cache layer for
        raise UnknownLayer(f"layer type {err.args[0]!r} has no cache layer in transformers "
                           f"{transformers.__version__}") from None


def check_known(config, model_name: str = "model") -> list[str]:
    """Every layer's kind, or UnknownLayer naming the first layer kvfid cannot read whole."""
    kinds = []
    for index, layer in enumerate(cache_layers(config)):
        try:
            kinds.append(layer_kind(layer, config))
        except UnknownLayer as err:
            raise UnknownLayer(f"{model_name}: layer {index}: {err}") from None
    return kinds


# --------------------------------------------------------------------------- read and restore

def _recurrent_parts(layer, row: int) -> dict:
    parts = {}
    for index in range(layer.number_of_states):
        suffix = f".{index}" if index else ""
        for name, store in (("recurrent", layer.recurrent_states), ("conv", layer.conv_states)):
            tensor = store.get(index)
            if tensor is not None:
                parts[name + suffix] = tensor[row:row + 1].clone()
    return parts


def read_layer(layer, config, row: int = 0, pad: int = 0) -> LayerState:
    """Clone batch row `row` of one cache layer; a left-padded row drops its `pad` positions,
    and `start` is counted from the row's first real position."""
    kind = layer_kind(layer, config)
    parts = _recurrent_parts(layer, row) if kind.startswith("recurrent") else {}
    start = 0
    keys = getattr(layer, "keys", None)
    if keys is not None and keys.numel():
        held = keys.shape[-2]
        seen = int(getattr(layer, "cumulative_length", held))   # positions fed, padding included
        first = seen - held                                      # padded index of the first held
        drop = max(0, pad - first)
        parts = {"k": keys[row:row + 1, :, drop:].clone(),
                 "v": layer.values[row:row + 1, :, drop:].clone(), **parts}
        start = first + drop - pad
    return LayerState(kind, parts, start, type(layer).__name__)


def restore_layer(layer, state: LayerState, index: int) -> None:
    """Put `state` into a fresh cache layer of the same class (its own copies of the tensors:
    a decode step updates a conv state in place)."""
    if type(layer).__name__ != state.cache_class:
        raise ValueError(f"layer {index}: a {state.cache_class} state cannot go into a "
                         f"{type(layer).__name__} cache layer")
    if "k" in state.parts:
        layer.update(state.parts["k"], state.parts["v"])
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = state.start + state.held   # the window's absolute end
    for index_ in range(getattr(layer, "number_of_states", 0)):
        suffix = f".{index_}" if index_ else ""
        conv, recurrent = state.parts.get("conv" + suffix), state.parts.get("recurrent" + suffix)
        if conv is not None:   # one state per call, as transformers' own updates make them
            layer.lazy_initialization(conv_states=conv, state_idx=index_,
                                      conv_kernel_size=conv.shape[-1])
            layer.conv_states[index_].copy_(conv)
        if recurrent is not None:
            layer.lazy_initialization(recurrent_states=recurrent, state_idx=index_)
            layer.recurrent_states[index_].copy_(recurrent)
        layer.has_previous_state[index_] = conv is not None or recurrent is not None


def layer_tensors(layer) -> list[torch.Tensor]:
    """Every tensor one cache layer holds (k, v, recurrent and conv states)."""
    out = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
           if t is not None and t.numel()]
    for store in (getattr(layer, "recurrent_states", {}), getattr(layer, "conv_states", {})):
        out += [t for t in store.values() if t is not None]
    return out
