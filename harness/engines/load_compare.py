"""A request under load against itself alone, bitwise: tokens, logprob bits, engine states.

`Served` is what one run of a request returned (its tokens and logprobs) and what the recording
scheduler wrote about it (kvfid.engines.load_scheduler: its line and its state files).
`compare_request` makes the record's `LoadRequest`: the first differing token; the logprobs
compared as fp32 bits up to there; the final engine state against the alone run's over the
positions both hold over identical tokens (kvfid.states.cache.compare_states: first bad layer
and position); and each preemption's live state against the same positions of the state the
resumed request ended with (what recompute rebuilt). No state file: no state comparison (None).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvfid.engines.bits import trimmed
from kvfid.records.engine_load import LoadRequest, StateDiff
from kvfid.states.cache import BoundaryState, compare_states, sha_cache


@dataclass(frozen=True)
class Served:
    """One request's run: tokens and logprobs as the engine returned them, the scheduler's line."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    seen: dict = field(default_factory=dict)


def bits(x: float) -> bytes:
    """A logprob's fp32 bits (vLLM's logprobs are fp32, carried as Python floats)."""
    return struct.pack("<f", x)


def common(a, b) -> int:
    """The length of the common prefix of two sequences."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def load_state(folder: Path, name: str | None):
    """A state file the recording scheduler wrote, as a BoundaryState (None if there is none)."""
    if not name:
        return None


    saved = torch.load(folder / name, weights_only=True)
    return BoundaryState(list(saved["tokens"]), keys=saved["keys"], values=saved["values"])


def state_diff(a, b, positions: int) -> StateDiff:
    """Two states compared bitwise over their first `positions` positions."""

    return StateDiff.of(compare_states(trimmed(a, positions), trimmed(b, positions)), positions)


def compare_request(planned, load: Served, alone: Served, load_folder: Path,
                    alone_folder: Path) -> LoadRequest:
    """One planned request's row: what load did to it and it against its alone run."""
    seen = load.seen
    same = common(load.tokens, alone.tokens)
    differ = [i for i in range(same) if bits(load.logprobs[i]) != bits(alone.logprobs[i])]
    worst = max((abs(load.logprobs[i] - alone.logprobs[i]) for i in range(same)), default=0.0)
    kv, resumed, sha = None, (), None
    live = load_state(load_folder, seen.get("final_state"))
    if live is not None:

        sha = sha_cache(live)
    reference = load_state(alone_folder, alone.seen.get("final_state"))
    if live is not None and reference is not None:
        n = min(len(planned.prompt) + same, len(live.prefix), len(reference.prefix))
        kv = state_diff(live, reference, n)
    if live is not None:
        resumed = tuple(state_diff(before, live, min(len(before.prefix), len(live.prefix)))
                        for before in (load_state(load_folder, name) for name in seen.get("states", ()))
                        if before is not None)
    hits = tuple(int(h) for h in seen.get("cache_hits", ()))
    final = int(seen.get("computed", 0))
    recomputed = max(int(seen.get("scheduled", 0)) - (final - (hits[0] if hits else 0)), 0)
    return LoadRequest(
        planned.index, planned.client, len(planned.prompt), planned.greedy, planned.prefix,
        generated=len(load.tokens), preemptions=len(seen.get("preempted_at", ())),
        recomputed=recomputed, cache_hits=hits, coresident=int(seen.get("coresident", 0)),
        tokens_equal=tuple(load.tokens) == tuple(alone.tokens),
        first_token_step=None if tuple(load.tokens) == tuple(alone.tokens) else same,
        logprobs=same, logprobs_differ=len(differ), first_logprob_step=differ[0] if differ else None,
        max_abs=float(worst), kv=kv, resumed=resumed, token_ids=tuple(load.tokens),
        token_logprobs=tuple(load.logprobs), kv_sha=sha)


def missing_request(planned, reason: str, load: Served | None = None) -> LoadRequest:
    """A planned request the run could not compare, with why (never a verdict)."""
    seen = load.seen if load is not None else {}
    return LoadRequest(planned.index, planned.client, len(planned.prompt), planned.greedy,
                       planned.prefix, missing=reason,
                       generated=len(load.tokens) if load is not None else 0,
                       token_ids=tuple(load.tokens) if load is not None else (),
                       token_logprobs=tuple(load.logprobs) if load is not None else (),
                       preemptions=len(seen.get("preempted_at", ())),
                       cache_hits=tuple(int(h) for h in seen.get("cache_hits", ())),
                       coresident=int(seen.get("coresident", 0)))
