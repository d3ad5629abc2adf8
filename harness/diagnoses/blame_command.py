"""`kvfid blame` as a command: P generated live on a stack, the first differing position found and
its computation blamed (kvfid.diagnoses.blame), also across TP sizes (each side's units read
whole, kvfid.tracing.tp_units; the ranks spawned here); the text it prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfid.diagnoses.blame import (BlameResult, blame, first_differing_position, render,
                                   whole_forward_difference)
from kvfid.diagnoses.subject import check_subject, plan_world
from kvfid.errors import BadInput
from kvfid.protocol.protocol import parse_construction, run_live
from kvfid.stacks.stack import Stack
from kvfid.inputs.models import load_model
from kvfid.stacks.compiled import trace_units
from kvfid.stacks.ranks import on_ranks
from kvfid.tracing import tp_units

def blame_item(model, stack, prompt: list[int], boundary: int, against: str = "prefill",
               position: int | None = None) -> tuple[BlameResult, int | None]:
    """Generate P live (the prompt and `boundary` greedy tokens) on `stack`, find the first
    position whose cache differs between the two constructions, and `blame()` its computation
    (or `position` when given). Returns the result and the first differing position (None when
    the two constructions are bit-exact over all of P)."""
    with stack.activate(model) as module:
        live = run_live(module, prompt, boundary, 0, model.codec.eos_ids)
        if live.state is None:
            raise BadInput(f"-B = {boundary}: the live run met the end-of-turn token after "
                           f"{len(live.generated.tokens)} tokens; lower -B")
        prefix = list(live.state.prefix)
        at = parse_construction(against).at
        if stack.tp > 1 or at:   # a side sharded: units read whole (kvfid.tracing.tp_units)
            return _blame_parallel(module, stack, prefix, len(prompt), against, position, at)
        first = first_differing_position(module, prefix, len(prompt), against)
        chosen = position if position is not None else first
        if stack.compiled:
            result = blame(module, prefix, len(prompt), against, chosen, trace_units)
            if first is not None and not result.culprits:   # invariant alone, not compiled whole
                result.whole_forward = whole_forward_difference(module, prefix, len(prompt), against)
            return result, first
        return blame(module, prefix, len(prompt), against, chosen), first


def _blame_parallel(module, stack, prefix: list[int], prompt_length: int, against: str,
                    position: int | None, at: str | None) -> tuple[BlameResult, int | None]:
    """Blame with a side at TP>1: side b built in `stack.arm(module, at)`, each side traced by
    TP units; each ParallelLinear's op is named as side a ran it, with both sides' products."""
    side_b = lambda: stack.arm(module, at)   # noqa: E731
    first = first_differing_position(module, prefix, prompt_length, against, side_b)
    notes: list[dict] = []

    def tracer(unit_module, run, on_op):
        notes.append({})
        tp_units.trace(unit_module, run, on_op, notes[-1])

    result = blame(module, prefix, prompt_length, against,
                   position if position is not None else first, tracer, side_b)
    result.a += f" at TP={stack.tp}"
    result.b += "" if at else f" at TP={stack.tp}"
    culprits = [op.module for op in result.ops if op.kind == "culprit" and op.op != "unit"]
    # A unit holding a culprit projection (the attention around its o_proj) repeats that finding.
    result.ops = [op for op in result.ops if not (op.op == "unit" and any(
        c.startswith(op.module + ".") for c in culprits))]
    for index, op in enumerate(result.ops):
        op.index = index
    for op in result.ops:
        if op.module in notes[0]:
            (name, how_a), how_b = notes[0][op.module], notes[1].get(op.module, ("", "?"))[1]
            op.op = f"{name} (a: {how_a}; b: {how_b})"
    return result, first


@dataclass
class BlameOutcome:
    """What `kvfid blame` prints."""

    stack: str
    result: BlameResult
    first_differing_position: int | None

    def to_json(self) -> dict:
        return {"stack": self.stack, "first_differing_position": self.first_differing_position,
                **self.result.to_json()}

    def text(self) -> str:
        where = ("the caches are bit-exact over all of P" if self.first_differing_position is None
                 else f"first differing cache position: {self.first_differing_position}")
        return render(self.result, self.stack) + "\n" + where


def blame_command(model_name: str, stack: Stack, prompt: str | None, item_set: str | None,
                  item_index: int | None, boundary: int, against: str,
                  position: int | None) -> BlameOutcome:
    """`kvfid blame`: every option checked before compute (exit 2 / 3), then `blame_item`."""
    try:
        parse_construction(against)
    except ValueError as err:
        raise BadInput(f"--against: {err}") from None
    subject = check_subject(model_name, stack, prompt, item_set, item_index,
                            world=plan_world(stack, [against], "--against"))
    model, prompt_ids, world = subject.model, list(subject.prompt_ids), subject.world
    if len(prompt_ids) + boundary > model.context_length:
        raise BadInput(f"-B = {boundary}: the prompt ({len(prompt_ids)} tokens) and B exceed the "
                       f"context of {model.context_length}")
    subject.check_serves(len(prompt_ids) + boundary)
    if position is not None and not 0 <= position < len(prompt_ids) + boundary:
        raise BadInput(f"--position = {position} is not allowed; P has positions 0 to "
                       f"{len(prompt_ids) + boundary - 1}")
    try:
        if world > 1:
            result, first = on_ranks(world, _blame_ranked, model_name, stack, prompt_ids,
                                              boundary, against, position, device=stack.device)
        else:
            result, first = blame_item(model, stack, prompt_ids, boundary, against, position)
    except ValueError as err:
        raise BadInput(str(err)) from None
    return BlameOutcome(stack.label, result, first)


def _blame_ranked(model_name: str, stack, prompt_ids: list[int], boundary: int, against: str,
                  position: int | None):
    """One rank's part of a TP blame: the model loaded here, `blame_item` run by every rank."""
    return blame_item(load_model(model_name), stack, prompt_ids, boundary, against, position)
