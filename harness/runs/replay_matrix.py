"""A replay case bound to its model: the trajectories loaded and checked before any compute.

Its units are (stack, trajectory): `Matrix.measure` re-scores one trajectory on one stack with
kvfid.diagnoses.replay (the code `kvfid replay` runs), into a ReplayRecord the ledger stores.
"""

from __future__ import annotations

from kvfid.stacks.stack import check_supports
from kvfid.protocol.constructions import check_rollback
from kvfid.diagnoses.replay import check_fits, load_trajectories
from kvfid.diagnoses.rescore import check_constructions
from kvfid.runs.case_fields import CaseError


def bind(case, model) -> list:
    """The case's first `items.n` trajectories, each fitting the model's vocabulary and context
    (CaseError, exit 2, naming the file and line otherwise), on stacks that can serve them."""
    path = case.replay.trajectories
    try:
        trajectories = load_trajectories(path, model.codec)
        check_fits(trajectories, model.config.vocab_size, model.context_length)
    except ValueError as err:
        raise CaseError(f"{case.source}: [replay] trajectories = {path!r}: {err}") from None
    if len(trajectories) < case.items.n:
        raise CaseError(f"{case.source}: [replay] trajectories = {path!r} has "
                        f"{len(trajectories)} trajectories, fewer than the {case.items.n} asked for")
    trajectories = trajectories[:case.items.n]
    ids = [t.id for t in trajectories]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate is not None:
        raise CaseError(f"{case.source}: [replay] trajectories = {path!r}: id {duplicate!r} "
                        f"appears twice; ids name the units")
    try:
        check_constructions(case.replay.constructions, trajectories)   # cached:K within prompts
    except ValueError as err:
        raise CaseError(f"{case.source}: [replay] constructions: {err}") from None
    check_rollback(model, case.replay.constructions)   # a cut a recurrent state cannot take (exit 3)
    longest = max(len(t.prompt_ids) + len(t.tokens) for t in trajectories)
    for stack in case.stacks:                   # a model the stack cannot serve (exit 3)
        check_supports(stack, model, longest)
    return trajectories
