"""kvfid as a library: what a trainer, a replay tool or a notebook calls, typed end to end.

The command line is a client of the same library paths: `repro` measures through
`kvfid.diagnoses.repro` as `kvfid repro` does, `replay` through the replay path of `kvfid replay`,
so a verdict here is the verdict the CLI prints for the same model, item and stack. The public
names are importable from `kvfid` itself (`kvfid.__all__`; docs/api.md lists each with its
purpose, and a test fails when one disappears without a re-export).

    import kvfid
    outcome = kvfid.repro("tiny-llama", "What is 2+2?", stack="native/fp32+bi@t1", boundary=8)
    outcome.verdict                       # "bit-exact" or "diverges"
    with kvfid.batch_invariant_mode():    # batch-invariant matmul, norms and softmax
        ...
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from kvfid.diagnoses.replay import checked_replay, replay_unit
from kvfid.errors import BadInput
from kvfid.diagnoses.repro import ReproOutcome
from kvfid.diagnoses.repro import repro as _repro
from kvfid.inputs.models import Model, from_module
from kvfid.inputs.models import load_model as _load_preset
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.recurrence import faithful_recurrence
from kvfid.protocol.constructions import (Construction, TransplantSpec, parse_construction,
                                          parse_transplant)
from kvfid.protocol.decode import cache_keyword
from kvfid.records.record import CacheDiff
from kvfid.records.replay_record import LogprobMismatch, PickedGap, ReplayRecord
from kvfid.stacks.stack import Stack, parse_stack
from kvfid.states.cache import BoundaryState, compare_states as _compare
from kvfid.states.layers import read_cache

def batch_invariant_mode(enabled: bool = True, *, impl: str | None = None) -> set_batch_invariant_mode:
    """`with kvfid.batch_invariant_mode(): ...`: batch-invariant matmul, norms and softmax inside
    the block, everything restored on exit. `impl`: Triton kernels where CUDA is (`triton`), else
    the stock kernels on fixed tiles of rows, each shape probed first (`tiled`), as a stack picks;
    `rowwise` or `triton` (the interpreter, slow on a CPU) by name."""
    return set_batch_invariant_mode(
        enabled, impl=impl or ("triton" if torch.cuda.is_available() else "tiled"))

def stack_of(stack: Stack | str) -> Stack:
    """A Stack, or the one a report's label names (`native/bf16+bi@t1`)."""
    return stack if isinstance(stack, Stack) else parse_stack(stack)


def load_model(model, tokenizer=None) -> Model:
    """A Model from a preset name (`tiny-llama`, `smollm2-135m`, ...), `hf:<folder>`, or a
    transformers causal LM held in memory (with its tokenizer, for chat prompts)."""
    if isinstance(model, Model):
        return model
    if isinstance(model, str):
        return _load_preset(model)
    return from_module(model, tokenizer)


def repro(model, prompt: str, *, stack: Stack | str = "sdpa/bf16",
          constructions: Sequence[Construction | str] = ("live", "prefill", "incremental"),
          boundary: int = 32, suffix: int = 48, replicas: Sequence[Construction | str] = (),
          transplants: Sequence[TransplantSpec | str] = (), cross: Sequence[str] = (),
          ignore_eos: bool = False,
          arms: Sequence[Construction | str] | None = None) -> ReproOutcome:
    """One prompt on one stack, as `kvfid repro` measures it: every construction built as an arm
    and compared with live (cache, boundary logits, suffix), replicas, transplants
    (`live<-prefill:keys`), the precision crossing over `cross` dtypes. Constructions and
    transplants are given as `kvfid.Construction` / `TransplantSpec` values or their labels (each
    label parsed here, once). Returns the typed record, its verdict and environment. `arms` is
    `constructions`' earlier name (given both, refused)."""
    if arms is not None:
        if constructions != ("live", "prefill", "incremental"):
            raise TypeError("repro() takes constructions= or its earlier name arms=, not both")
        constructions = arms
    for name, given in (("constructions", constructions), ("replicas", replicas),
                        ("transplants", transplants), ("cross", cross)):
        if isinstance(given, str):
            raise TypeError(f"repro() takes {name}= as a sequence, not the string {given!r}")
    return _repro(model_name=model if isinstance(model, str) else load_model(model),
                  stack=stack_of(stack), prompt=prompt, item_set=None, item_index=None,
                  boundary=boundary, suffix=suffix,
                  constructions=tuple(map(parse_construction, constructions)),
                  replicas=tuple(map(parse_construction, replicas)),
                  transplants=tuple(t if isinstance(t, TransplantSpec) else parse_transplant(t)
                                    for t in transplants),
                  cross=tuple(cross), ignore_eos=ignore_eos)


