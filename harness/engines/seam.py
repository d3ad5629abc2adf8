"""What an engine is to kvfid: the one interface every serving engine implements, the config it
is started from, and what a running engine answers.

An engine (`Engine`) is started from one `EngineConfig` (`start`, a context that shuts it down),
says what it is (`version`), what it refuses before compute (`refusal`, one line, no engine
started) and which of the in-engine constructions it offers (`offers`); a running engine
(`Running`) generates with logprobs and seeds, re-scores a sequence by prefill, and reads a
request's K/V out of its paged cache. Serving over HTTP, load runs and the price bench are
optional doors (`serve_load`, `load`, `bench`): an engine without one is refused in one line.
The engines are listed in kvfid.engines.registry; no command or diagnosis names one.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Iterator, Protocol

from kvfid.errors import BadInput

DTYPES = ("bf16", "fp16", "fp32")
# The paged cache's stored format: the model's dtype (`auto`) or fp8 bytes with a scale per layer.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")

# The constructions engine-check compares (an engine's `offers` names those it has besides the
# decode and the re-scoring every engine runs).
CHUNKED, PREFIX_CACHE, TP, KV = "chunked", "prefix-cache", "tp", "kv"
FP8_KV = "fp8-kv"           # a paged cache stored as fp8 (--kv-cache-dtype fp8_e4m3 | fp8_e5m2)


@dataclass(frozen=True)
class EngineConfig:
    """One engine as started: the model and precision, and what the in-engine check varies
    between engines (not between requests). Translated to an engine's own settings in that
    engine's module, in one place."""

    model: str = "smollm2-135m"
    dtype: str = "bf16"
    max_len: int = 1024
    seed: int = 0
    prefix_caching: bool = False
    chunk: int | None = None          # max tokens per scheduler step; None: no prompt is split
    faithful: bool = False            # kvfid's attention and batch-invariant mode inside
    batch_invariant: bool = False     # the engine's own batch-invariant switch (where it has one)
    tp: int = 1                       # tensor-parallel size: the model on this many worker processes
    # Faithful at TP=1 with the TP-invariant products (kvfid.kernels.invariant.parallel), as every
    # faithful engine at TP>1 computes them: the TP=1 side of a TP comparison (`@tp1`'s products).
    tp_invariant: bool = False
    kv_blocks: int | None = None      # the paged cache's size in blocks (None: the engine's own)
    recording: bool = False           # the recording scheduler (load_scheduler), synchronous steps
    max_seqs: int = 64                # the most sequences one step may hold
    split_prompts: bool = True        # chunked prefill on: a prompt may be split across steps
    block_size: int | None = 32       # the paged cache's block in tokens (None: the engine's default)
    threads: int | None = None        # the engine's torch threads (None: its own choice)
    attention: str | None = None      # the engine's attention implementation (None: its default)
    kv_cache_dtype: str = "auto"      # the paged cache's stored format (KV_CACHE_DTYPES)

    def with_(self, **changes) -> "EngineConfig":
        return replace(self, **changes)

    def label(self) -> str:
        return (f"prefix cache {'on' if self.prefix_caching else 'off'}, "
                + (f"chunked prefill by {self.chunk}" if self.chunk else "no chunking")
                + (", faithful" if self.faithful else "") + (f", TP={self.tp}" if self.tp > 1 else "")
                + (", TP-invariant products" if self.faithful and self.tp_invariant and self.tp == 1 else "")
                + (f", {self.kv_cache_dtype} KV cache" if self.kv_cache_dtype != "auto" else ""))


@dataclass(frozen=True)
class Generation:
    """One request's generated tokens, the engine's logprob of each, and its request id."""

    ids: list[int]
    logprobs: list[float]
    request: str = ""


@dataclass(frozen=True)
class Rescored:
    """One sequence re-scored by prefill: the logprob of each token from its start on (None where
    the engine's prefix cache served the position), how many positions the cache served."""

    logprobs: list[float | None]
    served: int = 0
    request: str = ""
    diverged: bool = False        # re-scored only up to where the engine's own token parts from the sequence


