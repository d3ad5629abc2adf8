"""The precision crossing at a stage program's merge boundary (kvfid.stages.program): the
program's integers frozen from one stack's live run (tokens, segments, positions, so the same
mask), then in each crossed stack both `incremental` and `prefill` rebuilt over them and their
suffixes compared with the reference live suffix. Every cell starts from the same integers, so a
difference between cells is the precision's or the construction's, never another history."""

from __future__ import annotations

from kvfid.states import cache as kv
from kvfid.stages.program import Layout, decode_suffix, rebuild

CONSTRUCTIONS = ("incremental", "prefill")


def frozen_layout(program, record: dict) -> Layout:
    """The live layout a `run_program` record stored."""
    frozen = record["layout"]
    return Layout(Layout.start(program).sees, program.positions, list(frozen["tokens"]),
                  list(frozen["segments"]), list(frozen["positions"]))


def run_crossing(model, program, record: dict, stacks, S: int, eos_ids) -> dict:
    """Per crossed stack: both constructions' suffixes against the reference live suffix, and
    whether the two constructions' caches have the same bits."""
    layout, reference = frozen_layout(program, record), record["arms"]["live"]["suffix"]
    cells, within = [], []
    for stack in stacks:
        built = {}
        with stack.activate(model) as module:
            for label in CONSTRUCTIONS:
                state, runner = rebuild(module, layout, label, record["prompt_length"])
                built[label] = (state, decode_suffix(runner, layout, state, S, eos_ids))
        (a, _), (b, _) = built.values()
        within.append({"stack": stack.label, "bit_exact": kv.compare_states(a, b).bit_exact})
        cells += [{"stack": stack.label, "arm": label, "cache_sha": kv.sha_cache(state),
                   "suffix": list(suffix.tokens),
                   "suffix_equals_reference": list(suffix.tokens) == list(reference)}
                  for label, (state, suffix) in built.items()]
    return {"reference": record["stack"]["label"], "cells": cells, "within": within}
