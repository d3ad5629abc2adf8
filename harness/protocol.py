"""The protocol: constructions (arms), suffixes, replicas, the bridge, transplants, the crossing.

`run_item` measures one item on one stack and returns a JSON-able record; `run_crossing` runs the
fixed-prefix precision crossing. Both take a `Model` and `Stack`s and never look inside either:
which attention backend or precision runs is the stack's business. Every forward call goes through
a `Runner`, so each arm reports its wall time, forward calls and forward time.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass


from harness import cache as kv
from harness.decode import Greedy, Runner, feed_chunks, greedy, new_cache, as_batch
from harness.errors import BadInput

CONSTRUCTION_HELP = "live, prefill, incremental, incremental-1, chunked:N, batched:N (N >= 1)"


class ProtocolError(BadInput, ValueError):
    """Bad protocol input, raised before any compute."""


@dataclass(frozen=True)
class Construction:
    """How a boundary state over P is built (see DESIGN.md, 'construction')."""

    kind: str
    n: int | None = None

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.n}" if self.n is not None else self.kind

    def chunk_sizes(self, prompt_length: int, prefix_length: int) -> list[int]:
        """The forward-call sizes that feed P (not used by `live`)."""
        if self.kind in ("prefill", "batched"):
            return [prefix_length]
        if self.kind == "incremental":
            return [prompt_length] + [1] * (prefix_length - prompt_length)
        if self.kind == "incremental-1":
            return [1] * prefix_length
        if self.kind == "chunked":
            full, rest = divmod(prefix_length, self.n)
            return [self.n] * full + ([rest] if rest else [])
        raise ProtocolError(f"{self.label} has no chunk sizes")


def parse_construction(text: str) -> Construction:
    """`prefill`, `chunked:16`, `batched:2`, ... -> Construction; ProtocolError otherwise."""
    text = text.strip()
    if text in ("live", "prefill", "incremental", "incremental-1"):
        return Construction(text)
    match = re.fullmatch(r"(chunked|batched):(\d+)", text)
    if match and int(match[2]) >= 1:
        return Construction(match[1], int(match[2]))
    raise ProtocolError(f"unknown arm {text!r}; valid: {CONSTRUCTION_HELP}")


@dataclass(frozen=True)
class TransplantSpec:
    """`recipient<-donor:selection`."""

    recipient: str
    donor: str
    selection: kv.Selection

    @property
    def label(self) -> str:
        return f"{self.recipient}<-{self.donor}:{self.selection.label}"


def parse_transplant(text: str) -> TransplantSpec:
    """`live<-prefill`, `prefill<-live:keys`, `live<-chunked:16:layers=0-4+values`."""
    recipient, arrow, rest = text.strip().partition("<-")
    match = re.fullmatch(r"((?:chunked|batched):\d+|[\w-]+)(?::([\w=+-]+))?", rest.strip())
    if not arrow or not match or not recipient.strip():
        raise ProtocolError(f"bad transplant {text!r}; expected RECIPIENT<-DONOR[:SELECTION], "
                            f"selection: {kv.SELECTION_HELP}")
    recipient, donor = parse_construction(recipient).label, parse_construction(match[1]).label
    try:
        selection = kv.parse_selection(match[2] or "all")
    except ValueError as err:
        raise ProtocolError(str(err)) from None
    return TransplantSpec(recipient, donor, selection)


# --------------------------------------------------------------------------- arms

@dataclass
class Arm:
    """One construction's boundary state and the suffix decoded from it, with its costs."""

    label: str
    state: kv.BoundaryState | None
    suffix: Greedy
    wall_s: float
    forward_calls: int
    forward_s: float
    generated: Greedy | None = None      # live only: the B tokens and their margins
    rows_identical: bool | None = None   # batched only: every row's state equals row 0's

    def record(self, codec, prompt_length: int, answer, matcher) -> dict:
        text = codec.decode(list(self.state.prefix[prompt_length:]) + self.suffix.tokens) \
            if self.state else None
        out = {"construction": self.label, "suffix": self.suffix.tokens,
               "suffix_margins": self.suffix.margins, "suffix_eos": self.suffix.eos,
               "suffix_sha": kv.sha_ids(self.suffix.tokens),
               "cache_sha": kv.sha_cache(self.state) if self.state else None,
               "logits_sha": kv.sha_tensor(self.state.logits) if self.state else None,
               "answer_text": text,
               "correct": matcher(text, answer) if text is not None else None,
               "wall_s": self.wall_s, "forward_calls": self.forward_calls,
               "forward_s": self.forward_s}
        if self.generated is not None:
            out["live_margins"] = self.generated.margins
        if self.rows_identical is not None:
            out["rows_identical"] = self.rows_identical
        return out


