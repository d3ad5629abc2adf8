"""Stacks: attention backend + precision + batch-invariant mode + device + threads, as one context.

A `Stack` is data (frozen, hashable, serializable to the ledger). `Stack.activate(model)` returns
the model's module prepared for that stack and restores everything it changed on exit: the torch
thread count, the module's attention implementation, the batch-invariant op overrides. Attention
backends live in a registry so a new one (our Triton kernel) joins without the protocol knowing.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterator

import torch

from harness.errors import Unavailable
from harness.names import BACKENDS, DTYPE_NAMES
from harness.checks import check_cuda

from kernels import DTYPES  # noqa: E402  (re-exported: the stack's dtype names)

if tuple(DTYPES) != DTYPE_NAMES:      # the command line offers harness.names' spelling
    raise ImportError(f"kernels.DTYPES {tuple(DTYPES)} != harness.names.DTYPE_NAMES {DTYPE_NAMES}")


class StackUnavailable(Unavailable, EnvironmentError):
    """A device or attention implementation this machine cannot run (exit 3)."""


def _refuses_nothing(*_) -> None:
    return None


@dataclass(frozen=True)
class AttentionBackend:
    """A named attention implementation; `implementation()` registers it if needed and returns
    the name transformers knows it by. It says itself what it refuses (the protocol asks, and
    never tests its name): `unserved()`, each mechanism of harness.protocol.serving.MECHANISMS it
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
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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
    from transformers import AttentionInterface

    if name in AttentionInterface().valid_keys() and "|" not in name:
        return AttentionBackend(name, f"transformers' {name}", lambda: name)
    raise ValueError(f"unknown backend {name!r}; valid: {', '.join(backend_names())}, "
                     "a module:function, or an implementation transformers registered")


def _triton_implementation() -> str:
    from kernels import hf  # imported late: sets TRITON_INTERPRET on CPU before triton loads

    return hf.register()


def _native_implementation() -> str:
    from kernels import hf_native

    return hf_native.register()


def _twin_implementation() -> str:
    from harness.protocol import twins

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
    from kernels.hf import COMPILE_BREAKS

    return f"the native kernel cannot be compiled whole: {COMPILE_BREAKS}"


