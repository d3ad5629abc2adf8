"""`kvfid repro`: one item on one stack, every input checked before any compute.

`prepare` turns the command's options into a model, a stack, an item and a plan, refusing bad
input with `BadInput` (exit 2: the option, the value, what is allowed) and what this machine
cannot do with `Unavailable` (exit 3): unknown models, devices, thread counts, prompts that are
empty or not UTF-8, item sets that cannot be read, item indices out of range, transplant
selections outside the model's layers or the boundary prefix, prompts that do not fit, models
the stack's attention backend cannot serve. `measure` runs what `prepare` checked; `repro` is the
whole command: prepare, measure, the verdict and the environment record; with a stage
program, `repro_program` checks and measures its layout the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvfid import checks
from kvfid.protocol.engine_arms import check_rollback
from kvfid.stacks.stack import Stack, check_supports
from kvfid.errors import BadInput
from kvfid.names import BIT_EXACT, DIVERGES, MODEL_NAMES, PRESET_NAMES
from kvfid.inputs.models import load_model
from kvfid.protocol.protocol import ItemPlan, parse_transplant


@dataclass
class Repro:
    """What `kvfid repro` measures, checked."""

    model: object
    stack: Stack
    item: object
    plan: ItemPlan
    cross_stacks: list
    model_name: str = ""
    world: int = 1           # ranks the item runs on: the largest TP size of the stack and arms


def prepare(model_name: str, prompt: str | None, item_set: str | None, item_index: int | None,
            backend: str, dtype: str, batch_invariant: bool, device: str, threads: int | None,
            boundary: int, suffix: int, arms: str, replicas: str, transplants, cross,
            ignore_eos: bool = False, compiled: bool = False,
            faithful_recurrence: bool | None = None, tp: int = 1) -> Repro:
    """Check every option, then load the model and check what needs it (layers, context).
    `model_name`: a preset, `hf:<folder>`, or a Model already loaded (the Python API's; at TP
    size 1 only: each rank loads the model by its name)."""
    loaded = None if isinstance(model_name, str) else model_name
    if loaded is None:
        check_model_name(model_name)
    stack = checked_stack(backend, dtype, batch_invariant, device, threads, compiled,
                          faithful_recurrence, tp)
    try:
        plan = ItemPlan(boundary, suffix, checks.split_arms(arms),
                        checks.split_arms(replicas),
                        tuple(parse_transplant(t) for t in transplants), ignore_eos=ignore_eos)
        cross_stacks = [stack.with_dtype(d) for d in cross.split(",")] if cross else []
    except ValueError as err:
        raise BadInput(str(err)) from None
    for arm in plan.arms:
        checks.require(checks.construction_reason(arm), "--arms", arm)
    world = plan_world(stack, plan.arms, "--arms")
    if loaded is not None and world > 1:
        raise BadInput("a model loaded in memory is measured at TP size 1; give a preset or "
                       "hf:<folder> for TP sizes above 1 (each rank loads it by that name)")
    item = pick_item(prompt, item_set, item_index)
    model = loaded or load_model(model_name)
    prompt_length = len(model.codec.prompt_ids(item.prompt))
    plan.check_fits(prompt_length, model.context_length)
    for each in [stack, *cross_stacks]:
        check_supports(each, model, prompt_length + boundary + suffix)
        if world > each.tp:   # an arm at the larger size
            check_supports(replace(each, tp=world), model, prompt_length + boundary + suffix)
    check_rollback(model, plan.arms)
    layers = int(model.config.num_hidden_layers)
    for spec in plan.transplants:
        checks.require(checks.selection_reason(spec.selection, layers, prompt_length + boundary),
                       "--transplant", spec.label)
    return Repro(model, stack, item, plan, cross_stacks, model.name if loaded else model_name,
                 world)


def check_model_name(model_name: str) -> None:
    """Refuse a model that is neither a preset nor hf:<folder> (exit 2), before any loading."""
    if model_name not in PRESET_NAMES and not (model_name.startswith("hf:") and len(model_name) > 3):
        raise BadInput(f"--model: unknown model {model_name!r}; valid: {', '.join(MODEL_NAMES)}")


def checked_stack(backend: str, dtype: str, batch_invariant: bool, device: str,
                  threads: int | None, compiled: bool = False,
                  faithful_recurrence: bool | None = None, tp: int = 1) -> Stack:
    """The stack of a command's options, each checked (exit 2 naming what is allowed)."""
    checks.device_and_threads(device, threads)
    checks.require(checks.tp_reason(tp), "--tp", tp)
    try:
        return Stack(backend, dtype, batch_invariant, device, threads, compiled,
                     faithful_recurrence=faithful_recurrence, tp=tp)
    except ValueError as err:
        raise BadInput(str(err)) from None


