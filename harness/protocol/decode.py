"""Greedy decoding primitives: counted forward calls, prefill/step/teacher-forced loops, margins.

`Runner` is the one place that calls the model: it handles transformers' API differences (the
cache keyword is `cache` in recent 5.x, `past_key_values` before), asks only for the last
position's logits, and counts and times every forward call so the protocol can report its own
overhead. Nothing here knows which attention backend or precision runs.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field

import torch

from kvfid.errors import Unavailable
from kvfid.states.cache import top2
from kvfid.kernels import KernelRefusal


def cache_keyword(module: torch.nn.Module) -> str:
    """The name `forward` takes the KV cache under in this transformers version."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(module: torch.nn.Module):
    """An empty cache for this model: a dynamic cache with its layer classes, or the cache class
    the model brings (kvfid.states.layers.empty_cache)."""
    from kvfid.states.layers import empty_cache

    return empty_cache(module)


@dataclass
class Runner:
    """Calls one module, counting forward calls and their wall time."""

    module: torch.nn.Module
    calls: int = 0
    seconds: float = 0.0
    _keyword: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self._keyword = cache_keyword(self.module)
        self._device = next(self.module.parameters()).device

    def _counted(self, **kwargs) -> torch.Tensor:
        """One timed, counted forward call; the model's logits."""
        start = time.perf_counter()
        with refusals_as_unavailable():
            logits = self.module(**kwargs).logits
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return logits

    def forward(self, ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `ids` [B, T] after what `cache` holds; return last-position logits [B, V].
        A padded batch also passes its attention mask [B, cached + T] and position ids [B, T]."""
        padding = {} if attention_mask is None else {
            "attention_mask": attention_mask.to(self._device),
            "position_ids": position_ids.to(self._device)}
        return self._counted(input_ids=ids.to(self._device), use_cache=True, logits_to_keep=1,
                             **{self._keyword: cache}, **padding)[:, -1, :]

    def forward_kept(self, ids: torch.Tensor, cache, rows: int,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `ids` [B, T] after what `cache` holds; the logits of the last `rows` positions
        [B, rows, V] (a verification pass keeps every row, a prefix-cache hit only the last). A
        draft tree also passes its 4-D mask and position ids."""
        tree = {} if attention_mask is None else {
            "attention_mask": attention_mask.to(self._device),
            "position_ids": position_ids.to(self._device)}
        return self._counted(input_ids=ids.to(self._device), use_cache=True, logits_to_keep=rows,
                             **{self._keyword: cache}, **tree)

    def forward_all(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Feed `ids` [B, T] after what `cache` holds (no cache when None), as a trainer scores a
        sequence: logits at every position [B, T, V]."""
        kwargs = {self._keyword: cache, "use_cache": True} if cache is not None else {"use_cache": False}
        return self._counted(input_ids=ids.to(self._device), **kwargs)

    def full_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """No-cache forward over all of `ids` [B, T]; logits at every position [B, T, V]."""
        with refusals_as_unavailable():
            out = self.module(input_ids=ids.to(self._device), use_cache=False)
        return out.logits


@contextlib.contextmanager
def refusals_as_unavailable():
    """A kernel's refusal met inside a forward (a mechanism the checks before compute could not
    see in the config) is the refusal it is, exit 3, not an internal error."""
    try:
        yield
    except KernelRefusal as err:
        raise Unavailable(f"the stack cannot serve this model: {err}") from None


def as_batch(ids, rows: int = 1) -> torch.Tensor:
    """Token ids -> LongTensor [rows, T] of identical rows."""
    return torch.tensor([list(ids)] * rows, dtype=torch.long)


def feed_chunks(runner: Runner, cache, ids, sizes, rows: int = 1) -> torch.Tensor:
    """Teacher-force `ids` in consecutive chunks of the given sizes; last logits [rows, V]."""
    logits, start = None, 0
    for size in sizes:
        logits = runner.forward(as_batch(ids[start:start + size], rows), cache)
        start += size
    assert start == len(ids), "chunk sizes must cover the ids exactly"
    return logits


@dataclass
class Greedy:
    """Tokens produced greedily, with the margin at each step and whether EOS stopped it."""

    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    eos: bool = False


def greedy(runner: Runner, cache, logits: torch.Tensor, steps: int, eos_ids,
           feed_last: bool) -> tuple[Greedy, torch.Tensor]:
    """Decode up to `steps` greedy tokens from `logits` [V], stopping after an EOS token.

    Every token but the last is fed back; the last is fed too when `feed_last` (the live run must
    cover it in the cache). Returns the tokens and the logits after the last fed token.
    """
    out = Greedy()
    for step in range(steps):
        token, margin = top2(logits)
        out.tokens.append(token)
        out.margins.append(margin)
        if token in eos_ids:
            out.eos = True
            break
        if step < steps - 1 or feed_last:
            logits = runner.forward(as_batch([token]), cache)[0]
    return out, logits
