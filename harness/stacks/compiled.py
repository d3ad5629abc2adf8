"""The `+compile` stack option: the model's forward under `torch.compile` (inductor).

Compiled kernels specialise on shapes and fuse ops into code inductor writes itself (C++ on CPU,
Triton on CUDA), so a stack that is invariant eagerly need not be invariant compiled: that is what
the option measures. The forward is compiled with dynamic shapes, so one graph serves every
sequence length (a length of 1 is specialised by torch, so a decode step gets its own graph); the
protocol's untimed warm-up (a prompt forward and one decode step) pays those compiles, which keeps
compile time apart from the arms' time. A later new shape (a batch of 2) may still compile inside
an arm.

Dynamo also guards on the strides of every tensor the cache holds, size-1 dims included. A
compiled prefill into an empty cache leaves the key projection's layout ([B, T, H, D] in memory),
while a decode step's concatenation and kvfid's state copies (snapshots, transplants, a reused
prefix) leave torch's default strides, so the same call shape compiled one graph per layout (on
the serving case's one-layer model, 8 graphs where 4 call shapes occur; the time it cost:
docs/hazards.md, "Dynamo guards on cache strides"). So before each compiled call the cache's
tensors are put in the default strides (`default_layout`): the same bits, and every construction
runs the same graph for the same call shape, so a difference between constructions is the
stack's, never kvfid's copying. The copy is made once after a prefill, not per decode step
(tiny-llama, four decode steps: 8 tensors copied before the first, none after).

Dynamo's caches are reset on entry and on exit, so no graph traced under one stack (its
batch-invariant overrides, its attention) is ever reused by another. Inductor's on-disk caches
are kept per ATen CPU capability (`capability_cache`): inductor picks its vector ISA from
`ATEN_CPU_CAPABILITY` but does not key its caches by it, and a compiled stack that ran under
`ATEN_CPU_CAPABILITY=avx2` (the AVX2 stand-in, docs/environment.md) and then without it in the
same default cache aborted the process ("double free or corruption", torch 2.13;
docs/hazards.md, "Inductor's caches and `ATEN_CPU_CAPABILITY`").

Inductor compiles without its runtime bounds checks on indirect indexing (`INDUCTOR_OPTIONS`):
torch 2.11's C++ backend writes one such check before the index it checks is defined, in the
decode step of a model given generate's attention mask (transformers 5.17 passes it), and the
graph does not compile; without the check the kernels compute what they did.

A stack whose forward dynamo cannot compile whole is refused before compute: its backend says
why (`AttentionBackend.compile_refusal`; e.g. the native kernel's host reads break the graph in
every layer and push transformers' shared decorated frame past dynamo's recompile limit, so part
of it would run eagerly: kvfid.kernels.hf.COMPILE_BREAKS). `kvfid blame` compiles units
one by one (`trace_units`); when they all agree alone, blame names the layer whose state first
differs with the forward compiled whole.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from typing import Iterator

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.utils._pytree import tree_flatten

from kvfid.errors import Unavailable

# Inductor's options for every compile here: no runtime bounds check on indirect indexing. On
# torch 2.11 its C++ backend emits that check on a vectorized index before the line defining it
# (a CppCompileError), in the decode-step graph that indexes generate's 2-D attention mask by the
# key position; dropping the check leaves every computed value as it was (docs/hazards.md).
INDUCTOR_OPTIONS = {"assert_indirect_indexing": False}


def unavailable_reason(backend, device: str) -> str | None:
    """Why inductor cannot compile this stack's forward here (its attention backend's own
    refusal, then the device's), or None. `backend`: a kvfid.stacks.backends.AttentionBackend."""
    reason = backend.compile_refusal()
    if reason:
        return reason
    if not device.startswith("cuda"):
        compiler = os.environ.get("CXX") or "c++"
        if shutil.which(compiler) is None and shutil.which("g++") is None:
            return f"inductor on CPU writes C++ and needs a C++ compiler ({compiler} or g++ on PATH)"
    return None


@contextlib.contextmanager
def compiled_forward(module: torch.nn.Module, label: str, backend) -> Iterator[None]:
    """`module.forward` compiled (dynamic shapes) inside the block; the eager forward and empty
    dynamo caches after it. `backend`: the stack's AttentionBackend."""
    reason = unavailable_reason(backend, str(next(module.parameters()).device))
    if reason:
        raise Unavailable(f"stack {label}: {reason}")
    with capability_cache():
        torch._dynamo.reset()
        compiled = torch.compile(module.forward, dynamic=True, options=INDUCTOR_OPTIONS)

        @functools.wraps(compiled)        # its signature: the cache keyword (protocol.decode)
        def forward(*args, **kwargs):
            for value in kwargs.values():  # the cache, under whichever keyword this version takes
                default_layout(value)
            return compiled(*args, **kwargs)

        module.forward = forward                                   # an instance attribute
        try:
            yield
        finally:
            del module.forward                                     # the class's forward again
            torch._dynamo.reset()


