"""The attention backends: a registry (`sdpa`, `eager`, `triton`, `native`, `twin`, a user's
`module:function`, transformers-registered implementations) in which each backend says what it
refuses, so a new one (our Triton kernel) joins without the protocol knowing. The one place that
names backends; `kvfid.stacks.stack` sets one for a measurement.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvfid.names import BACKENDS, DTYPE_NAMES

from kvfid.kernels import DTYPES  # noqa: E402  (re-exported: the stack's dtype names)
from kvfid.kernels import hf, hf_native   # triton waits for a kernel call (kvfid.kernels.hf)
from kvfid.kernels.hf import COMPILE_BREAKS
from kvfid.stacks import twins

if tuple(DTYPES) != DTYPE_NAMES:      # the command line offers kvfid.names' spelling
    raise ImportError(f"kvfid.kernels.DTYPES {tuple(DTYPES)} != kvfid.names.DTYPE_NAMES {DTYPE_NAMES}")


def _refuses_nothing(*_) -> None:
    return None


@dataclass(frozen=True)
class AttentionBackend:
    """A named attention implementation; `implementation()` registers it if needed and returns
    the name transformers knows it by. It says itself what it refuses (the protocol asks, and
    never tests its name): `unserved()`, each mechanism of kvfid.stacks.serving.MECHANISMS it
    does not serve and why (`{window}` and `{length}` filled in there); `model_refusal(module
    class)`, why it cannot run a whole model class; `causal_only`, encoder-decoder models refused;
    `compile_refusal()`, why `+compile` cannot compile its forward here. A user's function or a
    transformers implementation refuses nothing: it answers for itself."""

    name: str
    description: str
    implementation: Callable[[], str]
    unserved: Callable[[], dict[str, str]] = dict
    model_refusal: Callable[[type | None], str | None] = _refuses_nothing
    causal_only: bool = False
    compile_refusal: Callable[[], str | None] = _refuses_nothing


_BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> None:
    _BACKENDS[backend.name] = backend


def backend_names() -> list[str]:
    return list(_BACKENDS)


def _user_implementation(spec: str, function: Callable) -> Callable[[], str]:
    def register() -> str:
        AttentionInterface.register(spec, function)
        AttentionMaskInterface.register(spec, sdpa_mask)  # else the causal/padding mask is dropped
        return spec
    return register


def attention_backend(name: str) -> AttentionBackend:
    """The backend called `name`: a registered one (sdpa, eager, triton, twin); `module:function`,
    a user's attention function with transformers' AttentionInterface signature (module, query,
    key, value, attention_mask, scaling=..., dropout=..., **kwargs) -> (output [B, T, H, D], weights);
    or another implementation transformers has registered (e.g. `flex_attention`)."""
    if name in _BACKENDS:
        return _BACKENDS[name]
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"backend {name!r}: cannot load {attribute!r} from module "
                             f"{module_name!r} ({err})") from None
        if not callable(function):
            raise ValueError(f"backend {name!r}: {attribute} is not callable")
        return AttentionBackend(name, f"user attention function {name}", _user_implementation(name, function))

    if name in AttentionInterface().valid_keys() and "|" not in name:
        return AttentionBackend(name, f"transformers' {name}", lambda: name)
    raise ValueError(f"unknown backend {name!r}; valid: {', '.join(backend_names())}, "
                     "a module:function, or an implementation transformers registered")


def _triton_implementation() -> str:
    return hf.register()


def _native_implementation() -> str:
    return hf_native.register()


def _twin_implementation() -> str:
    return twins.register_hf()


_SDPA_SINKS = ("transformers' sdpa attention takes no sink logits (the model class sets "
               "_supports_sdpa = False); use --backend eager")


def _sdpa_model_refusal(module_class) -> str | None:
    if module_class is not None and getattr(module_class, "_supports_sdpa", True) is False:
        return (f"transformers: {module_class.__name__} does not support an attention "
                "implementation through torch.nn.functional.scaled_dot_product_attention yet")
    return None


def _registered_model_refusal(name: str) -> Callable[[type | None], str | None]:
    """A backend registered with transformers runs only where the modeling code calls a registered
    attention function (transformers' own test; set_attn_implementation merely warns there)."""
    def refusal(module_class) -> str | None:
        can_set = getattr(module_class, "_can_set_attn_implementation", None)
        if callable(can_set) and not can_set():
            return (f"transformers: {module_class.__name__} computes its attention itself, not "
                    f"through a registered attention function, so the {name} attention would "
                    "not run")
        return None
    return refusal


def _kernel_unserved(module: str, name: str) -> Callable[[], dict[str, str]]:
    """What a kernel of ours does not serve: the mechanisms its module's `SERVES` leaves out."""
    def unserved() -> dict[str, str]:
        kernel = f"the {name} kernel"
        reasons = {"sliding_window": "sliding-window attention (window {window} < {length} tokens); "
                                     f"{kernel} attends to every earlier position",
                   "chunked_attention": "chunked attention (blocks of {window} < {length} tokens); "
                                        f"{kernel} attends to every earlier position",
                   "softcap": f"{kernel} does not apply attention-logit softcapping",
                   "sinks": f"{kernel} takes no attention sinks",
                   "split_head_dims": f"{kernel} needs one head dim for q, k and v",
                   "sparse_indexer": f"{kernel} applies its own causal pattern, not the keys the "
                                     "indexer selects (passed as the attention mask)",
                   "compressed_kv": f"{kernel} places keys by their positions; the compressed "
                                    "entries read beside the window have none",
                   "bidirectional": f"{kernel} is causal decoder attention only"}
        serves = importlib.import_module(module).SERVES   # read when asked: tests narrow it
        return {m: reason for m, reason in reasons.items() if m not in serves}
    return unserved


def _triton_compile_refusal() -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ("the Triton kernel runs in Triton's interpreter here, which torch.compile cannot "
                "trace; +compile with --backend triton needs CUDA")
    return None


def _native_compile_refusal() -> str:
    return f"the native kernel cannot be compiled whole: {COMPILE_BREAKS}"


# twin is the negative control: correct attention whose split-KV count follows the call's shape,
# so live, prefill and batched constructions differ on every machine (kvfid.stacks.twins).
_SPECS = {
    "sdpa": dict(implementation=lambda: "sdpa", model_refusal=_sdpa_model_refusal, unserved=lambda: {
        "softcap": "transformers' sdpa attention does not apply attention-logit softcapping; use "
                   "--backend eager", "sinks": _SDPA_SINKS}),
    "eager": dict(implementation=lambda: "eager"),
    "triton": dict(implementation=_triton_implementation, causal_only=True,
                   unserved=_kernel_unserved("kvfid.kernels.hf", "triton"),
                   model_refusal=_registered_model_refusal("triton"),
                   compile_refusal=_triton_compile_refusal),
    "native": dict(implementation=_native_implementation, causal_only=True,
                   unserved=_kernel_unserved("kvfid.kernels.hf_native", "native"),
                   model_refusal=_registered_model_refusal("native"),
                   compile_refusal=_native_compile_refusal),
    "twin": dict(implementation=_twin_implementation, model_refusal=_registered_model_refusal("twin"),
                 unserved=lambda: {
        "softcap": "the twin attention ignores attention-logit softcapping",
        "sinks": "the twin attention ignores the sink logits"}),
}
for _name, _description in BACKENDS.items():
    register_backend(AttentionBackend(_name, _description, **_SPECS[_name]))


def builtin_backends() -> list[AttentionBackend]:
    """The built-in backends, in kvfid.names' order (the columns of `kvfid models MODEL`)."""
    return [_BACKENDS[name] for name in BACKENDS]
