"""The protocol: constructions (arms), suffixes, replicas, the bridge, transplants, the crossing.

`run_item` measures one item on one stack into an `ItemRecord`; `run_crossing` runs the
fixed-prefix precision crossing into a `CrossingRecord` (kvfid.records.record). Both take a
`Model` and `Stack`s and never look inside either: which attention backend or precision runs is
the stack's business. Every forward call goes through
a `Runner`, so each arm reports its wall time, forward calls and forward time; one untimed warm-up
forward comes first, so the first arm does not pay for lazy initialization (`warm_up`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Sequence

from kvfid.states import cache as kv
from kvfid.protocol import cobatch
from kvfid.states import scale, surgery
from kvfid.records import record as rec
from kvfid.protocol.constructions import (CONSTRUCTION_HELP, Construction, ProtocolError,  # noqa: F401
                                   TransplantSpec, parse_construction, parse_transplant)
from kvfid.states.cache import top2
from kvfid.protocol.decode import (Feeding, Greedy, Runner, as_batch, greedy,
                                   new_cache, next_token, resume)

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
    cobatch: dict | None = None          # cobatched only: the co-batch's rows (cobatch.CoBatch)
    acceptance: tuple[int, ...] | None = None  # spec:k only: accepted drafts per verification

    def record(self, codec, prompt_length: int, answer, matcher) -> rec.ArmRecord:
        text = codec.decode(list(self.state.prefix[prompt_length:]) + self.suffix.tokens) \
            if self.state else None
        return rec.ArmRecord(
            self.label, tuple(self.suffix.tokens), tuple(self.suffix.margins), self.suffix.eos,
            kv.sha_ids(self.suffix.tokens),
            kv.sha_cache(self.state) if self.state else None,
            kv.sha_tensor(self.state.logits) if self.state else None,
            text, matcher(text, answer) if text is not None else None,
            self.wall_s, self.forward_calls, self.forward_s,
            live_margins=tuple(self.generated.margins) if self.generated is not None else None,
            rows_identical=self.rows_identical, cobatch=self.cobatch, acceptance=self.acceptance)

    def fingerprints(self) -> rec.Fingerprints:
        return rec.Fingerprints(kv.sha_cache(self.state), kv.sha_tensor(self.state.logits),
                                kv.sha_ids(self.suffix.tokens), kv.sha_ids(self.state.prefix))


def decode_suffix(runner: Runner, state: kv.BoundaryState, steps: int, eos_ids,
                  feeding: Feeding = next_token) -> Greedy:
    """`steps` greedy tokens from a boundary state, by the batch-1 suffix decoder; `feeding`
    gives the feed of the cache resumed from it (a stage program's: at its layout's positions)."""
    suffix, _ = greedy(state.logits, steps, eos_ids, feeding(runner, resume(state, runner.module)))
    return suffix


def run_live(module, prompt: list[int], B: int, S: int, eos_ids) -> Arm:
    """Prefill the prompt, generate and feed B greedy tokens, then continue S suffix tokens.

    The live run's own continuation is its suffix: nothing is decoded twice. If EOS comes among
    the B tokens the arm has no state (the item is `short`).
    """
    start, runner = time.perf_counter(), Runner(module)
    logits, cached = runner.forward(as_batch(prompt), new_cache(module))
    feed = next_token(runner, cached)
    generated, logits = greedy(logits[0], B, eos_ids, feed, feed_last=True)
    if generated.eos:
        return Arm("live", None, Greedy(), time.perf_counter() - start, runner.calls,
                   runner.seconds, generated=generated)
    state = kv.snapshot(feed.cached.cache, prompt + generated.tokens, logits[None],
                        config=module.config)
    suffix, _ = greedy(logits, S, eos_ids, feed)
    return Arm("live", state, suffix, time.perf_counter() - start, runner.calls, runner.seconds,
               generated=generated)


def run_construction(module, construction: Construction, prompt_length: int,
                     prefix: list[int], S: int, eos_ids, layout=None) -> Arm:
    """Build the boundary state over `prefix` the given way and decode its suffix. `layout`: a
    stage program's (kvfid.stages.program.Layout, over `prefix`), whose `chunk` feeds each chunk
    under its visibility at its positions and whose `suffix_feed` decodes in its last stage;
    None: one plain stream."""
    start, runner = time.perf_counter(), Runner(module)
    logits, acceptance, cached = construction.build(                            # [rows, V]
        runner, new_cache(module), prompt_length, prefix,
        module.config.get_text_config().vocab_size, layout)
    state = kv.snapshot(cached.cache, prefix, logits, config=module.config)
    rows_identical = kv.rows_identical(cached.cache, logits) if construction.rows > 1 else None
    del cached
    suffix = decode_suffix(runner, state, S, eos_ids,
                           next_token if layout is None else layout.suffix_feed)
    return Arm(construction.label, state, suffix, time.perf_counter() - start, runner.calls,
               runner.seconds, rows_identical=rows_identical, acceptance=acceptance)


@dataclass(frozen=True)
class Neighbours:
    """Whom a co-batched item may be batched with: (item id, prompt ids) of its item set, and the
    longest row the context leaves room for."""

    item_id: str
    pool: tuple[tuple[str, list[int]], ...]
    max_length: int


def run_cobatched(module, construction: Construction, prefix: list[int], S: int, eos_ids,
                  neighbours: Neighbours) -> Arm:
    """P built in one left-padded batch with other items; the item's row (padding dropped) is the
    state. `+decode`: the suffix is decoded in the same co-batch, else by the batch-1 decoder."""
    start, runner = time.perf_counter(), Runner(module)
    batch = cobatch.choose(prefix, neighbours.item_id, neighbours.pool, construction.n,
                           neighbours.max_length)
    logits, mask, cached = cobatch.prefill(runner, new_cache(module), batch)   # [N, V], [N, W]
    state = kv.snapshot(cached.cache, prefix, logits, batch.row, batch.pads[batch.row],
                        config=module.config)
    if construction.decode_in_batch:
        suffix, _ = greedy(logits[batch.row], S, eos_ids,
                           cobatch.in_batch(runner, cached, batch, logits, mask))
    else:
        del cached
        suffix = decode_suffix(runner, state, S, eos_ids)
    return Arm(construction.label, state, suffix, time.perf_counter() - start, runner.calls,
               runner.seconds, cobatch=batch.describe())


def build_arm(module, construction: Construction, prompt: list[int], prefix: list[int], S: int,
              eos_ids, neighbours: Neighbours | None = None) -> Arm:
    """`live` regenerates P itself; every other construction is built over the given P."""
    if construction.regenerates:
        return run_live(module, prompt, len(prefix) - len(prompt), S, eos_ids)
    if construction.needs_neighbours:
        return run_cobatched(module, construction, prefix, S, eos_ids, neighbours)
    return run_construction(module, construction, len(prompt), prefix, S, eos_ids)


def compare_arms(a: Arm, b: Arm, kind: str) -> rec.Comparison:
    """Cache, boundary logits and suffix comparison of two arms (a is the reference)."""
    suffix = kv.compare_suffixes(a.suffix.tokens, b.suffix.tokens, a.suffix.margins,
                                 b.suffix.margins)
    same = a.state.prefix == b.state.prefix
    if not same:
        return rec.Comparison(a.label, b.label, kind, suffix, same)
    cache = kv.compare_states(a.state, b.state)
    logits = kv.compare_logits(a.state.logits, b.state.logits)
    return rec.Comparison(a.label, b.label, kind, suffix, same, cache, logits,
                          scale.difference(cache, logits, scale.state_dtype(a.state)))


def run_transplant(module, spec: TransplantSpec, arms: dict[str, Arm], prompt_length: int,
                   S: int, eos_ids, feeding: Feeding = next_token) -> rec.TransplantRecord:
    """Decode the suffix of recipient-with-donor's-cache and classify it (`feeding`: as
    `decode_suffix`'s)."""
    recipient, donor = arms[spec.recipient], arms[spec.donor]
    done = functools.partial(rec.TransplantRecord, spec.label, spec.recipient, spec.donor,
                             spec.selection.label,
                             recipient.suffix.tokens == donor.suffix.tokens)
    if top2(recipient.state.logits)[0] != top2(donor.state.logits)[0]:
        return done("boundary")
    state = surgery.transplant(recipient.state, donor.state, spec.selection, prompt_length)
    runner = Runner(module)
    suffix = decode_suffix(runner, state, S, eos_ids, feeding)
    if suffix.tokens == recipient.suffix.tokens:
        outcome = "recipient"
    elif suffix.tokens == donor.suffix.tokens:
        outcome = "donor"
    else:
        outcome = "third"
    return done(outcome, tuple(suffix.tokens), kv.sha_ids(suffix.tokens), runner.calls,
                runner.seconds)


