"""Greedy decoding primitives: counted forward calls, teacher-forced chunks, and the one greedy
loop (`greedy`), whose feed function says what each step feeds (plain, co-batched, a layout).

`Runner` is the one place that calls the model, and it calls it as transformers' `generate`
does: the model kwargs `generate` keeps (`_prepare_position_ids_for_generation`,
`_update_model_kwargs_for_generation`) handed to the model's own
`prepare_inputs_for_generation`, whose result is what the forward gets (a model's override
included: Mamba drops the mask after its first call, Bamba sets the logits it keeps, a
remote-code model gets `cache_position`). The kwargs: the cache under the keyword this version
names (`cache` in recent 5.x, `cache_params` or `past_key_values` before); `position_ids`
counted over what the cache already covers (a padded batch's from its attention mask: a row's
first real token is 0), for every model whose `forward` takes them; an unpadded batch's
all-ones attention mask where this version's `generate` keeps it (5.17; 5.18 on drops it);
`logits_to_keep` where the forward takes it, the rows kvfid asks for. A model that numbers a call's own tokens from 0 when given no
positions (Bamba) would otherwise run every decode step at position 0. The positions a cache
covers are counted by kvfid (`new_cache`, `resume`, `covering`), as `generate` counts them in
its mask, never read from the cache's own counters (which a recurrent layer keeps its own way).
After a cache's first call, a layer that took more positions than the tokens fed (a model that
writes it twice per token) is refused (CacheOverwritten, exit 3) before the next call, whose mask
would not fit. It counts and times every forward call so the protocol can report its own
overhead. Nothing here knows which attention backend or precision runs.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import transformers
from packaging.version import Version

from kvfid.errors import Unavailable
from kvfid.states.cache import check_written_once, top2
from kvfid.states.layers import empty_cache
from kvfid.kernels import KernelRefusal


@dataclass(frozen=True)
class Cached:
    """A model's cache and the positions it covers (the length of `generate`'s attention mask for
    it). The cache object itself is the model's and grows in place; this value does not: every
    forward, cut and gather returns the `Cached` that holds after it."""

    cache: object
    positions: int
    checked: bool = False   # its first call was checked for a layer written twice per token

    def after(self, tokens: int) -> "Cached":
        """This cache once `tokens` more positions are fed."""
        return replace(self, positions=self.positions + tokens)

    def covering(self, positions: int) -> "Cached":
        """This cache after a cut or a gather left it covering `positions` positions."""
        return replace(self, positions=positions)


def cache_keyword(module: torch.nn.Module) -> str:
    """The name `forward` takes the cache under in this transformers version: `cache` (recent
    5.x), `cache_params` (a state-space model before that: Mamba in 5.17), `past_key_values`."""
    params = inspect.signature(module.forward).parameters
    return next((name for name in ("cache", "cache_params") if name in params), "past_key_values")


# Whether this transformers' `generate` passes an unpadded batch's all-ones attention mask on to
# the model: 5.17 does; 5.18 on drops it (`generation_config._mask_length`).
GENERATE_KEEPS_FULL_MASK = Version(transformers.__version__) < Version("5.18")


def new_cache(module: torch.nn.Module) -> Cached:
    """An empty cache for this model: a dynamic cache with its layer classes, or the cache class
    the model brings (kvfid.states.layers.empty_cache). It covers no position yet."""
    return Cached(empty_cache(module), 0)


def resume(state, module: torch.nn.Module) -> Cached:
    """A cache holding boundary state `state` (kvfid.states.cache.BoundaryState), covering its
    prefix: the next token fed is at position len(prefix)."""
    return Cached(state.to_cache(module), len(state.prefix))


@dataclass
class Runner:
    """Calls one module as `generate` does, counting forward calls and their wall time."""

    module: torch.nn.Module
    calls: int = 0
    seconds: float = 0.0
    _keyword: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self._keyword = cache_keyword(self.module)
        self._device = next(self.module.parameters()).device
        params = inspect.signature(self.module.forward).parameters
        self._takes = {name for name in ("position_ids", "attention_mask", "logits_to_keep")
                       if name in params}

    def _counted(self, at: Cached | None, **kwargs) -> tuple[torch.Tensor, Cached | None]:
        """One timed, counted forward call; the model's logits and `at` after it."""
        start = time.perf_counter()
        with refusals_as_unavailable():
            logits = self.module(**kwargs).logits
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        if at is not None and not at.checked:
            # a model that writes a layer twice per token does so in its first call; refused
            # there, as the next call's mask would not fit (transformers 5.17: a size error)
            check_written_once(at.cache, at.positions)
            at = replace(at, checked=True)
        return logits, at

    def _inputs(self, ids: torch.Tensor, at: Cached | None, attention_mask, position_ids,
                keep) -> tuple[dict, Cached | None]:
        """The keyword arguments `generate` would pass for feeding `ids` [B, T] after `at`
        (None: no cache, as a trainer scores): positions after what the cache covers, or those
        given (a padded batch's, a draft tree's, a stage program's), with their mask; and `at`
        once the call has fed them."""
        rows, length = ids.shape
        past = None if at is None else at.positions
        if position_ids is None:   # [B, T]: what generate's all-ones mask counts
            start = past or 0
            position_ids = torch.arange(start, start + length).expand(rows, length).contiguous()
            if GENERATE_KEEPS_FULL_MASK:
                attention_mask = torch.ones((rows, start + length), dtype=torch.long)
        given = {"use_cache": at is not None}
        if at is not None:
            given[self._keyword] = at.cache
        if "position_ids" in self._takes:
            given["position_ids"] = position_ids.to(self._device)
        if attention_mask is not None and "attention_mask" in self._takes:
            given["attention_mask"] = attention_mask.to(self._device)
        if keep is not None and "logits_to_keep" in self._takes:
            given["logits_to_keep"] = keep
        # the model's own preparation, as generate calls it for each forward (a model may drop
        # the mask after its first call, or set what it keeps); a module without generate: as is
        prepare = getattr(self.module, "prepare_inputs_for_generation", None)
        try:
            kwargs = (prepare(ids.to(self._device), is_first_iteration=not past, **given)
                      if prepare is not None else {"input_ids": ids.to(self._device), **given})
        except Exception as err:   # noqa: BLE001 -- a model's own preparation, whatever it raises
            text = (str(err).strip().splitlines() or [""])[0][:160]
            raise Unavailable(f"{type(self.module).__name__} cannot prepare plain token ids as its "
                              f"generate does ({type(err).__name__}: {text})") from None
        if at is not None:   # kvfid reads the state from its own cache, whatever is prepared
            kwargs[self._keyword] = at.cache
        if "logits_to_keep" in self._takes:   # the rows kvfid asked for (a trainer's: all)
            kwargs.pop("logits_to_keep", None)
            if keep is not None:
                kwargs["logits_to_keep"] = keep
        return kwargs, None if at is None else at.after(length)

    def forward(self, ids: torch.Tensor, at: Cached, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, Cached]:
        """Feed `ids` [B, T] after what `at` holds; last-position logits [B, V] and the cache
        after the call. A padded batch also passes its attention mask [B, cached + T] and
        position ids [B, T]."""
        kwargs, after = self._inputs(ids, at, attention_mask, position_ids, keep=1)
        logits, after = self._counted(after, **kwargs)
        return logits[:, -1, :], after

    def forward_kept(self, ids: torch.Tensor, at: Cached, rows: int,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, Cached]:
        """Feed `ids` [B, T] after what `at` holds; the logits of the last `rows` positions
        [B, rows, V] (a verification pass keeps every row, a prefix-cache hit only the last) and
        the cache after the call. A draft tree also passes its 4-D mask and position ids."""
        kwargs, after = self._inputs(ids, at, attention_mask, position_ids, keep=rows)
        logits, after = self._counted(after, **kwargs)
        return logits[:, -rows:, :], after

    def forward_all(self, ids: torch.Tensor, at: Cached | None
                    ) -> tuple[torch.Tensor, Cached | None]:
        """Feed `ids` [B, T] after what `at` holds (no cache when None), as a trainer scores a
        sequence: logits at every position [B, T, V], and the cache after the call."""
        kwargs, after = self._inputs(ids, at, None, None, keep=None)
        return self._counted(after, **kwargs)

    def full_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """No-cache forward over all of `ids` [B, T]; logits at every position [B, T, V]."""
        kwargs, _ = self._inputs(ids, None, None, None, keep=None)
        with refusals_as_unavailable():
            out = self.module(**kwargs)
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


