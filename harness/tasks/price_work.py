"""What `kvfid price` times, apart from the loop around it: the arms of a row and the one
interleaved run that times them.

An arm is a session (a context that sets a stack up and yields the call to time; set-up and
tear-down are not timed) under a name. `interleaved` runs one untimed warm-up round and one
timed round, lets the caller choose the rounds from that round's length, then the rest: round r
calls the arms in their order rotated by r (A B, B A, A B, ... : every arm as often first as the
others), each call timed end to end (`time.perf_counter`) with this thread's CPU time beside
it (`time.thread_time`: other jobs on a shared machine stretch wall time much more).

The work: a prefill of seeded token ids into a fresh cache; a decode step of `sequences` rows
after a cache of `keys` positions each, filled with seeded random keys and values in the stack's
dtype (a step computes the same whatever the cache holds, and a real prefill of 32 sequences of
2048 tokens would cost more than the rows it serves), cropped back after each call; the floor's
products, every linear layer of the model once (its decode products), at the step's rows and by
the calls the faithful route makes (kvfid.kernels.invariant.route.in_tiles), outside any stack:
stock kernels.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from kvfid.records.price import ArmTimes
from kvfid.kernels.invariant import whole as whole_calls
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.invariant.route import in_tiles
from kvfid.protocol.decode import cache_keyword, new_cache

Session = Callable[[], ContextManager[Callable[[], object]]]


@dataclass(frozen=True)
class Arm:
    """One arm of a row: its name, what runs (a label), and its session."""

    name: str
    stack: str
    session: Session


@dataclass(frozen=True)
class Clocks:
    """The timers (a test passes its own)."""

    wall: Callable[[], float] = time.perf_counter
    cpu: Callable[[], float] = time.thread_time


# Rounds by the first timed round's seconds: a long round is timed once, a shorter one a few times,
# a short one as often as fits in ROUNDS_S (within MIN_ROUNDS..MAX_ROUNDS); never more than the
# budget left holds, never fewer than one.
ONE_ROUND_S = 5.0
FEW_ROUNDS_S, FEW_ROUNDS = 1.0, 3
ROUNDS_S, MIN_ROUNDS, MAX_ROUNDS = 4.0, 5, 21


def rounds_for(round_s: float, left_s: float) -> int:
    """Timed rounds in all where the first took `round_s` seconds and `left_s` of the budget is
    left."""
    if round_s >= ONE_ROUND_S:
        rounds = 1
    elif round_s >= FEW_ROUNDS_S:
        rounds = FEW_ROUNDS
    else:
        rounds = min(MAX_ROUNDS, max(MIN_ROUNDS, int(ROUNDS_S / max(round_s, 1e-9))))
    return max(1, min(rounds, int(left_s / round_s) if round_s > 0 else rounds))


def _round(arms: list[Arm], first: int, clocks: Clocks) -> dict[str, tuple[float, float]]:
    """Every arm's call once, from arm `first` on in rotated order: name -> (wall, cpu)."""
    out = {}
    for arm in arms[first:] + arms[:first]:
        with arm.session() as call:
            wall, cpu = clocks.wall(), clocks.cpu()
            call()
            out[arm.name] = (clocks.wall() - wall, clocks.cpu() - cpu)
    return out


def interleaved(arms: list[Arm], rounds: Callable[[float], int],
                clocks: Clocks = Clocks()) -> tuple[tuple[ArmTimes, ...], int]:
    """One untimed warm-up round (first calls: probes, packed weights, allocations), one timed
    round, then more up to `rounds(the first timed round's seconds)`, arms interleaved: each
    arm's times and the rounds run."""
    _round(arms, 0, clocks)
    walls: dict[str, list[float]] = {a.name: [] for a in arms}
    cpus: dict[str, list[float]] = {a.name: [] for a in arms}
    count, r = 1, 0
    while r < count:
        timed = _round(arms, r % len(arms), clocks)
        for name, (wall, cpu) in timed.items():
            walls[name].append(wall)
            cpus[name].append(cpu)
        if r == 0:
            count = max(1, rounds(sum(wall for wall, _ in timed.values())))
        r += 1
    return tuple(ArmTimes(a.name, a.stack, tuple(walls[a.name]), tuple(cpus[a.name]))
                 for a in arms), count


# --------------------------------------------------------------------------- the model's work