# --------------------------------------------------------------------------- one item

@dataclass(frozen=True)
class ItemPlan:
    """What to measure on one item: B, S, arms, replicas, transplants (all validated). Arms and
    replicas are given as Constructions (or their labels, parsed here) and kept as labels;
    `construction(label)` is each one's Construction."""

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
        built = [parse_construction(a) for a in self.arms]
        for spec in self.transplants:
            built += [parse_construction(spec.recipient), parse_construction(spec.donor)]
        again = tuple(parse_construction(r) for r in self.replicas)
        built += again
        live = parse_construction("live")
        chosen = {c.label: c for c in [live, *built]}
        object.__setattr__(self, "arms", tuple(chosen))
        object.__setattr__(self, "replicas", tuple(c.label for c in again))
        object.__setattr__(self, "_constructions", chosen)

    def construction(self, label: str) -> Construction:
        """The Construction of one of the plan's arms or replicas."""
        return self._constructions[label]

    def check_fits(self, prompt_length: int, context_length: int) -> None:
        """Refuse before any compute when prompt + B + S exceeds the model's context."""
        need = prompt_length + self.B + self.S
        if need > context_length:
            raise ProtocolError(f"prompt ({prompt_length} tokens) + B ({self.B}) + S ({self.S}) "
                                f"= {need} exceeds the model's context of {context_length}")
        for label in self.arms:   # e.g. a prefix-cache hit must leave something to extend
            self.construction(label).check_fits(prompt_length, prompt_length + self.B)