def feed_chunks(runner: Runner, at: Cached, ids, sizes, rows: int = 1, chunk=None
                ) -> tuple[torch.Tensor, Cached]:
    """Teacher-force `ids` in consecutive chunks of the given sizes; last logits [rows, V] and
    the cache after them. `chunk(at, start, end)` feeds ids start..end-1 its own way (a stage
    program's layout: its mask and positions); by default each chunk is plain token ids, `rows`
    identical rows."""
    chunk = chunk or (lambda at, start, end: runner.forward(as_batch(ids[start:end], rows), at))
    logits, start = None, 0
    for size in sizes:
        logits, at = chunk(at, start, start + size)
        start += size
    assert start == len(ids), "chunk sizes must cover the ids exactly"
    return logits, at


@dataclass
class Greedy:
    """Tokens produced greedily, with the margin at each step and whether EOS stopped it."""

    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    eos: bool = False


# What a greedy step feeds: the chosen token in, the logits [V] it gives out. Plain decoding feeds
# the token alone (`next_token`); a co-batch feeds every row's token (kvfid.protocol.cobatch); a
# stage program feeds the token at its layout's position under its visibility (kvfid.stages).
Feed = Callable[[int], torch.Tensor]
# How a boundary state's suffix is fed: (runner, the cache resumed from the state) -> its Feed.
Feeding = Callable[[Runner, Cached], Feed]