def token_ids(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    """Seeded token ids [rows, length] (below 250: inside every preset's vocabulary)."""
    return torch.randint(3, 250, (rows, length), generator=torch.Generator().manual_seed(seed))


def prefill(model, stack, tokens: int) -> Session:
    """A session of the stack: `tokens` token ids into a fresh cache, one forward."""
    ids = token_ids(1, tokens)

    @contextlib.contextmanager
    def session():
        with stack.activate(model) as module:
            given = {cache_keyword(module): new_cache(module).cache}
            yield lambda: module(input_ids=ids, use_cache=True, logits_to_keep=1, **given)
    return session


def filled_cache(module, sequences: int, keys: int, seed: int = 1):
    """A cache of `keys` positions for each of `sequences` rows, every full-attention layer's keys
    and values seeded random in the module's dtype; refused (ValueError) for other layers."""
    config = module.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"decode rows fill full-attention caches only; this model has {sorted(kinds)}")
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    dtype = next(module.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cache = new_cache(module).cache
    for layer in range(int(config.num_hidden_layers)):
        k, v = (torch.randn(sequences, kv, keys, dim, generator=gen).to(dtype) for _ in range(2))
        cache.update(k, v, layer)             # [B, H_kv, T, D]
    return cache


def decode(model, stack, sequences: int, keys: int) -> Session:
    """A session of the stack: one decode step of `sequences` rows after `keys` cached positions
    each (the cache made once, in the session's first use; cropped back after each call)."""
    ids, made = token_ids(sequences, 1, seed=2), {}

    @contextlib.contextmanager
    def session():
        with stack.activate(model) as module:
            if "cache" not in made:
                made["cache"] = filled_cache(module, sequences, keys)
            cache = made["cache"]
            given = {cache_keyword(module): cache}
            try:
                yield lambda: module(input_ids=ids, use_cache=True, logits_to_keep=1, **given)
            finally:
                extra = cache.get_seq_length() - keys
                if extra > 0:
                    cache.crop(-extra)        # back to `keys`: every call times the same step
    return session


# --------------------------------------------------------------------------- the floor's products

def linear_layers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """Every nn.Linear of the module, by name: one product each in a decode step."""
    return [(name, sub) for name, sub in module.named_modules() if isinstance(sub, torch.nn.Linear)]


def linear_weights(module: torch.nn.Module) -> int:
    """The elements of every linear layer's weight (what a row's products cost grows with)."""
    return sum(sub.weight.numel() for _, sub in linear_layers(module))


def products(layers: list[tuple[torch.Tensor, torch.Tensor | None]], rows: int,
             tile: int | None = None, wide: list | None = None, threads: int = 1,
             whole: bool = False, mode: bool = False) -> Session:
    """A session of every product once: x [rows, K] times each weight [N, K] (with its bias), in
    one call (`tile` None), or by the route's calls: of `tile` rows (zero rows padding the last),
    or under a whole-call route (`whole`) one call padded to `tile` rows below it; in fp32 from
    `wide`'s weights where the route widens; rounded back to the model's dtype. `mode`: each
    one call under the tiled batch-invariant mode (each product by its own key's span)."""
    by_route = in_tiles
    if whole and tile is not None:      # one call from the floor up, as kvfid.kernels.invariant.whole.call
        span = whole_calls.Span(tile, max(rows, tile), max(rows, tile), "the route's floor")
        by_route = lambda fn, x, floor: whole_calls.call(fn, x, span)   # noqa: E731

    gen = torch.Generator().manual_seed(3)
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(w.dtype) for w, _ in layers}
    calls = []
    for i, (weight, bias) in enumerate(layers):
        x = inputs[weight.shape[1]]
        if tile is None:
            calls.append(lambda x=x, w=weight, b=bias: F.linear(x, w, b))
        elif wide is not None:
            w32, b32 = wide[i]
            calls.append(lambda x=x, w=w32, b=b32: by_route(     # as the mode's widened product
                lambda t: F.linear(t, w, b), x.float(), tile).to(x.dtype))
        else:
            calls.append(lambda x=x, w=weight, b=bias: by_route(lambda t: F.linear(t, w, b), x, tile))

    @contextlib.contextmanager
    def session():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode(), (set_batch_invariant_mode(impl="tiled") if mode
                                          else contextlib.nullcontext()):
                yield lambda: [call() for call in calls]
        finally:
            torch.set_num_threads(before)
    return session
