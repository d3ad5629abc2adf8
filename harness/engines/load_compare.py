"""A request under load against itself alone, bitwise: tokens, logprob bits, engine states.

`Served` is what one run of a request returned (its tokens and logprobs) and what the recording
scheduler wrote about it (kvfid.engines.load_scheduler: its line and its state files).
`compare_request` makes the record's `LoadRequest`: the first differing token; the logprobs
compared as fp32 bits up to there; the final engine state against the alone run's over the
positions both hold over identical tokens (kvfid.states.cache.compare_states: first bad layer
and position); and each preemption's live state against the same positions of the state the
resumed request ended with (what recompute rebuilt). No state file: no state comparison (None).

What an engine's load run records about a request (`Seen`, a line of the recording scheduler) and
the states it saves (`save_state`) are the same for every engine; `compared` makes every row of
a plan from a load run and an alone run (`PlanRun`), whichever engine served them.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvfid.engines.bits import trimmed
from kvfid.records.engine_load import LoadRequest, StateDiff
from kvfid.states.cache import BoundaryState, compare_states, sha_cache


@dataclass
class Seen:
    """What one request went through under load, as the engine's scheduler saw it."""

    steps: int = 0
    scheduled: int = 0
    coresident: int = 0
    cache_hits: list[int] = field(default_factory=list)    # per admission, the first then resumes
    preempted_at: list[int] = field(default_factory=list)  # computed tokens freed per preemption
    states: list[str] = field(default_factory=list)

    def line(self, **more) -> dict:
        """The request's line as the recording scheduler writes it (`more`: its final state,
        computed positions, ...)."""
        return {**asdict(self), **more}


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


def save_state(folder: Path, name: str, tokens, keys, values) -> str:
    """A request's engine state (its tokens, each layer's K and V) saved as `load_state` reads it;
    the file's name."""
    torch.save({"tokens": list(tokens), "keys": keys, "values": values}, Path(folder) / name)
    return name


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


@dataclass(frozen=True)
class PlanRun:
    """One engine's run of (some of) a plan's requests: what it served per planned index (with
    the scheduler's line), why each it could not serve is missing, the steps and the wall time,
    and the folder its state files are in."""

    served: dict[int, Served]
    missing: dict[int, str]
    folder: Path
    steps: int = 0
    wall_s: float = 0.0


def compared(plan, load: PlanRun, alone: PlanRun) -> dict:
    """Every planned request's row (under load against alone; missing with why) and the load
    run's totals: the parts of an EngineLoadRecord (the engine's door adds what ran)."""
    rows = []
    for planned in plan.requests:
        got = load.served.get(planned.index)
        if planned.index in load.missing or got is None:
            rows.append(missing_request(planned, load.missing.get(planned.index, "no answer"), got))
        elif planned.index not in alone.served:
            rows.append(missing_request(planned, "alone: " + alone.missing.get(planned.index, "no answer"), got))
        else:
            rows.append(compare_request(planned, got, alone.served[planned.index], load.folder, alone.folder))
    notes = sorted({s.seen["kv_note"] for s in [*load.served.values(), *alone.served.values()]
                    if s.seen.get("kv_note")})
    return {"requests": tuple(rows), "load_wall_s": load.wall_s, "steps": load.steps,
            "generated_tokens": sum(len(s.tokens) for s in load.served.values()),
            "prompt_tokens": sum(len(plan.requests[i].prompt) for i in load.served),
            "notes": tuple(f"engine state not read: {n}" for n in notes)}
