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
name. A layer that holds no state of its own is `stateless` (a block without attention) or
`shared:J` (a layer that reads layer J's K/V, config `kv_sharing_modes`: compared and transplanted
through J). A subclass of a known attention layer keeps its base's kind and adds what it holds
(kvfid.states.layers_held: an indexer's key cache, compressor buffers); a model's own cache
class adds the per-layer lists it keeps. A cache layer class kvfid cannot read whole is refused
before any compute (`UnknownLayer`, exit 3), so no verdict is given over a partial state.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import transformers
from transformers import DynamicCache, cache_utils as cu

from kvfid.errors import Unavailable
from kvfid.states import heads, layers_held, selection

POSITIONAL = ("k", "v", *layers_held.POSITIONAL_HELD)   # parts with a position axis (dim -2)
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
    meta: dict = field(default_factory=dict)   # counters and flags that restore held parts

    @property
    def held(self) -> int | None:
        """Positions the k/v parts hold (None for a layer without them)."""
        return self.parts["k"].shape[-2] if "k" in self.parts else None

    @property
    def span(self) -> tuple[int, int] | None:
        """The absolute positions [start, end) the k/v parts cover."""
        return None if self.held is None else (self.start, self.start + self.held)

    def replace(self, **parts) -> "LayerState":
        return LayerState(self.kind, {**self.parts, **parts}, self.start, self.cache_class,
                          self.meta)

    @property
    def owner(self) -> int | None:
        """The layer whose state a `shared:J` layer reads (None for any other kind)."""
        return int(self.kind.split(":")[1]) if self.kind.startswith("shared:") else None


# --------------------------------------------------------------------------- known cache classes

def _classes():
    attention = {cu.DynamicLayer: "full", cu.DynamicSlidingWindowLayer: "window"}
    recurrent = {cu.LinearAttentionLayer: None,
                 cu.LinearAttentionAndFullAttentionLayer: "full",
                 cu.LinearAttentionAndSlidingWindowAttentionLayer: "window"}
    return attention, recurrent


def _stateless_class():
    return getattr(cu, "DummyLayer", None)   # transformers >= 5.2x: a layer without a state


def known_classes() -> tuple[str, ...]:
    attention, recurrent = _classes()
    stateless = [c for c in [_stateless_class()] if c is not None]
    return tuple(c.__name__ for c in [*attention, *recurrent, *stateless])


def latent(config) -> bool:
    """An MLA model: the cache holds a compressed latent (config `kv_lora_rank`), not K/V."""
    return getattr(config, "kv_lora_rank", None) is not None


def owner_of(config, index: int) -> int | None:
    """The layer whose K/V layer `index` reuses (config `kv_sharing_modes`: the last layer of
    the same layer type that stores its K/V), None for a layer that keeps its own."""
    modes = getattr(config, "kv_sharing_modes", None)
    if not modes or index is None or modes[index] != "reuse":
        return None
    types = list(getattr(config, "layer_types", None) or [None] * len(modes))
    owners = [j for j in range(index) if modes[j] != "reuse" and types[j] == types[index]]
    return owners[-1] if owners else None


def layer_kind(layer, config, index: int | None = None) -> str:
    """`full`, `window`, `latent`, `recurrent`, `recurrent+full` / `recurrent+window` for a
    hybrid layer, `stateless` or `shared:J` for a layer without a state of its own; UnknownLayer
    for a class kvfid cannot read whole (a subclass of a known attention class is read with what
    it holds beyond it; of a recurrent class, refused: its state would be read in part)."""
    attention, recurrent = _classes()
    cls = type(layer)
    if cls is _stateless_class() and not layer_tensors(layer):
        owner = owner_of(config, index)
        return "stateless" if owner is None else f"shared:{owner}"
    if cls in recurrent:
        return "recurrent" + (f"+{recurrent[cls]}" if recurrent[cls] else "")
    base = next((c for c in cls.__mro__ if c in attention), None)
    if base is None or any(c in recurrent for c in cls.__mro__):
        raise UnknownLayer(f"cache layer {cls.__name__} holds a state kvfid does not know; "
                           f"known: {', '.join(known_classes())} and subclasses of the "
                           "attention ones")
    if base is not cls:
        try:
            layers_held.check_readable(layer)
        except layers_held.Unreadable as err:
            raise UnknownLayer(f"cache layer {cls.__name__} holds {err}, which kvfid cannot "
                               "read whole") from None
    kind = attention[base]
    return "latent" if kind == "full" and latent(config) else kind


def cache_layers(config) -> list:
    """The cache layers transformers builds for this config (no weights, no compute)."""
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
            kinds.append(layer_kind(layer, config, index))
        except UnknownLayer as err:
            raise UnknownLayer(f"{model_name}: layer {index}: {err}") from None
    return kinds


# --------------------------------------------------------------------------- read and restore

def _counters(layer, pad: int = 0) -> dict:
    """A layer's integer counters (0-dim integer tensors: transformers 5.25's
    `cumulative_length_linear`, the tokens a linear layer has seen, which is its
    `get_seq_length` and so the cache's next position), less a left-padded row's `pad`."""
    return {name: int(value) - pad for name, value in vars(layer).items()
            if isinstance(value, torch.Tensor) and value.dim() == 0
            and not value.is_floating_point() and name not in layers_held.BASE_ATTRS}


def _recurrent_parts(layer, row: int) -> dict:
    parts = {}
    for index in range(layer.number_of_states):
        suffix = f".{index}" if index else ""
        for name, store in (("recurrent", layer.recurrent_states), ("conv", layer.conv_states)):
            tensor = store.get(index)
            if tensor is not None:
                parts[name + suffix] = tensor[row:row + 1].clone()
    return parts


def read_layer(layer, config, row: int = 0, pad: int = 0, index: int | None = None,
               cache=None) -> LayerState:
    """Clone batch row `row` of one cache layer (None: a layer the cache has not made yet); a
    left-padded row drops its `pad` positions, and `start` is counted from the row's first real
    position. `cache`: its own per-layer lists (a model's cache class) join layer `index`."""
    kind = layer_kind(layer, config, index) if layer is not None else "stateless"
    parts = _recurrent_parts(layer, row) if kind.startswith("recurrent") else {}
    start, drop = 0, 0
    meta = _counters(layer, pad) if kind.startswith("recurrent") else {}
    keys = getattr(layer, "keys", None)
    if keys is not None and keys.numel():
        held = keys.shape[-2]
        seen = int(getattr(layer, "cumulative_length", held))   # positions fed, padding included
        first = seen - held                                      # padded index of the first held
        drop = max(0, pad - first)
        parts = {**heads.read_whole({"k": keys[row:row + 1, :, drop:].clone(),
                                     "v": layer.values[row:row + 1, :, drop:].clone()}), **parts}
        start = first + drop - pad
    if layer is not None and kind in ("full", "window", "latent") and type(layer) not in _classes()[0]:
        extra, held_meta = layers_held.held(layer, row, drop)
        meta.update(held_meta)
        if selection.ATTRIBUTE in extra:   # recorded in the padded row's key indices
            extra[selection.ATTRIBUTE] = selection.unpadded(extra[selection.ATTRIBUTE], pad)
        parts.update(extra)
    own = layers_held.cache_parts(cache, index, row) if cache is not None else {}
    if own:
        parts.update(own)
        kind = "recurrent" if "k" not in parts else kind   # a linear state kept by the cache
    cls = type(layer) if layer is not None else getattr(cache, "layer_class_to_replicate", None)
    return LayerState(kind, parts, start, getattr(cls, "__name__", "none"), meta)


def read_cache(cache, config, row: int = 0, pad: int = 0) -> tuple[LayerState, ...]:
    """Every layer's state in `cache` (its layers and the per-layer lists its class keeps)."""
    layers = list(cache.layers)
    n = layers_held.cache_length(cache)
    return tuple(read_layer(layers[i] if i < len(layers) else None, config, row, pad, i, cache)
                 for i in range(n))


def restore_layer(layer, state: LayerState, index: int) -> None:
    """Put `state` into a fresh cache layer of the same class (its own copies of the tensors:
    a decode step updates a conv state in place)."""
    if type(layer).__name__ != state.cache_class:
        raise ValueError(f"layer {index}: a {state.cache_class} state cannot go into a "
                         f"{type(layer).__name__} cache layer")
    counters = {n: c for n, c in state.meta.items() if n in _counters(layer)}
    for name, count in counters.items():   # in place: the cache may hold its address
        getattr(layer, name).fill_(count)
    meta = {n: v for n, v in state.meta.items() if n not in counters}
    if meta:   # flags first: an indexer initialised lazily would drop its restored keys
        layers_held.restore_held(layer, {}, meta)
    if "k" in state.parts:
        layer.update(*heads.kept({"k": state.parts["k"], "v": state.parts["v"]}).values())
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = state.start + state.held   # the window's absolute end
    if type(layer) not in _classes()[0] and state.kind in ("full", "window", "latent"):
        layers_held.restore_held(layer, {n: t for n, t in state.parts.items()
                                         if n not in ("k", "v")}, meta)
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


def restore_cache(cache, states) -> None:
    """Put every layer state into a fresh cache (a lazily grown cache gets its layers first)."""
    replicate = getattr(cache, "layer_class_to_replicate", None)
    while replicate is not None and len(cache.layers) < len(states):
        cache.layers.append(replicate())
    fresh = {type(layer).__name__: layer for layer in reversed(cache.layers)}
    while len(cache.layers) < len(states) and states[len(cache.layers)].cache_class in fresh:
        # layers the model appends to its cache in its forward (a looped model's copies of its
        # own layers, one per loop): a copy of a fresh layer of the state's class
        cache.layers.append(copy.deepcopy(fresh[states[len(cache.layers)].cache_class]))
    if len(cache.layers) != len(states):
        raise ValueError(f"a state of {len(states)} layers cannot go into a cache of "
                         f"{len(cache.layers)}")
    for index, (layer, state) in enumerate(zip(cache.layers, states)):
        restore_layer(layer, state, index)
    layers_held.restore_cache_parts(cache, states)


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache holds: each layer's, and the per-layer lists of its own class."""
    out = [t for layer in cache.layers for t in layer_tensors(layer)]
    return out + [t for v in layers_held.cache_lists(cache).values() for t in v
                  if isinstance(t, torch.Tensor)]


def layer_tensors(layer) -> list[torch.Tensor]:
    """Every tensor one cache layer holds (k, v, recurrent and conv states)."""
    out = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
           if t is not None and t.numel()]
    for store in (getattr(layer, "recurrent_states", {}), getattr(layer, "conv_states", {})):
        out += [t for t in store.values() if t is not None]
    return out + (layers_held.held_tensors(layer) if type(layer) not in _classes()[0] and
                  hasattr(layer, "keys") and getattr(layer, "recurrent_states", None) is None
                  else [])


# --------------------------------------------------------------------------- a model's own cache

_OWN_CACHE: dict[type, type] = {}


def empty_cache(module):
    """An empty cache for `module`: transformers' dynamic cache built from the config, or, for a
    model that says it cannot use one (`_supports_default_dynamic_cache()`, as `generate` asks),
    a fresh instance of the cache class the model's own forward prepares (learned once per model
    class from a one-token call whose output is discarded)."""
    supports = getattr(module, "_supports_default_dynamic_cache", None)
    if supports is None or supports():
        return DynamicCache(config=module.config)
    cls = type(module)
    if cls not in _OWN_CACHE:
        device = next(module.parameters()).device
        with torch.no_grad():
            out = module(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                         use_cache=True, logits_to_keep=1)
        made = out.get("cache", None) or out.get("past_key_values", None)
        if made is None:
            raise UnknownLayer(f"{cls.__name__} prepares no cache of its own to read")
        _OWN_CACHE[cls] = type(made)
    try:
        return _OWN_CACHE[cls]()
    except TypeError as err:
        raise UnknownLayer(f"{cls.__name__}'s own cache class {_OWN_CACHE[cls].__name__} cannot "
                           f"be made empty: {err}") from None