def decode_suffix(runner: Runner, state: kv.BoundaryState, steps: int, eos_ids) -> Greedy:
    """`steps` greedy tokens from a boundary state, by the batch-1 suffix decoder."""
    cache = state.to_cache(runner.module)
    suffix, _ = greedy(runner, cache, state.logits, steps, eos_ids, feed_last=False)
    return suffix


def run_live(module, prompt: list[int], B: int, S: int, eos_ids) -> Arm:
    """Prefill the prompt, generate and feed B greedy tokens, then continue S suffix tokens.

    The live run's own continuation is its suffix: nothing is decoded twice. If EOS comes among
    the B tokens the arm has no state (the item is `short`).
    """
    start, runner, cache = time.perf_counter(), Runner(module), new_cache(module)
    logits = runner.forward(as_batch(prompt), cache)[0]
    generated, logits = greedy(runner, cache, logits, B, eos_ids, feed_last=True)
    if generated.eos:
        return Arm("live", None, Greedy(), time.perf_counter() - start, runner.calls,
                   runner.seconds, generated=generated)
    state = kv.snapshot(cache, prompt + generated.tokens, logits[None])
    suffix, _ = greedy(runner, cache, logits, S, eos_ids, feed_last=False)
    return Arm("live", state, suffix, time.perf_counter() - start, runner.calls, runner.seconds,
               generated=generated)


def run_construction(module, construction: Construction, prompt_length: int,
                     prefix: list[int], S: int, eos_ids) -> Arm:
    """Build the boundary state over `prefix` the given way and decode its suffix."""
    start, runner, cache = time.perf_counter(), Runner(module), new_cache(module)
    rows = construction.n if construction.kind == "batched" else 1
    sizes = construction.chunk_sizes(prompt_length, len(prefix))
    logits = feed_chunks(runner, cache, prefix, sizes, rows)          # [rows, V]
    state = kv.snapshot(cache, prefix, logits)
    rows_identical = kv.rows_identical(cache, logits) if rows > 1 else None
    del cache
    suffix = decode_suffix(runner, state, S, eos_ids)
    return Arm(construction.label, state, suffix, time.perf_counter() - start, runner.calls,
               runner.seconds, rows_identical=rows_identical)


def build_arm(module, construction: Construction, prompt: list[int], prefix: list[int], S: int,
              eos_ids) -> Arm:
    """`live` regenerates P itself; every other construction is built over the given P."""
    if construction.kind == "live":
        return run_live(module, prompt, len(prefix) - len(prompt), S, eos_ids)
    return run_construction(module, construction, len(prompt), prefix, S, eos_ids)


def compare_arms(a: Arm, b: Arm, kind: str) -> dict:
    """Cache, boundary logits and suffix comparison of two arms (a is the reference)."""
    out = {"a": a.label, "b": b.label, "kind": kind,
           "prefix_identical": a.state.prefix == b.state.prefix}
    if out["prefix_identical"]:
        out["cache"] = kv.compare_states(a.state, b.state)
        out["logits"] = kv.compare_logits(a.state.logits, b.state.logits)
    out["suffix"] = kv.compare_suffixes(a.suffix.tokens, b.suffix.tokens, a.suffix.margins,
                                        b.suffix.margins)
    return out