class Running(Protocol):
    """A started engine."""

    block_size: int

    def generate(self, prompts: list[list[int]], tokens: int, temperature: float = 0.0,
                 seed: int | None = None, stop_ids=(), ignore_eos: bool = False) -> list[Generation]:
        """One call over every prompt (one batch); `seed + i` seeds prompt i's sampler."""

    def rescore(self, sequences: list[list[int]], starts: list[int],
                read_cache: bool = False) -> list[Rescored]:
        """Prefill re-scoring in one call; `read_cache`: the prefix cache may serve positions."""

    def read_states(self, requests: list[str], sequences: list[list[int]]) -> list:
        """Each request's engine state (a kvfid.states.cache boundary state) over its sequence."""


@dataclass(frozen=True)
class Engine:
    """A serving engine kvfid drives. `start(config)` is a context giving a `Running`;
    `refusal(config)` is why it cannot serve that config (None: it can), checked before compute;
    `require()` raises Unavailable (exit 3) where the engine is not installed; `offers` names the
    constructions it has besides decode and re-scoring (CHUNKED, PREFIX_CACHE, TP, KV) and
    whether it stores an fp8 cache (FP8_KV)."""

    name: str
    description: str
    require: Callable[..., Any]
    version: Callable[..., Any]
    start: Callable[..., Any]                                    # (EngineConfig) -> ContextManager[Running]
    refusal: Callable[..., Any] = lambda config: None             # (EngineConfig) -> str | None
    offers: frozenset = frozenset()
    constructions: dict = field(default_factory=dict)     # construction -> its name in this engine
    batch_invariant_note: Callable[..., Any] = lambda: None       # why its own switch does nothing here
    load: Callable[..., Any] | None = None                        # engine-load: (**options) -> EngineLoadRecord
    bench: Callable[..., Any] | None = None       # engine-bench: (**options) -> (result, its render)
    load_bench: Callable[..., Any] | None = None  # engine-bench --load: (...) -> (result, its render)
    serve_load: Callable[..., Any] | None = None                  # engine-load --server: served over HTTP
    samples: bool = True      # samples with a seed per request (False: greedy only; its load plans are greedy)

    def name_of(self, construction: str) -> str:
        """This engine's words for one of the constructions (`prefix cache`, `block sharing`)."""
        return self.constructions.get(construction, construction)

    def checked(self, config: EngineConfig) -> EngineConfig:
        """`config`, or BadInput naming the option this engine cannot serve and why; Unavailable
        where it is not installed. Nothing is started."""
        if config.dtype not in DTYPES:
            raise BadInput(f"--dtype {config.dtype!r}: one of {', '.join(DTYPES)}")
        if config.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BadInput(f"--kv-cache-dtype {config.kv_cache_dtype!r}: one of {', '.join(KV_CACHE_DTYPES)}")
        if config.kv_cache_dtype != "auto" and FP8_KV not in self.offers:
            raise BadInput(f"--engine {self.name}: --kv-cache-dtype {config.kv_cache_dtype} is not "
                           "offered by this engine (its paged cache is stored in the model's dtype)")
        self.require()
        why = self.refusal(config)
        if why:
            raise BadInput(f"--engine {self.name}: {why}")
        return config

    def door(self, which: str):
        """An optional door (`load`, `bench`, `load_bench`, `serve_load`), or BadInput saying
        this engine has none."""
        function = getattr(self, which)
        if function is None:
            words = {"load": "engine-load", "bench": "engine-bench", "load_bench": "engine-bench --load",
                     "serve_load": "engine-load --server"}[which]
            raise BadInput(f"--engine {self.name}: {words} is not offered by this engine")
        return function


@contextlib.contextmanager
def variables(**values: str | None) -> Iterator[None]:
    """Environment variables set within the block (None: unset), each restored after to what the
    process had, as it had it (an engine's workers read them when they start)."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        _put(values)
        yield
    finally:
        _put(saved)


def _put(values: dict[str, str | None]) -> None:
    """Set each variable (None: unset it)."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def started(engine: Engine, config: EngineConfig) -> ContextManager[Running]:
    """`engine` started from `config`, checked first (nothing started when it is refused)."""
    return engine.start(engine.checked(config))
