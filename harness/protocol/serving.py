"""Which stacks serve which layers: each layer's state and mechanisms, read from the config and
transformers' cache classes (never from a family's name), against a table of what each built-in
attention backend serves.

Mechanisms: `sliding_window` (a layer that attends to its last W positions), `chunked_attention`
(block-local attention), `softcap` (attention-logit softcapping), `sinks` (a per-head sink logit in
the softmax denominator: an attention module with a `sinks` parameter), `split_head_dims` (value
head dim != query/key head dim, e.g. MLA), `recurrent` (linear attention / state-space layers:
they call no attention backend, so every backend serves them). A backend serves a layer when it
serves each of the layer's mechanisms; the triton kernel serves those in `kernels.hf.SERVES`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.protocol.layers import UnknownLayer, cache_layers, layer_kind

MECHANISMS = ("sliding_window", "chunked_attention", "softcap", "sinks", "split_head_dims",
              "recurrent")
STACKS = ("sdpa", "eager", "triton", "twin")


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
    import torch
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
    sinks = sink_layers(module if module is not None else skeleton(config))
    cap = getattr(config, "attn_logit_softcapping", None)
    softcap = cap is not None
    split = split_head_dims(config)
    out = []
    for index, (layer_type, layer) in enumerate(zip(_layer_types(config), cache_layers(config))):
        try:
            kind = layer_kind(layer, config)
        except UnknownLayer as err:
            raise UnknownLayer(f"model {getattr(config, 'model_type', '?')}: layer {index} "
                               f"({layer_type}): {err}") from None
        mechanisms = []
        window = getattr(layer, "sliding_window", None)
        if kind.endswith("window"):
            mechanisms.append("chunked_attention" if layer_type == "chunked_attention"
                              else "sliding_window")
        if kind.startswith("recurrent"):
            mechanisms.append("recurrent")
        if kind != "recurrent":   # the layer calls the attention backend
            mechanisms += [m for m, on in (("softcap", softcap), ("sinks", index in sinks),
                                           ("split_head_dims", split)) if on]
        out.append(LayerInfo(index, layer_type, type(layer).__name__, kind, tuple(mechanisms),
                             int(window) if window is not None else None,
                             float(cap) if softcap and kind != "recurrent" else None))
    return out


# --------------------------------------------------------------------------- the table

_SDPA_SINKS = ("transformers' sdpa attention takes no sink logits (the model class sets "
               "_supports_sdpa = False); use --backend eager")


def mechanism_reason(backend: str, mechanism: str, window: int | None = None,
                     length: int | None = None) -> str | None:
    """None when `backend` serves `mechanism`, else the one-line reason. Backends outside the
    built-in ones are not known: served (a user's function answers for itself)."""
    if mechanism == "recurrent":
        return None
    if backend == "sdpa":
        return {"softcap": "transformers' sdpa attention does not apply attention-logit "
                           "softcapping; use --backend eager",
                "sinks": _SDPA_SINKS}.get(mechanism)
    if backend == "twin":
        return {"softcap": "the twin attention ignores attention-logit softcapping",
                "sinks": "the twin attention ignores the sink logits"}.get(mechanism)
    if backend == "triton":
        from kernels.hf import SERVES

        if mechanism in SERVES:
            return None
        if mechanism in ("sliding_window", "chunked_attention") and window is not None \
                and length is not None and window >= length:
            return None   # the window covers every key a run of `length` tokens has
        return {"sliding_window": f"sliding-window attention (window {window} < {length} "
                                  "tokens); the triton kernel attends to every earlier position",
                "chunked_attention": f"chunked attention (blocks of {window} < {length} "
                                     "tokens); the triton kernel attends to every earlier position",
                "softcap": "the triton kernel does not apply attention-logit softcapping",
                "sinks": "the triton kernel takes no attention sinks",
                "split_head_dims": "the triton kernel needs one head dim for q, k and v"
                }.get(mechanism)
    return None


def model_reason(backend: str, module_class) -> str | None:
    """What transformers itself refuses for the whole model (its class flags)."""
    if backend == "sdpa" and module_class is not None and \
            getattr(module_class, "_supports_sdpa", True) is False:
        return (f"transformers: {module_class.__name__} does not support an attention "
                "implementation through torch.nn.functional.scaled_dot_product_attention yet")
    return None


def layer_reason(backend: str, info: LayerInfo, length: int | None = None) -> str | None:
    for mechanism in info.mechanisms:
        reason = mechanism_reason(backend, mechanism, info.window, length)
        if reason:
            cap = f" ({info.softcap})" if mechanism == "softcap" else ""
            return f"{mechanism}: {reason}".replace("softcapping", f"softcapping{cap}", 1)
    return None


def module_class(model_or_config, module=None):
    if module is not None:
        return type(module)
    master = getattr(model_or_config, "master", None)
    if master is not None:
        return type(master)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(text_config(model_or_config))]
    except (KeyError, ValueError):
        return None