def run_transplant(module, spec: TransplantSpec, arms: dict[str, Arm], prompt_length: int,
                   S: int, eos_ids) -> dict:
    """Decode the suffix of recipient-with-donor's-cache and classify it."""
    recipient, donor = arms[spec.recipient], arms[spec.donor]
    out = {"label": spec.label, "recipient": spec.recipient, "donor": spec.donor,
           "selection": spec.selection.label,
           "recipient_equals_donor": recipient.suffix.tokens == donor.suffix.tokens}
    if kv.compare_logits(recipient.state.logits, donor.state.logits)["argmax_agree"] is False:
        return {**out, "outcome": "boundary", "suffix": None, "forward_calls": 0}
    state = kv.transplant(recipient.state, donor.state, spec.selection, prompt_length)
    runner = Runner(module)
    suffix = decode_suffix(runner, state, S, eos_ids)
    if suffix.tokens == recipient.suffix.tokens:
        outcome = "recipient"
    elif suffix.tokens == donor.suffix.tokens:
        outcome = "donor"
    else:
        outcome = "third"
    return {**out, "outcome": outcome, "suffix": suffix.tokens,
            "suffix_sha": kv.sha_ids(suffix.tokens), "forward_calls": runner.calls,
            "forward_s": runner.seconds}


# --------------------------------------------------------------------------- one item

@dataclass(frozen=True)
class ItemPlan:
    """What to measure on one item: B, S, arms, replicas, transplants (all validated)."""

    B: int
    S: int
    arms: tuple[str, ...] = ("live", "prefill", "incremental")
    replicas: tuple[str, ...] = ()
    transplants: tuple[TransplantSpec, ...] = ()
    transplant_rows: str = "all"   # "divergent": only where recipient and donor suffixes differ
    ignore_eos: bool = False       # generate B and S tokens whatever the model emits

    def __post_init__(self) -> None:
        if self.B < 1 or self.S < 1:
            raise ProtocolError(f"B and S must be positive (got B={self.B}, S={self.S})")
        if self.transplant_rows not in ("all", "divergent"):
            raise ProtocolError(f"transplant_rows {self.transplant_rows!r}; valid: all, divergent")
        arms = [parse_construction(a).label for a in self.arms]
        for spec in self.transplants:
            arms += [spec.recipient, spec.donor]
        arms += [parse_construction(r).label for r in self.replicas]
        ordered = ["live"] + [a for a in dict.fromkeys(arms) if a != "live"]
        object.__setattr__(self, "arms", tuple(ordered))

    def check_fits(self, prompt_length: int, context_length: int) -> None:
        """Refuse before any compute when prompt + B + S exceeds the model's context."""
        need = prompt_length + self.B + self.S
        if need > context_length:
            raise ProtocolError(f"prompt ({prompt_length} tokens) + B ({self.B}) + S ({self.S}) "
                                f"= {need} exceeds the model's context of {context_length}")


