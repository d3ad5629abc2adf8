"""A program case bound to its model (kvfid.runs.case_program): every item's program checked
before any compute, and one unit measured as the stage program protocol measures it.

Its units are (stack, item): `Matrix.measure` runs the item's stage program on one stack in each
of the case's layouts with kvfid.stages.program (the code `kvfid repro --program` runs), into
one ProgramRecord the ledger stores.
"""

from __future__ import annotations

from kvfid.stages import checks as stages_checks
from kvfid.stages import program as stages
from kvfid.stages import transplant as stages_transplant
from kvfid.stacks.stack import check_supports
from kvfid.protocol.constructions import ProtocolError
from kvfid.inputs.items import load_item_set
from kvfid.records.program import ProgramRecord
from kvfid.records.record import ItemRef
from kvfid.stacks.serving import describe_layers
from kvfid.stages.batched import check_batched
from kvfid.runs.case_fields import CaseError


def _said(err: ProtocolError) -> str:
    return str(err).replace("--program ", "[program] ")


def bind(case, model) -> list:
    """The case's items, each one's program fitting the model's context (CaseError, exit 2,
    naming the file and item), on stacks and layers that can serve a stage program (exit 3 /
    exit 2)."""
    try:
        items = load_item_set(case.items.set, case.items.n, case.items.seed)
    except (OSError, ValueError) as err:
        raise CaseError(f"{case.source}: [items] set = {case.items.set!r}: {err}") from None
    longest = 0
    try:
        stages_checks.check_layers(describe_layers(model))
    except ProtocolError as err:
        raise CaseError(f"{case.source}: {_said(err)}") from None
    for program in case.program.programs:
        openers = stages.delimiters(model.codec, program)
        lengths = [len(o) for o in openers]
        for item in items:
            prompt = len(model.codec.prompt_ids(item.prompt))
            try:
                if program.layout == "batched":
                    check_batched(program, openers)
                stages_checks.check_program_fits(prompt, program, lengths, case.S,
                                                 model.context_length)
            except ProtocolError as err:
                raise CaseError(f"{case.source}: item {item.id}: {_said(err)}") from None
            longest = max(longest, stages_checks.program_length(prompt, program, lengths) + case.S)
    for stack in case.stacks:                   # a model the stack cannot serve (exit 3)
        check_supports(stack, model, longest)
    return items


def measure(model, stack, item, case, index: int) -> ProgramRecord:
    """One item's stage program on one stack, in each layout: the arms, the replicas, the
    transplants."""
    replicas = case.replicas.arms if case.replicas.applies(index) else ()
    prompt = len(model.codec.prompt_ids(item.prompt))
    runs = []
    for program in case.program.programs:
        openers = [len(o) for o in stages.delimiters(model.codec, program)]
        ranges = stages_transplant.segment_ranges(prompt, program, openers)
        moves = tuple(stages_transplant.parse(t, ranges, case.constructions)
                      for t in case.program.transplants)
        runs.append(stages.run_program(model, stack, item.prompt, program, case.S,
                                       case.constructions, case.ignore_eos, replicas, moves,
                                       case.program.transplants))
    return ProgramRecord(ItemRef(item.id, item.prompt, item.answer), model.name,
                         stack.describe(), ignore_eos=case.ignore_eos, runs=tuple(runs))