def plan_world(stack: Stack, arms, option: str) -> int:
    """How many ranks an item needs: the largest TP size of the stack and its arms (`@tpN`);
    one item runs TP size 1 and one other size only (exit 2 otherwise)."""
    from kvfid.protocol.constructions import parse_construction

    sizes = {stack.tp} | {int(c.at[2:]) for c in map(parse_construction, arms) if c.at}
    world = max(sizes)
    if not sizes <= {1, world}:
        raise BadInput(f"{option}: TP sizes {sorted(sizes)} in one item; it runs at TP size 1 "
                       f"and one other size N (the stack's, or its arms' @tpN)")
    return world


def pick_item(prompt: str | None, item_set: str | None, item_index: int | None):
    """The item of `--prompt`, or of `--item-set` and `--item`."""
    from kvfid.inputs import items

    if (prompt is None) == (item_set is None):
        raise BadInput("give exactly one of --prompt or --item-set/--item")
    if prompt is not None:
        checks.require(checks.prompt_reason(prompt), "--prompt", prompt)
        return items.Item(id="prompt", prompt=prompt, answer=None)
    if item_index is None or not 0 <= item_index < checks.MAX_ITEMS:
        raise BadInput(f"--item = {item_index!r} is not allowed; --item-set needs --item N with "
                       f"0 <= N < {checks.MAX_ITEMS}")
    try:
        chosen = items.load_item_set(item_set, item_index + 1 if not item_set.startswith("jsonl:") else None)
    except ValueError as err:
        raise BadInput(f"--item-set {item_set}: {err}") from None
    if item_index >= len(chosen):
        raise BadInput(f"--item = {item_index} is not allowed; {item_set} has {len(chosen)} "
                       f"items (0 to {len(chosen) - 1})")
    return chosen[item_index]


def measure(repro: Repro):
    """Run the checked repro: the item's ItemRecord, with its crossing when asked for."""
    from dataclasses import replace

    from kvfid.inputs.items import match_answer
    from kvfid.protocol.protocol import run_crossing, run_item

    if repro.world > 1:
        from kvfid.stacks.ranks import on_ranks

        return on_ranks(repro.world, _measure_ranked, repro.model_name, repro.stack, repro.item,
                        repro.plan, repro.cross_stacks, device=repro.stack.device)
    record = run_item(repro.model, repro.stack, repro.item, repro.plan, matcher=match_answer)
    record = settle_in_fp32(repro, record)
    if repro.cross_stacks:
        record = replace(record, crossing=run_crossing(repro.model, repro.item, repro.stack,
                                                       repro.cross_stacks, repro.plan.B,
                                                       repro.plan.S))
    return record


