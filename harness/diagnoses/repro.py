"""`kvfid repro`: one item on one stack, every input checked before any compute.

`prepare` turns the command's stack and options into a model, an item and a plan (the set-up
every diagnosis shares is kvfid.diagnoses.subject's), refusing bad
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
from typing import Sequence

from kvfid import checks
from kvfid.diagnoses.subject import check_subject, plan_world
from kvfid.protocol.constructions import Construction, TransplantSpec, check_rollback
from kvfid.stacks.stack import Stack, check_supports
from kvfid.errors import BadInput, KvfidError
from kvfid.names import BIT_EXACT, DIVERGES
from kvfid.protocol.protocol import ItemPlan, run_crossing, run_item
from kvfid.diagnoses import render
from kvfid.diagnoses.render import program_text
from kvfid.environment import envinfo
from kvfid.inputs.items import match_answer
from kvfid.inputs.models import load_model
from kvfid.records.plain import as_plain
from kvfid.records.record import to_dict
from kvfid.stacks.ranks import on_ranks
from kvfid.stages import checks as stages_checks, program as stages
from kvfid.stages.crossing import run_program_crossing
from kvfid.states import scale
from kvfid.states.scale import describe


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


def typed(values, kind: type, name: str) -> tuple:
    """`values` as a tuple, each one a `kind` (TypeError otherwise: a comma string is parsed at
    the edge, kvfid.protocol.constructions.parse_constructions)."""
    if isinstance(values, str) or not all(isinstance(v, kind) for v in values):
        raise TypeError(f"{name}: a sequence of {kind.__name__}, not {values!r}")
    return tuple(values)


def prepare(model_name, stack: Stack, prompt: str | None, item_set: str | None,
            item_index: int | None, boundary: int, suffix: int,
            constructions: Sequence[Construction], replicas: Sequence[Construction] = (),
            transplants: Sequence[TransplantSpec] = (), cross: Sequence[str] = (),
            ignore_eos: bool = False) -> Repro:
    """Check every option, then load the model and check what needs it (layers, context).
    `model_name`: a preset, `hf:<folder>`, or a Model already loaded (the Python API's; at TP
    size 1 only: each rank loads the model by its name); `cross`: dtype names."""
    constructions = typed(constructions, Construction, "constructions")
    replicas = typed(replicas, Construction, "replicas")
    transplants = typed(transplants, TransplantSpec, "transplants")
    cross = typed(cross, str, "cross")
    try:
        plan = ItemPlan(boundary, suffix, constructions, replicas, transplants,
                        ignore_eos=ignore_eos)
        cross_stacks = [stack.with_dtype(d) for d in cross]
    except ValueError as err:
        raise BadInput(str(err)) from None
    for arm in plan.arms:
        checks.require(plan.construction(arm).reason(), "--constructions", arm)
    subject = check_subject(model_name, stack, prompt, item_set, item_index,
                            world=plan_world(stack, plan.arms, "--constructions"))
    model, prompt_length = subject.model, len(subject.prompt_ids)
    plan.check_fits(prompt_length, model.context_length)
    subject.check_serves(prompt_length + boundary + suffix, tuple(cross_stacks))
    check_rollback(model, plan.arms)
    layers = int(model.config.num_hidden_layers)
    for spec in plan.transplants:
        checks.require(checks.selection_reason(spec.selection, layers, prompt_length + boundary),
                       "--transplant", spec.label)
    return Repro(model, stack, subject.item, plan, cross_stacks, subject.model_name,
                 subject.world)


def measure(repro: Repro):
    """Run the checked repro: the item's ItemRecord, with its crossing when asked for."""
    if repro.world > 1:
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
        return {**to_dict(replace(self.record, environment=self.environment)),
                "verdict": self.verdict, "difference": difference_kind(self.record),
                "environment_key": self.environment_key}

    def text(self) -> str:
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
        layout = {k: getattr(self.layout, k) for k in ("tokens", "segments", "positions")}
        crossed = {} if self.crossing is None else {"crossing": as_plain(self.crossing)}
        return {**as_plain(self.run), "stack": self.stack, "layout": layout, **crossed,
                "verdict": self.verdict, "environment": self.environment,
                "environment_key": self.environment_key}

    def text(self) -> str:
        return program_text(self.run, self.stack["label"], self.crossing, self.verdict)


def repro_program(program: str, model_name: str, stack: Stack, prompt, item_set, item_index,
                  boundary: int, suffix: int, constructions: Sequence[Construction],
                  replicas: Sequence[Construction] = (), transplants: Sequence[str] = (),
                  cross: Sequence[str] = (), ignore_eos: bool = False) -> ProgramOutcome:
    """`kvfid repro` over a stage program's layout (kvfid.stages.program): every option and
    the program checked before any compute (exit 2 in one line; the set-up is
    kvfid.diagnoses.subject's), the arms measured at its merge boundary, its verdict against
    live. `boundary` is the program's merge boundary, not an option's."""
    spec = stages.parse_program(program)
    if suffix < 1:
        raise BadInput(f"-S = {suffix}: a stage program needs a suffix of at least 1 token")
    if stack.tp != 1:
        raise BadInput(f"--tp {stack.tp}: a stage program runs at TP size 1 only")
    try:
        crossed = [stack.with_dtype(d) for d in typed(cross, str, "cross")]
    except ValueError as err:
        raise BadInput(f"--cross {','.join(cross)}: {err}") from None
    chosen, again = (tuple(c.label for c in typed(given, Construction, name))
                     for given, name in ((constructions, "constructions"), (replicas, "replicas")))
    stages_checks.check_plan(chosen, again)
    subject = check_subject(model_name, stack, prompt, item_set, item_index)
    model, prompt_length = subject.model, len(subject.prompt_ids)
    moves, length = stages.check(model, spec, prompt_length, suffix, chosen, tuple(transplants))
    subject.check_serves(length, tuple(crossed))
    measured = stages.measure(model, stack, subject.item.prompt, spec, suffix, chosen, ignore_eos,
                              again, moves)
    crossing = None
    if crossed:
        eos = frozenset() if ignore_eos else model.codec.eos_ids
        crossing = run_program_crossing(model, measured, stack.label, crossed, suffix, eos)
    environment = envinfo.collect()
    return ProgramOutcome(measured.run, stack.describe(), measured.layout, crossing, environment,
                          envinfo.environment_key(environment))


def repro(program: str | None = None, **options) -> ReproOutcome | ProgramOutcome:
    """`kvfid repro`: every option checked (exit 2 / 3), the item measured (one stream, or over
    a stage program's layout: `repro_program`), the verdict and the environment it was measured
    in. The options are `prepare`'s, typed: Constructions, TransplantSpecs, dtype names (the
    command line parses its comma lists once, kvfid.commands.options.repro_arguments)."""
    if program:
        return repro_program(program, **options)
    checked = prepare(**options)
    record = measure(checked)
    environment = envinfo.collect()
    return ReproOutcome(record, checked.model.codec, environment,
                        envinfo.environment_key(environment))
