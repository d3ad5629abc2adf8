"""Which stacks serve which layers: each layer's state and mechanisms, read from the config and
transformers' cache classes (never from a family's name), against what each attention backend
says it refuses (kvfid.stacks.backends.AttentionBackend; no backend is named here).

Mechanisms: `sliding_window` (a layer that attends to its last W positions), `chunked_attention`
(block-local attention), `softcap` (attention-logit softcapping), `sinks` (a per-head sink logit in
the softmax denominator: an attention module with a `sinks` parameter), `split_head_dims` (value
head dim != query/key head dim, e.g. MLA), `recurrent` (linear attention / state-space layers:
they call no attention backend, so every backend serves them), `sparse_indexer` (each query
attends to the keys an indexer selects, passed as the attention mask to eager and sdpa and as
`indices` beside it to other implementations: DeepSeek-V3.2's DSA),
`compressed_kv` (compressed entries read beside a window: DeepSeek-V4), `bidirectional` (an
attention module with `is_causal = False`: a decoder built without its causal mask). A backend
serves a layer when it
serves each of the layer's mechanisms; our kernels serve those in `kvfid.kernels.hf.SERVES` (triton) and
`kvfid.kernels.hf_native.SERVES` (native). A window covering every key of a run needs no window support.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
import json
from pathlib import Path

import torch
from transformers import AutoConfig

from kvfid.states.layers import UnknownLayer, cache_layers, layer_kind
from kvfid.states.layers_held import mechanisms as held_mechanisms
from kvfid.inputs.models import ModelUnavailable, load_model

MECHANISMS = ("sliding_window", "chunked_attention", "softcap", "sinks", "split_head_dims",
              "recurrent", "sparse_indexer", "compressed_kv", "bidirectional")


@dataclass(frozen=True)
class LayerInfo:
    """One layer before any compute: transformers' layer type, its cache class, the kind of
    state kvfid reads from it, its mechanisms and its window (None: attends to every key)."""

    index: int
    layer_type: str
    cache_class: str
    kind: str
    mechanisms: tuple[str, ...]
    window: int | None = None
    softcap: float | None = None


def text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)   # a Model, a module, a config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_types(config) -> list[str]:
    try:
        # lazy: guarded: absent where the except below applies
        from transformers.cache_utils import get_layer_types_and_kwargs
        return list(get_layer_types_and_kwargs(config)[0])
    except ImportError:   # older transformers: the config's own list, else one kind for all
        n = int(config.num_hidden_layers)
        return list(getattr(config, "layer_types", None) or ["full_attention"] * n)


def split_head_dims(config) -> bool:
    """Value head dim differs from the query/key head dim (config fields, e.g. MLA's)."""
    v = getattr(config, "v_head_dim", None)
    qk = getattr(config, "qk_head_dim", None)
    if qk is None and getattr(config, "qk_nope_head_dim", None) is not None:
        qk = config.qk_nope_head_dim + (getattr(config, "qk_rope_head_dim", 0) or 0)
    qk = qk if qk is not None else getattr(config, "head_dim", None)
    return v is not None and qk is not None and int(v) != int(qk)


def skeleton(config):
    """The model's modules on the meta device (no weights, no memory): what its layers hold."""
    # lazy: the auto classes load every model's mapping: only here
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def sink_layers(module) -> set[int]:
    """Indices of the decoder layers whose attention has a `sinks` parameter."""
    out = set()
    for name, _ in module.named_parameters():
        match = re.search(r"layers\.(\d+)\..*sinks$", name)
        if match:
            out.add(int(match[1]))
    return out


def describe_layers(model_or_config, module=None) -> list[LayerInfo]:
    """Every layer's state and mechanisms; UnknownLayer naming the first layer kvfid cannot
    read whole. `module`: the model (a Model's master); else a meta-device skeleton is built."""
    config = text_config(model_or_config)
    module = module if module is not None else getattr(model_or_config, "master", None)
    layers = cache_layers(config)
    for index, (layer_type, layer) in enumerate(zip(_layer_types(config), layers)):
        try:
            layer_kind(layer, config, index)   # an unknown state: refused before the skeleton
        except UnknownLayer as err:
            raise UnknownLayer(f"model {getattr(config, 'model_type', '?')}: layer {index} "
                               f"({layer_type}): {err}") from None
    modules = module if module is not None else skeleton(config)
    sinks = sink_layers(modules)
    bidirectional = any(getattr(m, "is_causal", None) is False for m in modules.modules())
    cap = getattr(config, "attn_logit_softcapping", None)
    softcap = cap is not None
    per_layer = _per_layer_configs(config, len(layers))
    out = []
    for index, (layer_type, layer) in enumerate(zip(_layer_types(config), layers)):
        kind = layer_kind(layer, config, index)
        split = split_head_dims(per_layer[index])
        mechanisms = []
        window = getattr(layer, "sliding_window", None)
        if kind.endswith("window"):
            mechanisms.append("chunked_attention" if layer_type == "chunked_attention"
                              else "sliding_window")
        if kind.startswith("recurrent"):
            mechanisms.append("recurrent")
        if kind not in ("recurrent", "stateless"):   # the layer calls the attention backend
            mechanisms += [m for m, on in (("softcap", softcap), ("sinks", index in sinks),
                                           ("split_head_dims", split)) if on]
            mechanisms += held_mechanisms(layer) + (("bidirectional",) if bidirectional else ())
        info = LayerInfo(index, layer_type, type(layer).__name__, kind, tuple(mechanisms),
                         int(window) if window is not None else None,
                         float(cap) if softcap and kind != "recurrent" else None)
        if kind.startswith("shared:"):   # attends like the layer whose K/V it reads
            owner = out[int(kind.split(":")[1])]
            info = LayerInfo(index, owner.layer_type, info.cache_class, kind, owner.mechanisms,
                             owner.window, owner.softcap)
        out.append(info)
    return out


def _per_layer_configs(config, n: int) -> list:
    """Each layer's own config where the config is heterogeneous (per-layer head dims: reading
    such a field globally raises), else the config itself for every layer."""
    try:
        per_layer = list(config.per_layer_config)
    except (AttributeError, TypeError):
        per_layer = []
    return per_layer[:n] if len(per_layer) >= n else [config] * n   # older: cached layers first


# --------------------------------------------------------------------------- the table

def mechanism_reason(backend, mechanism: str, window: int | None = None,
                     length: int | None = None) -> str | None:
    """None when `backend` (an AttentionBackend) serves `mechanism`, else its one-line reason."""
    reason = None if mechanism == "recurrent" else backend.unserved().get(mechanism)
    if reason is None or mechanism in ("sliding_window", "chunked_attention") and \
            window is not None and length is not None and window >= length:
        return None   # served, or the window covers every key a run of `length` tokens has
    return reason.format(window=window, length=length)


def model_reason(backend, module_class) -> str | None:
    """What `backend` refuses for the whole model class (e.g. transformers' class flags)."""
    return backend.model_refusal(module_class)


def layer_reason(backend, info: LayerInfo, length: int | None = None) -> str | None:
    """Every mechanism of the layer the backend does not serve, with its reason, on one line."""
    reasons = []
    for mechanism in info.mechanisms:
        reason = mechanism_reason(backend, mechanism, info.window, length)
        if reason:
            cap = f" ({info.softcap})" if mechanism == "softcap" else ""
            reasons.append(f"{mechanism}: {reason}".replace("softcapping", f"softcapping{cap}", 1))
    return "; ".join(reasons) or None


def module_class(model_or_config, module=None):
    if module is not None:
        return type(module)
    master = getattr(model_or_config, "master", None)
    if master is not None:
        return type(master)
    # lazy: the auto classes load every model's mapping: only here
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(text_config(model_or_config))]
    except (KeyError, ValueError):
        return None


