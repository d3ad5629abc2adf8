"""Stacks: attention backend + precision + batch-invariant mode + device + threads + TP size,
as one context.

A `Stack` is data (frozen, hashable, serializable to the ledger). `Stack.activate(model)` returns
the model's module prepared for that stack and restores everything it changed on exit: the torch
thread count, the module's attention implementation, the batch-invariant op overrides, the
tensor-parallel sharding (kvfid.stacks.tp). The backend comes from the registry
(kvfid.stacks.backends); this module never names one. `Stack.arm(module, at)` sets what an arm's
label asks of the stack beyond it (`prefill@tp1`: that arm at another TP size).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, replace
from typing import Iterator

import torch

from kvfid.checks import check_cuda
from kvfid.errors import Unavailable
from kvfid.stacks.backends import attention_backend
from kvfid.kernels import DTYPES
from kvfid.kernels.invariant.complex_products import makes_complex
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.recurrence import faithful_recurrence
from kvfid.stacks import serving, tp
from kvfid.stacks.compiled import compiled_forward, unavailable_reason
from kvfid.states.selection import recorded_selections


class StackUnavailable(Unavailable, EnvironmentError):
    """A device or attention implementation this machine cannot run (exit 3)."""


@dataclass(frozen=True)
class Stack:
    """(attention backend, precision, batch-invariant mode, device, threads): one measurement's
    numerical environment."""

    backend: str = "sdpa"
    dtype: str = "bf16"
    batch_invariant: bool = False
    device: str = "cpu"
    threads: int | None = None
    compiled: bool = False   # the forward under torch.compile (kvfid.stacks.compiled)
    # Recurrent layers compute a multi-token call by their decode step's recurrence, one token at a
    # time (kvfid.kernels.recurrence.faithful_recurrence). None: on with the batch-invariant mode (the
    # faithful stack), off without; False with the mode asks for the chunked scan (`+bi+scan`).
    faithful_recurrence: bool | None = None
    tp: int = 1   # tensor-parallel size: the model sharded over this many ranks (kvfid.stacks.tp)
    # The label names the TP size even at 1 (`@tp1`): a TP stack at size 1. With the mode its
    # products are the TP-invariant ones (kvfid.kernels.invariant.parallel), as at every size
    # above 1; a `+bi` stack that names no TP size computes plain products (they cost more).
    tp_named: bool = False

    def __post_init__(self) -> None:
        attention_backend(self.backend)  # raises ValueError naming the valid ones
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if self.tp < 1:
            raise ValueError(f"tp must be positive, got {self.tp}")
        if self.faithful_recurrence is None:
            object.__setattr__(self, "faithful_recurrence", self.batch_invariant)
        if self.tp > 1 and not self.tp_named:
            object.__setattr__(self, "tp_named", True)

    @property
    def tp_invariant(self) -> bool:
        """Whether the products are the TP-invariant ones: a `+bi` stack that names a TP size."""
        return self.batch_invariant and self.tp_named

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
                + (f"@t{self.threads}" if self.threads is not None else "")
                + (f"@tp{self.tp}" if self.tp_named else ""))

    def describe(self) -> dict:
        """The stack as the ledger stores it."""
        described = {**asdict(self), "label": self.label, "batch_invariant_impl": self.batch_invariant_impl}
        del described["tp_named"]                              # the label and `tp` say it
        if not self.tp_named:
            del described["tp"]                                # records read as before
        for option in ("compiled", "faithful_recurrence"):   # off: records read as before
            if not described[option] and not (option == "faithful_recurrence"
                                              and self.batch_invariant):
                del described[option]   # a +bi record always says which recurrence ran
        return described

    @classmethod
    def parse(cls, label: str, device: str = "cpu", threads: int | None = None) -> "Stack":
        """The stack a label names, as reports print them (`native/bf16+bi@t1`): parse_stack."""
        return parse_stack(label, device, threads)

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
                # a model without complex products keeps every real product off Python
                restore.enter_context(set_batch_invariant_mode(
                    True, impl=self.batch_invariant_impl, complex_products=makes_complex(module)))
            if self.faithful_recurrence:
                restore.enter_context(faithful_recurrence(module))
            restore.enter_context(torch.inference_mode())
            if not self.compiled:   # a hook would be traced into the compiled graph

                restore.enter_context(recorded_selections(module))   # sparse attention's choices

            if self.tp_named or tp.ranks().size > 1:
                restore.enter_context(tp.parallel_model(module, self.tp, self.tp_invariant))
            if self.compiled:
                restore.enter_context(compiled_forward(module, self.label,
                                                       attention_backend(self.backend)))
            yield module

    def arm(self, module, at: str | None):
        """The context an arm's stack option asks for (`tp1`: built at TP size 1 inside this
        stack's ranks; None: this stack as it is)."""
        if at is None:
            return contextlib.nullcontext()

        if not (at.startswith("tp") and at[2:].isdigit()):
            raise ValueError(f"unknown arm option @{at}; valid: @tpN")
        return tp.at_size(module, int(at[2:]))


def parse_stack(text: str, device: str = "cpu", threads: int | None = None) -> Stack:
    """`sdpa/bf16`, `triton/fp32+bi`, `eager/bf16+bi+scan+compile`, `sdpa/bf16@t1`,
    `native/bf16+bi@t1@tp2` -> Stack (a label's `@tN` wins over `threads`; `+fr`: the faithful
    recurrence, which `+bi` implies (earlier labels `+bi+fr` read the same); `+scan`: the chunked
    scan; `+compile`: torch.compile; `@tpN`: tensor parallel over N ranks)."""
    text, _, tp_text = text.partition("@tp")
    if tp_text and not tp_text.isdigit():
        raise ValueError(f"stack {text}@tp{tp_text}: expected @tpN with N a TP size, e.g. @tp2")
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
                 faithful_recurrence=faithful, tp=int(tp_text) if tp_text else 1,
                 tp_named=bool(tp_text))


def check_supports(stack: Stack, model_or_config, length: int | None = None) -> None:
    """Refuse, before any compute, a model this stack cannot serve (exit 3, one line): a layer
    whose cache state kvfid cannot read whole (kvfid.states.layers.UnknownLayer), a model
    class transformers refuses for the backend, or a layer mechanism the backend does not serve
    (kvfid.stacks.serving asks what the backend says it refuses, `AttentionBackend`; the
    triton kernel's set is kvfid.kernels.hf.SERVES). A window at least `length` tokens long (default:
    the model's context) covers every key, so it needs no window support. Padding the triton kernel cannot take
    (right padding, custom masks) never comes from a config: kvfid's constructions pad on the
    left."""
    backend = attention_backend(stack.backend)
    if stack.compiled:
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
    if stack.tp_named:
        reason = tp_reason(stack, model_or_config, infos)
        if reason:
            raise StackUnavailable(f"{refuse}: {reason}")


def tp_reason(stack: Stack, model_or_config, infos) -> str | None:
    """Why this model cannot be sharded at the stack's TP size, or None (kvfid.stacks.tp)."""
    if stack.compiled:
        return "+compile does not run tensor parallel"
    unserved = next((i for i in infos if i.kind not in ("full", "window")), None)
    if unserved is not None:
        return (f"layer {unserved.index} holds a {unserved.kind} state; TP shards full and "
                "window K/V only")
    master = getattr(model_or_config, "master", None)
    plan = tp.shardable(master) if master is not None else []
    if isinstance(plan, str):
        return f"TP cannot shard it: {plan}"
    reason = tp.tp_reason(serving.text_config(model_or_config), stack.tp, stack.tp_invariant)
    return f"TP={stack.tp}: {reason}" if reason else None