def read_state(cache, config=None, prefix: Iterable[int] = (), logits=None) -> BoundaryState:
    """A transformers cache's state, every layer and part cloned (`config`: the model's, which
    tells an MLA layer's latent from K/V). The clones are ordinary tensors, also when read inside
    a stack's context (which runs under inference mode): a caller may change them."""
    with torch.inference_mode(False):
        return BoundaryState(tuple(prefix), logits=logits, layers=read_cache(cache, config))


def compare_states(a, b, *, config=None) -> CacheDiff:
    """Two states over the same tokens, bit for bit, per layer and part (`a` the reference):
    transformers caches or BoundaryStates. Not bit-exact also when a part cannot be compared."""
    states = [s if isinstance(s, BoundaryState) else read_state(s, config) for s in (a, b)]
    return _compare(*states)


@dataclass(frozen=True)
class ReplayResult:
    """Supplied trajectories re-scored on one stack: per trajectory a ReplayRecord (each
    construction's LogprobMismatch against step-by-step generation and, where the trajectories
    carry the engine's logprobs, the engine's gaps)."""

    stack: str
    model: str
    trajectories: tuple[ReplayRecord, ...]

    def mismatch(self, construction: str) -> tuple[LogprobMismatch, ...]:
        """step-by-step against `construction`, per trajectory (what rebuilding the state does)."""
        return tuple(r.constructions[construction] for r in self.trajectories)

    def engine_gaps(self, construction: str | None = None) -> tuple[PickedGap, ...]:
        """The engine against `construction` per trajectory (what a trainer sees), or against
        step-by-step generation (None); empty without engine logprobs."""
        if construction is None:
            return tuple(r.engine for r in self.trajectories if r.engine is not None)
        return tuple(r.engine_constructions[construction] for r in self.trajectories
                     if construction in r.engine_constructions)

    def metrics(self, construction: str) -> dict[str, float]:
        """The engine-vs-trainer gap under the names RL frameworks log it (TRL's
        `sampling/...`, slime's, verl's `rollout_corr/k3_kl`), token-weighted over the
        trajectories; empty without engine logprobs."""
        gaps = self.engine_gaps(construction)
        deltas = [d for g in gaps for d in g.abs_deltas]
        if not deltas:
            return {}
        tokens = sum(g.tokens for g in gaps)
        ratio_mean = sum(g.ratio_mean * g.tokens for g in gaps) / tokens
        return {"sampling/sampling_logp_difference/mean": statistics.fmean(deltas),
                "sampling/sampling_logp_difference/max": max(deltas),
                "sampling/importance_sampling_ratio/min": min(g.ratio_min for g in gaps),
                "sampling/importance_sampling_ratio/mean": ratio_mean,
                "sampling/importance_sampling_ratio/max": max(g.ratio_max for g in gaps),
                "train_rollout_logprob_abs_diff": statistics.fmean(deltas),
                "rollout_corr/k3_kl": sum(g.k3_mean * g.tokens for g in gaps) / tokens,
                "kvfid/tokens_differ_fraction": sum(g.differ for g in gaps) / tokens}


def replay(trajectories, model, *, stack: Stack | str = "sdpa/bf16",
           constructions: Sequence[str] = ("prefill",)) -> ReplayResult:
    """Re-score supplied trajectories (a JSONL path, or rows: dicts with `prompt_ids` or
    `prompt`, `tokens`, optional `logprobs`) the way a trainer does, against step-by-step
    generation on the same stack, as `kvfid replay` does."""
    chosen = stack_of(stack)
    if chosen.tp > 1:
        raise BadInput(f"kvfid.replay runs in this process, at TP size 1; `kvfid replay --tp "
                       f"{chosen.tp}` spawns the ranks")
    source = str(trajectories) if isinstance(trajectories, Path) else trajectories
    model, chosen, rows, names = checked_replay(
        source, model if isinstance(model, str) else load_model(model), chosen,
        ",".join(constructions))
    records = tuple(replay_unit(model, chosen, t, names) for t in rows)
    return ReplayResult(chosen.label, model.name, records)