# --------------------------------------------------------------------------- `kvfid models X`

def load_config(name: str):
    """A model's config without its weights: `hf:<folder>` reads config.json; a preset is
    loaded (tiny presets build in a second)."""
    if name.startswith("hf:"):
        if not (Path(name[3:]) / "config.json").is_file():
            raise ModelUnavailable(f"{name}: no config.json in that folder")
        try:
            return AutoConfig.from_pretrained(name[3:])
        except (OSError, ValueError, KeyError) as err:
            first = (str(err).splitlines() or [""])[0][:200]
            raise ModelUnavailable(f"{name}: not a readable config ({type(err).__name__}: "
                                   f"{first})") from None

    return load_model(name).config


def serving_table(name: str, backends: list, length: int | None = None) -> dict:
    """Each group of like layers of a model (layer type, state kind, mechanisms) and, per
    backend of `backends` (AttentionBackends), None (served) or why not; before any compute,
    from the config only."""
    config = text_config(load_config(name))
    model_type = getattr(config, "model_type", "?")
    try:
        infos = describe_layers(config)
    except UnknownLayer as err:
        return {"model": name, "model_type": model_type, "refused": str(err), "layers": []}
    need = length or int(getattr(config, "max_position_embeddings", 0) or 0)
    cls = module_class(config)
    groups: dict = {}
    for info in infos:
        key = (info.layer_type, info.cache_class, info.kind, info.mechanisms, info.window)
        groups.setdefault(key, []).append(info)
    rows = []
    for (layer_type, cache_class, kind, mechanisms, window), members in groups.items():
        stacks = {b.name: layer_reason(b, members[0], need) or model_reason(b, cls) for b in backends}
        rows.append({"layers": [m.index for m in members], "layer_type": layer_type,
                     "cache_class": cache_class, "state": kind, "window": window,
                     "mechanisms": list(mechanisms), "stacks": stacks})
    return {"model": name, "model_type": model_type, "length": need, "refused": None,
            "layers": rows}


def _ranges(indices: list[int]) -> str:
    out, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(out)


def describe_serving(name: str, backends: list, fmt: str = "text", length: int | None = None) -> str:
    """`kvfid models MODEL`: the serving table (columns: `backends`) as text or JSON."""
    table = serving_table(name, backends, length)
    if fmt == "json":
        return json.dumps(table, indent=2)
    lines = [f"{name} ({table['model_type']})"]
    if table["refused"]:
        return "\n".join(lines + [f"  refused on every stack: {table['refused']}"])
    lines[0] += f", runs up to {table['length']} tokens"
    for row in table["layers"]:
        window = f", window {row['window']}" if row["window"] else ""
        lines.append(f"  layers {_ranges(row['layers'])}: {row['layer_type']} -> state "
                     f"{row['state']}{window}; mechanisms: {', '.join(row['mechanisms']) or '-'}")
        for stack, reason in row["stacks"].items():
            lines.append(f"    {stack:<7} {'served' if reason is None else 'no: ' + reason}")
    return "\n".join(lines)