def run_item(model, stack, item, plan: ItemPlan, matcher=None,
             neighbours: Sequence = ()) -> rec.ItemRecord:
    """Measure one item on one stack: every arm, comparisons vs live, replicas, transplants.
    `neighbours`: the item set that co-batched arms draw from (default: the built-in arith set)."""
    start = time.perf_counter()
    codec, eos = model.codec, frozenset() if plan.ignore_eos else model.codec.eos_ids
    prompt = codec.prompt_ids(item.prompt)
    plan.check_fits(len(prompt), model.context_length)
    matcher = matcher or (lambda text, answer: None)
    others = None
    if any(plan.construction(label).needs_neighbours for label in plan.arms):
        pool = neighbours or cobatch.default_pool()
        others = Neighbours(item.id, tuple((i.id, codec.prompt_ids(i.prompt)) for i in pool),
                            model.context_length - plan.S)
    head = dict(item=rec.ItemRef(item.id, item.prompt, item.answer), model=model.name,
                stack=stack.describe(), B=plan.B, S=plan.S, ignore_eos=plan.ignore_eos,
                prompt_length=len(prompt))
    with stack.activate(model) as module:
        # Casting the model to this stack's dtype (once per process) is set-up, not protocol.
        setup_s = time.perf_counter() - start
        warmup_s = warm_up(module, prompt)
        start = time.perf_counter()
        live = run_live(module, prompt, plan.B, plan.S, eos)
        if live.state is None:
            arm = rec.ArmRecord("live", generated=tuple(live.generated.tokens),
                                wall_s=live.wall_s, forward_calls=live.forward_calls,
                                forward_s=live.forward_s)
            return rec.ItemRecord(**head, status="short", setup_s=setup_s, warmup_s=warmup_s,
                                  arms={"live": arm}, timing=_timing([live], (), start),
                                  note=f"EOS after {len(live.generated.tokens)} of B={plan.B} "
                                       f"live tokens")
        prefix = list(live.state.prefix)
        arms = {"live": live}
        for label in plan.arms[1:]:
            construction = plan.construction(label)
            with stack.arm(module, construction.at):   # the stack's business (e.g. a TP size)
                arms[label] = build_arm(module, construction, prompt, prefix, plan.S, eos,
                                        others)
        comparisons = tuple(compare_arms(live, arms[label],
                                         "bridge" if label == "incremental" else "arm")
                            for label in plan.arms[1:])
        spent, replicas, transplants = list(arms.values()), [], []
        for label in plan.replicas:
            construction = plan.construction(label)
            with stack.arm(module, construction.at):
                again = build_arm(module, construction, prompt, prefix, plan.S, eos, others)
            replicas.append(rec.Replica(label, again.fingerprints(),
                                        compare_arms(arms[label], again, "replica")))
            spent.append(again)
        for spec in plan.transplants:
            same = arms[spec.recipient].suffix.tokens == arms[spec.donor].suffix.tokens
            if plan.transplant_rows == "divergent" and same:
                continue   # an exact row outside the control sample: no forward calls spent
            transplants.append(run_transplant(module, spec, arms, len(prompt), plan.S, eos))
    return rec.ItemRecord(
        **head, status="ok", setup_s=setup_s, warmup_s=warmup_s,
        arms={label: arm.record(codec, len(prompt), item.answer, matcher)
              for label, arm in arms.items()},
        comparisons=comparisons, replicas=tuple(replicas), transplants=tuple(transplants),
        prefix=tuple(prefix), prefix_sha=kv.sha_ids(prefix),
        timing=_timing(spent, transplants, start))