class Feeder:
    """A feed that carries its cache from step to step: `step(at, token)` feeds one token after
    `at` and gives the logits [V] and the cache after it; `cached` is the cache after the last
    step (a live run snapshots it)."""

    def __init__(self, at: Cached, step: Callable[[Cached, int], tuple[torch.Tensor, Cached]]):
        self.cached, self._step = at, step

    def __call__(self, token: int) -> torch.Tensor:
        logits, self.cached = self._step(self.cached, token)
        return logits


def next_token(runner: Runner, at: Cached) -> Feeder:
    """Plain decoding's feed: the token alone, after what `at` holds."""
    def step(at: Cached, token: int) -> tuple[torch.Tensor, Cached]:
        logits, at = runner.forward(as_batch([token]), at)
        return logits[0], at

    return Feeder(at, step)


def top2_without(logits: torch.Tensor, eos_ids) -> tuple[int, float]:
    """The greedy token and margin with end-of-turn ids masked out (the structural logits mask a
    stage program's live stages decode under)."""
    masked = logits.float().clone()
    masked[[i for i in eos_ids if i < masked.numel()]] = float("-inf")
    return top2(masked)


def greedy(logits: torch.Tensor, steps: int, eos_ids, feed: Feed, feed_last: bool = False,
           choose=top2) -> tuple[Greedy, torch.Tensor]:
    """The greedy loop: up to `steps` tokens from `logits` [V], each chosen by `choose` (the
    token and its margin) and stopping after an EOS token.

    Every token but the last is fed back through `feed`; the last is fed too when `feed_last`
    (a live run must cover it in the cache). Returns the tokens and the logits after the last
    fed token.
    """
    out = Greedy()
    for step in range(steps):
        token, margin = choose(logits)
        out.tokens.append(token)
        out.margins.append(margin)
        if token in eos_ids:
            out.eos = True
            break
        if step < steps - 1 or feed_last:
            logits = feed(token)
    return out, logits