@contextlib.contextmanager
def capability_cache() -> Iterator[str]:
    """Inside the block, inductor's caches in a folder of their own per ATen CPU capability,
    `<inductor's default folder>/cpu-AVX2` (yielded), unless TORCHINDUCTOR_CACHE_DIR names
    another folder than that default (inductor writes the default there once it has used it):
    a folder the user chose is kept (and yielded). The variable as it was after the block."""
    before, default = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), default_cache_dir()
    if before is not None and os.path.abspath(before) != os.path.abspath(default):
        yield before
        return
    folder = os.path.join(default, f"cpu-{torch.backends.cpu.get_cpu_capability()}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def default_layout(cache) -> None:
    """Rebind each tensor a cache layer holds as an attribute (keys, values, an indexer's keys)
    whose strides are not torch's default for its shape to a contiguous copy (bit for bit).
    Tensors kept in dicts or lists (conv and recurrent states) are updated in place by the model,
    are allocated contiguous, and are left as they are; so is anything that is not a cache."""
    for layer in getattr(cache, "layers", None) or ():
        for name, value in list(vars(layer).items()):
            if isinstance(value, torch.Tensor) and value.stride() != _default_strides(value.shape):
                setattr(layer, name, value.clone(memory_format=torch.contiguous_format))


def _default_strides(shape) -> tuple[int, ...]:
    """The strides torch gives a new tensor of `shape` (row-major; size-0 and size-1 dims too)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def units(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules `kvfid blame` compiles one by one for a compiled stack: every child of each
    decoder layer (the module list as long as the config's layer count) and every other leaf
    module outside those layers (embeddings, final norm, head), in registration order."""
    layers = getattr(module.config.get_text_config(), "num_hidden_layers", None)
    lists = [name for name, sub in module.named_modules()
             if isinstance(sub, torch.nn.ModuleList) and len(sub) == layers]
    chosen = []
    for name, sub in module.named_modules():
        inside = [prefix for prefix in lists if name.startswith(prefix + ".")]
        depth = name.count(".") - inside[0].count(".") if inside else None
        if depth == 2 or (not inside and name and not list(sub.children())):
            chosen.append((name, sub))
    return chosen


@contextlib.contextmanager
def compiled_units(module: torch.nn.Module, on_call) -> Iterator[None]:
    """Inside the block the model runs eagerly except for its `units()`, each compiled alone
    (dynamic shapes); every unit call is reported as on_call(name, float inputs, float outputs)
    (detached CPU copies) from outside its compiled code. The whole-forward compile of a
    `+compile` stack is set aside for the block and put back after it."""
    whole = module.__dict__.pop("forward", None)
    torch._dynamo.reset()
    handles, compiled, chosen = [], [], units(module)
    with capability_cache(), torch._dynamo.config.patch(**unit_limits(len(chosen))):
        for name, unit in chosen:
            unit.forward = torch.compile(unit.forward, dynamic=True, options=INDUCTOR_OPTIONS)
            compiled.append(unit)
            handles.append(unit.register_forward_hook(_reporter(name, on_call), with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for unit in compiled:
                del unit.forward
            torch._dynamo.reset()
            if whole is not None:
                module.forward = whole


def unit_limits(count: int) -> dict[str, int]:
    """Dynamo's recompile limits while `count` units are compiled alone: transformers' decorated
    forwards share one code object (`wrapped_func`), and units of one class share their forward's,
    so past dynamo's recompile_limit (8 entries a frame) later units would run eagerly; each unit
    gets 8 graphs."""
    return {"recompile_limit": 8 * count, "accumulated_recompile_limit": 64 * count + 256}


def trace_units(module: torch.nn.Module, run, on_op) -> None:
    """`optrace.trace`'s contract at the granularity of compiled units: run `run()` with each
    unit's call reported as on_op(unit path, "compiled", inputs, outputs)."""
    with compiled_units(module, lambda name, ins, outs: on_op(name, "compiled", ins, outs)):
        run()


def _reporter(name: str, on_call):
    def floats(values) -> list[torch.Tensor]:
        return [v.detach().cpu().clone() for v in tree_flatten(values)[0]
                if isinstance(v, torch.Tensor) and v.is_floating_point()]

    def hook(_unit, args, kwargs, output):
        on_call(name, floats((args, kwargs)), floats(output))
    return hook