def warm_up(module, prompt: list[int]) -> float:
    """One untimed forward over the prompt and one decode step, so that no arm's wall time pays
    for lazy initialization (kernel selection, allocator growth, Triton compiles); its seconds."""
    start, runner = time.perf_counter(), Runner(module)
    logits, cached = runner.forward(as_batch(prompt), new_cache(module))
    runner.forward(as_batch([top2(logits[0])[0]]), cached)
    return time.perf_counter() - start


def _timing(arms: list[Arm], transplants, start: float) -> rec.Timing:
    calls = sum(a.forward_calls for a in arms) + sum(t.forward_calls for t in transplants)
    forward_s = sum(a.forward_s for a in arms) + sum(t.forward_s for t in transplants)
    wall = time.perf_counter() - start
    return rec.Timing(wall, calls, forward_s, wall / forward_s if forward_s else None)


# --------------------------------------------------------------------------- precision crossing

def run_crossing(model, item, reference, stacks, B: int, S: int,
                 constructions=("incremental", "prefill")) -> rec.CrossingRecord:
    """Fixed-prefix crossing: freeze P from the reference stack's live run, then build each
    construction in each stack over that same P and compare suffixes."""
    codec, eos = model.codec, model.codec.eos_ids
    prompt = codec.prompt_ids(item.prompt)
    ItemPlan(B, S).check_fits(len(prompt), model.context_length)
    with reference.activate(model) as module:
        warm_up(module, prompt)
        live = run_live(module, prompt, B, S, eos)
    head = dict(item=rec.ItemRef(item.id, item.prompt, item.answer),
                reference=reference.describe(), B=B, S=S)
    if live.state is None:
        return rec.CrossingRecord(**head, status="short")
    prefix = list(live.state.prefix)
    cells, within = [], []
    for stack in stacks:
        with stack.activate(model) as module:
            warm_up(module, prompt)
            built = {c.label: run_construction(module, c, len(prompt), prefix, S, eos)
                     for c in map(parse_construction, constructions)}
        first, second = list(built.values())[:2]
        within.append(rec.StackComparison(stack.label, compare_arms(first, second, "crossing")))
        cells += [rec.CrossingCell(stack.label, name, arm.fingerprints(), tuple(arm.suffix.tokens),
                                   arm.suffix.tokens == live.suffix.tokens, arm.forward_calls,
                                   arm.wall_s) for name, arm in built.items()]
    return rec.CrossingRecord(**head, status="ok", prefix_sha=kv.sha_ids(prefix),
                              reference_suffix=tuple(live.suffix.tokens), cells=tuple(cells),
                              within=tuple(within))