def settle_in_fp32(repro: Repro, record):
    """The record with each unsettled difference (a stack below fp32: kvfid.states.scale)
    settled by the same comparison on the same stack in fp32: rounding where fp32 agrees to fp32
    rounding, functional where it differs far above it. Unchanged where nothing is unsettled, or
    where the fp32 stack cannot serve the model (the kinds stay unsettled)."""
    from dataclasses import replace

    from kvfid.errors import KvfidError
    from kvfid.protocol.protocol import ItemPlan, run_item
    from kvfid.states import scale

    unsettled = [c for c in record.comparisons
                 if c.difference is not None and c.difference.kind == scale.UNSETTLED]
    if not unsettled:
        return record
    twin = repro.stack.with_dtype("fp32")
    plan = ItemPlan(repro.plan.B, repro.plan.S, repro.plan.arms, ignore_eos=repro.plan.ignore_eos)
    try:
        check_supports(twin, repro.model, len(repro.model.codec.prompt_ids(repro.item.prompt))
                       + plan.B + plan.S)
        fp32 = run_item(repro.model, twin, repro.item, plan)
    except KvfidError:
        return record
    found = {c.b: c for c in fp32.comparisons}

    def settled(comparison):
        there = found.get(comparison.b)
        mine = any(comparison is u for u in unsettled)
        if not mine or there is None or not there.prefix_identical:
            return comparison   # fp32 built another P: no same comparison to settle by
        kind = None if there.difference is None else there.difference.kind
        shown = ("bit-exact" if kind is None else
                 f"{kind}, d_rel {there.difference.d_rel:.2g}")
        return replace(comparison, difference=replace(
            comparison.difference, kind=scale.settle(scale.UNSETTLED, kind),
            settled_by=f"{twin.label}: {shown}"))

    return replace(record, comparisons=tuple(settled(c) for c in record.comparisons))


def _measure_ranked(model_name: str, stack: Stack, item, plan: ItemPlan, cross_stacks):
    """One rank's part of a TP repro: the model loaded here, the item measured by every rank."""
    from kvfid.inputs.models import load_model

    repro = Repro(load_model(model_name), stack, item, plan, list(cross_stacks), model_name)
    return measure(repro)


def verdict(record) -> str | None:
    """`bit-exact` or `diverges` (kvfid.names.VERDICT_HELP) of an ItemRecord; None when nothing
    was compared with live (live ended before B tokens, or live was the only arm)."""
    against_live = [c for c in record.comparisons if c.kind in ("arm", "bridge")]
    if not record.ok or not against_live:
        return None
    exact = all(c.prefix_identical and c.bit_exact and c.suffix.identical for c in against_live)
    return BIT_EXACT if exact else DIVERGES


def difference_kind(record) -> str | None:
    """The gravest kind among the differences of the arms compared with live (functional, then
    unsettled, then rounding; kvfid.states.scale), None where none differs."""
    from kvfid.states import scale

    kinds = {c.difference.kind for c in record.comparisons
             if c.kind in ("arm", "bridge") and c.difference is not None}
    return next((k for k in (scale.FUNCTIONAL, scale.UNSETTLED, scale.ROUNDING) if k in kinds), None)


@dataclass
class ReproOutcome:
    """What `kvfid repro` prints, and whether the verdict is the expected one."""

    record: object           # kvfid.records.record.ItemRecord
    codec: object
    environment: dict
    environment_key: str

    @property
    def verdict(self) -> str | None:
        return verdict(self.record)

    def passed(self, expect: str | None) -> bool:
        return expect is None or self.verdict == expect

    def to_json(self) -> dict:
        from dataclasses import replace

        from kvfid.records.record import to_dict

        return {**to_dict(replace(self.record, environment=self.environment)),
                "verdict": self.verdict, "difference": difference_kind(self.record),
                "environment_key": self.environment_key}

    def text(self) -> str:
        from kvfid.diagnoses import render

        from kvfid.states.scale import describe

        shown = self.verdict or "none (nothing was compared with live)"
        kind = difference_kind(self.record)
        if kind is not None:
            shown += f"; the difference is {describe(kind)}"
        return f"{render.item_text(self.record, self.codec)}\n\nverdict: {shown}"