def run_item(model, stack, item, plan: ItemPlan, matcher=None) -> dict:
    """Measure one item on one stack: every arm, comparisons vs live, replicas, transplants."""
    start = time.perf_counter()
    codec, eos = model.codec, frozenset() if plan.ignore_eos else model.codec.eos_ids
    prompt = codec.prompt_ids(item.prompt)
    plan.check_fits(len(prompt), model.context_length)
    matcher = matcher or (lambda text, answer: None)
    record = {"item": {"id": item.id, "prompt": item.prompt, "answer": item.answer},
              "model": model.name, "stack": stack.describe(), "B": plan.B, "S": plan.S,
              "ignore_eos": plan.ignore_eos,
              "prompt_length": len(prompt), "arms": {}, "comparisons": [], "transplants": []}
    with stack.activate(model) as module:
        # Casting the model to this stack's dtype (once per process) is set-up, not protocol.
        record["setup_s"], start = time.perf_counter() - start, time.perf_counter()
        live = run_live(module, prompt, plan.B, plan.S, eos)
        if live.state is None:
            record.update(status="short", arms={"live": {
                "construction": "live", "generated": live.generated.tokens,
                "wall_s": live.wall_s, "forward_calls": live.forward_calls,
                "forward_s": live.forward_s}},
                note=f"EOS after {len(live.generated.tokens)} of B={plan.B} live tokens")
            return _finish(record, [live], start)
        prefix = list(live.state.prefix)
        arms = {"live": live}
        for label in plan.arms[1:]:
            arms[label] = build_arm(module, parse_construction(label), prompt, prefix, plan.S,
                                    eos)
        for label in plan.arms[1:]:
            kind = "bridge" if label == "incremental" else "arm"
            record["comparisons"].append(compare_arms(live, arms[label], kind))
        spent = list(arms.values())
        for label in plan.replicas:
            replica = build_arm(module, parse_construction(label), prompt, prefix, plan.S, eos)
            replica.label = label + "'"
            comparison = compare_arms(arms[label], replica, "replica")
            comparison["replica_fingerprints"] = _fingerprints(replica)
            record["comparisons"].append(comparison)
            spent.append(replica)
        for spec in plan.transplants:
            same = arms[spec.recipient].suffix.tokens == arms[spec.donor].suffix.tokens
            if plan.transplant_rows == "divergent" and same:
                continue   # an exact row outside the control sample: no forward calls spent
            record["transplants"].append(run_transplant(module, spec, arms, len(prompt),
                                                        plan.S, eos))
    record["status"] = "ok"
    record["prefix"] = prefix
    record["prefix_sha"] = kv.sha_ids(prefix)
    record["arms"] = {label: arm.record(codec, len(prompt), item.answer, matcher)
                      for label, arm in arms.items()}
    return _finish(record, spent, start)


def _fingerprints(arm: Arm) -> dict:
    return {"cache_sha": kv.sha_cache(arm.state), "logits_sha": kv.sha_tensor(arm.state.logits),
            "suffix_sha": kv.sha_ids(arm.suffix.tokens),
            "prefix_sha": kv.sha_ids(arm.state.prefix)}


def _finish(record: dict, arms: list[Arm], start: float) -> dict:
    calls = sum(a.forward_calls for a in arms) + sum(t.get("forward_calls", 0)
                                                     for t in record["transplants"])
    forward_s = sum(a.forward_s for a in arms) + sum(t.get("forward_s", 0.0)
                                                     for t in record["transplants"])
    wall = time.perf_counter() - start
    record["timing"] = {"wall_s": wall, "forward_calls": calls, "forward_s": forward_s,
                        "overhead": wall / forward_s if forward_s else None}
    return record


# --------------------------------------------------------------------------- precision crossing

def run_crossing(model, item, reference, stacks, B: int, S: int,
                 constructions=("incremental", "prefill")) -> dict:
    """Fixed-prefix crossing: freeze P from the reference stack's live run, then build each
    construction in each stack over that same P and compare suffixes."""
    codec, eos = model.codec, model.codec.eos_ids
    prompt = codec.prompt_ids(item.prompt)
    ItemPlan(B, S).check_fits(len(prompt), model.context_length)
    with reference.activate(model) as module:
        live = run_live(module, prompt, B, S, eos)
    out = {"item": {"id": item.id, "prompt": item.prompt, "answer": item.answer},
           "reference": reference.describe(), "B": B, "S": S, "cells": {},
           "comparisons": []}
    if live.state is None:
        return {**out, "status": "short"}
    prefix = list(live.state.prefix)
    out.update(status="ok", prefix_sha=kv.sha_ids(prefix), reference_suffix=live.suffix.tokens)
    cells: dict[str, Arm] = {}
    for stack in stacks:
        with stack.activate(model) as module:
            for name in constructions:
                arm = run_construction(module, parse_construction(name), len(prompt), prefix, S,
                                       eos)
                cells[f"{stack.label}|{name}"] = arm
        first, second = (cells[f"{stack.label}|{c}"] for c in constructions[:2])
        comparison = compare_arms(first, second, "crossing")
        comparison["stack"] = stack.label
        out["comparisons"].append(comparison)
    for key, arm in cells.items():
        out["cells"][key] = {**_fingerprints(arm), "suffix": arm.suffix.tokens,
                             "same_as_reference_live": arm.suffix.tokens == live.suffix.tokens,
                             "forward_calls": arm.forward_calls, "wall_s": arm.wall_s}
    return out