# twin is the negative control: correct attention whose split-KV count follows the call's shape,
# so live, prefill and batched constructions differ on every machine (harness.protocol.twins).
_SPECS = {
    "sdpa": dict(implementation=lambda: "sdpa", model_refusal=_sdpa_model_refusal, unserved=lambda: {
        "softcap": "transformers' sdpa attention does not apply attention-logit softcapping; use "
                   "--backend eager", "sinks": _SDPA_SINKS}),
    "eager": dict(implementation=lambda: "eager"),
    "triton": dict(implementation=_triton_implementation, causal_only=True,
                   unserved=_kernel_unserved("kernels.hf", "triton"),
                   model_refusal=_registered_model_refusal("triton"),
                   compile_refusal=_triton_compile_refusal),
    "native": dict(implementation=_native_implementation, causal_only=True,
                   unserved=_kernel_unserved("kernels.hf_native", "native"),
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
    """The built-in backends, in harness.names' order (the columns of `kvfid models MODEL`)."""
    return [_BACKENDS[name] for name in BACKENDS]


@dataclass(frozen=True)
class Stack:
    """(attention backend, precision, batch-invariant mode, device, threads): one measurement's
    numerical environment."""

    backend: str = "sdpa"
    dtype: str = "bf16"
    batch_invariant: bool = False
    device: str = "cpu"
    threads: int | None = None
    compiled: bool = False   # the forward under torch.compile (harness.protocol.compiled)
    # Recurrent layers compute a multi-token call by their decode step's recurrence, one token at a
    # time (kernels.recurrence.faithful_recurrence). None: on with the batch-invariant mode (the
    # faithful stack), off without; False with the mode asks for the chunked scan (`+bi+scan`).
    faithful_recurrence: bool | None = None

    def __post_init__(self) -> None:
        attention_backend(self.backend)  # raises ValueError naming the valid ones
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if self.faithful_recurrence is None:
            object.__setattr__(self, "faithful_recurrence", self.batch_invariant)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def batch_invariant_impl(self) -> str | None:
        """Which batch-invariant ops run: Triton kernels on CUDA; on CPU, where the Triton
        interpreter is far too slow for a whole model, the stock kernels on fixed tiles of rows,
        each shape probed first (`tiled`, row at a time where a probe fails; same invariance
        tests). `KVFID_BI_IMPL=triton|rowwise|tiled` overrides."""
        if not self.batch_invariant:
            return None
        default = "triton" if self.device.startswith("cuda") else "tiled"
        return os.environ.get("KVFID_BI_IMPL", default)

    @property
    def label(self) -> str:
        """Short name, e.g. `sdpa/bf16`, `triton/fp32+bi`, or `sdpa/bf16@t1` when the stack sets
        the thread count (on CPU the thread count changes numerics, so it names the stack).
        Which recurrence runs: `+bi` steps it (faithful), `+bi+scan` runs the chunked scan, `+fr`
        steps it without the mode."""
        bi, fr = self.batch_invariant, self.faithful_recurrence
        return (f"{self.backend}/{self.dtype}" + ("+bi" if bi else "")
                + ("+scan" if bi and not fr else "+fr" if fr and not bi else "")
                + ("+compile" if self.compiled else "")
                + (f"@t{self.threads}" if self.threads is not None else ""))

    def describe(self) -> dict:
        """The stack as the ledger stores it."""
        described = {**asdict(self), "label": self.label, "batch_invariant_impl": self.batch_invariant_impl}
        for option in ("compiled", "faithful_recurrence"):   # off: records read as before
            if not described[option] and not (option == "faithful_recurrence"
                                              and self.batch_invariant):
                del described[option]   # a +bi record always says which recurrence ran
        return described

    def with_dtype(self, dtype: str) -> "Stack":
        return replace(self, dtype=dtype)

    @contextlib.contextmanager
    def activate(self, model) -> Iterator[torch.nn.Module]:
        """Set this stack on entry, yield the prepared module, restore what was found on exit."""
        check_cuda(self.device, f"stack {self.label}: device", StackUnavailable)
        module = model.cast(self.torch_dtype, self.device)
        previous_impl = module.config._attn_implementation
        previous_threads = torch.get_num_threads()
        with contextlib.ExitStack() as restore:
            if self.threads is not None:
                torch.set_num_threads(self.threads)
                restore.callback(torch.set_num_threads, previous_threads)
            name = attention_backend(self.backend).implementation()
            try:
                module.set_attn_implementation(name)
            except (ImportError, ValueError) as err:
                first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise StackUnavailable(f"backend {self.backend} is not available here: {first_line}") from err
            restore.callback(module.set_attn_implementation, previous_impl)
            if self.batch_invariant:
                from kernels.mode import set_batch_invariant_mode

                restore.enter_context(set_batch_invariant_mode(True,
                                                               impl=self.batch_invariant_impl))
            if self.faithful_recurrence:
                from kernels.recurrence import faithful_recurrence

                restore.enter_context(faithful_recurrence(module))
            restore.enter_context(torch.inference_mode())
            if not self.compiled:   # a hook would be traced into the compiled graph
                from harness.protocol.selection import recorded_selections

                restore.enter_context(recorded_selections(module))   # sparse attention's choices
            if self.compiled:
                from harness.protocol.compiled import compiled_forward

                restore.enter_context(compiled_forward(module, self.label,
                                                       attention_backend(self.backend)))
            yield module


def parse_stack(text: str, device: str = "cpu", threads: int | None = None) -> Stack:
    """`sdpa/bf16`, `triton/fp32+bi`, `eager/bf16+bi+scan+compile`, `sdpa/bf16@t1` -> Stack (a
    label's `@tN` wins over `threads`; `+fr`: the faithful recurrence, which `+bi` implies (earlier
    labels `+bi+fr` read the same); `+scan`: the chunked scan; `+compile`: torch.compile)."""
    body, _, thread_text = text.partition("@t")
    if thread_text:
        if not thread_text.isdigit():
            raise ValueError(f"stack {text!r}: expected @tN with N a thread count, e.g. sdpa/bf16@t1")
        threads = int(thread_text)
    compiled = body.endswith("+compile")
    body = body[:-len("+compile")] if compiled else body
    faithful = True if body.endswith("+fr") else False if body.endswith("+scan") else None
    body = body.rsplit("+", 1)[0] if faithful is not None else body
    batch_invariant = body.endswith("+bi")
    body = body[:-3] if batch_invariant else body
    if body.count("/") != 1:
        raise ValueError(f"stack {text!r}: expected BACKEND/DTYPE[+bi][+scan|+fr][+compile][@tN], "
                         "e.g. sdpa/bf16")
    backend, dtype = body.split("/")
    return Stack(backend, dtype, batch_invariant, device, threads, compiled,
                 faithful_recurrence=faithful)


def check_supports(stack: Stack, model_or_config, length: int | None = None) -> None:
    """Refuse, before any compute, a model this stack cannot serve (exit 3, one line): a layer
    whose cache state kvfid cannot read whole (harness.protocol.layers.UnknownLayer), a model
    class transformers refuses for the backend, or a layer mechanism the backend does not serve
    (harness.protocol.serving asks what the backend says it refuses, `AttentionBackend`; the
    triton kernel's set is kernels.hf.SERVES). A window at least `length` tokens long (default:
    the model's context) covers every key, so it needs no window support. Padding the triton kernel cannot take
    (right padding, custom masks) never comes from a config: kvfid's constructions pad on the
    left."""
    from harness.protocol import serving

    backend = attention_backend(stack.backend)
    if stack.compiled:
        from harness.protocol.compiled import unavailable_reason

        reason = unavailable_reason(backend, stack.device)
        if reason:
            raise StackUnavailable(f"stack {stack.label} cannot run here: {reason}")
    config = serving.text_config(model_or_config)
    refuse = f"model {getattr(config, 'model_type', '?')} cannot run on stack {stack.label}"
    if backend.causal_only and getattr(config, "is_encoder_decoder", False):
        raise StackUnavailable(f"{refuse}: the {stack.backend} kernel is causal decoder attention only")
    infos = serving.describe_layers(model_or_config)
    need = length or int(getattr(config, "max_position_embeddings", 0) or 0)
    for info in infos:
        reason = serving.layer_reason(backend, info, need)
        if reason:
            raise StackUnavailable(f"{refuse}: layer {info.index} ({info.layer_type}) {reason}")
    reason = serving.model_reason(backend, serving.module_class(model_or_config))
    if reason:
        raise StackUnavailable(f"{refuse}: {reason}")