@dataclass
class ProgramOutcome:
    """What `kvfid repro --program` prints, and whether the verdict is the expected one."""

    run: object               # kvfid.records.program.ProgramRun
    stack: dict               # Stack.describe()
    layout: object            # kvfid.stages.program.Layout: the live run's integers
    crossing: object          # kvfid.stages.crossing.ProgramCrossing, or None
    environment: dict
    environment_key: str

    @property
    def verdict(self) -> str | None:
        exact = [c.bit_exact and c.logits.equal and c.suffix.identical for c in self.run.comparisons]
        return None if not exact else BIT_EXACT if all(exact) else DIVERGES

    def passed(self, expect: str | None) -> bool:
        return expect is None or self.verdict == expect

    def to_json(self) -> dict:
        from kvfid.records.plain import as_plain

        layout = {k: getattr(self.layout, k) for k in ("tokens", "segments", "positions")}
        crossed = {} if self.crossing is None else {"crossing": as_plain(self.crossing)}
        return {**as_plain(self.run), "stack": self.stack, "layout": layout, **crossed,
                "verdict": self.verdict, "environment": self.environment,
                "environment_key": self.environment_key}

    def text(self) -> str:
        from kvfid.diagnoses.render import program_text

        return program_text(self.run, self.stack["label"], self.crossing, self.verdict)


def repro_program(program: str, model_name: str, prompt, item_set, item_index, backend: str,
                  dtype: str, batch_invariant: bool, device: str, threads, boundary: int,
                  suffix: int, arms: str, replicas: str, transplants, cross,
                  ignore_eos: bool = False, compiled: bool = False,
                  faithful_recurrence: bool = False, tp: int = 1) -> ProgramOutcome:
    """`kvfid repro` over a stage program's layout (kvfid.stages.program): every option and
    the program checked before any compute (exit 2 in one line), the arms measured at its merge
    boundary, its verdict against live."""
    from kvfid.environment import envinfo
    from kvfid.stages import checks as stages_checks, program as stages

    spec = stages.parse_program(program)
    if suffix < 1:
        raise BadInput(f"-S = {suffix}: a stage program needs a suffix of at least 1 token")
    check_model_name(model_name)
    if tp != 1:
        raise BadInput(f"--tp {tp}: a stage program runs at TP size 1 only")
    stack = checked_stack(backend, dtype, batch_invariant, device, threads, compiled,
                          faithful_recurrence)
    try:
        crossed = [stack.with_dtype(d) for d in cross.split(",")] if cross else []
    except ValueError as err:
        raise BadInput(f"--cross {cross}: {err}") from None
    chosen, again = (tuple(a for a in text.split(",") if a) for text in (arms, replicas))
    stages_checks.check_plan(chosen, again)
    item = pick_item(prompt, item_set, item_index)
    model = load_model(model_name)
    prompt_length = len(model.codec.prompt_ids(item.prompt))
    moves, length = stages.check(model, spec, prompt_length, suffix, chosen, tuple(transplants))
    for each in [stack, *crossed]:
        check_supports(each, model, length)
    measured = stages.measure(model, stack, item.prompt, spec, suffix, chosen, ignore_eos, again,
                              moves)
    from kvfid.stages.crossing import run_crossing

    eos = frozenset() if ignore_eos else model.codec.eos_ids
    crossing = run_crossing(model, measured, stack.label, crossed, suffix, eos) if crossed else None
    environment = envinfo.collect()
    return ProgramOutcome(measured.run, stack.describe(), measured.layout, crossing, environment,
                          envinfo.environment_key(environment))


def repro(program: str | None = None, **options) -> ReproOutcome | ProgramOutcome:
    """`kvfid repro`: every option checked (exit 2 / 3), the item measured (one stream, or over
    a stage program's layout: `repro_program`), the verdict and the environment it was measured
    in."""
    from kvfid.environment import envinfo

    if program:
        return repro_program(program, **options)
    checked = prepare(**options)
    record = measure(checked)
    environment = envinfo.collect()
    return ReproOutcome(record, checked.model.codec, environment,
                        envinfo.environment_key(environment))
