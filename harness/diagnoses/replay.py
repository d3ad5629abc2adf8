"""Replay of supplied trajectories: per-token logprob mismatch of a re-scoring against generation.

A **supplied trajectory** is token ids given by the user (a prompt and a recorded continuation,
e.g. an RL rollout sampled by an inference engine) instead of a live greedy run. Its reference is
what a generator computes: the prompt in one call, then one token at a time over the cache, each
step's next-token logits at one position (`incremental`, the construction the bridge shows equal
to live). Each other construction re-scores the whole trajectory the way a trainer does:
`prefill` (one forward over prompt + continuation, logits at every position), `chunked:N` (the
same through the cache in chunks of N), `batched:N` (the prefill with N identical rows), or an
engine does: `cached:K` (a prefix-cache hit) and `spec:k` (speculative verification), as
kvfid.diagnoses.rescore says.

Per trajectory and construction: the fraction of continuation tokens whose log-probability bits
differ from the reference, max and mean |delta logprob|, the per-token KL(reference || other)
between the two next-token distributions (computed in fp64), and the first differing position.
Log-probabilities are taken in fp32 from the model's logits, as a trainer takes them.

With the engine's own logprobs in the file (`logprobs`, one per continuation token, e.g. what
vLLM sampled with), the engine is a reference too: kvfid.diagnoses.replay_gaps reports the
three gaps (engine vs step-by-step, step-by-step vs each construction, engine vs each
construction) in kvfid's figures and under RL frameworks' names.

Each construction's numbers are a `LogprobMismatch` (kvfid.records.replay_record);
`replay_trajectory` is the one path that computes them, for `kvfid replay` (`replay`) and for a
replay case's matrix unit (`replay_unit`, a `ReplayRecord` the ledger stores).

`sample_trajectories()` makes such files: temperature sampling, seeded, from any model preset.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from kvfid.states.cache import bits, sha_tensor
from kvfid.protocol.decode import Runner, as_batch, new_cache
from kvfid.errors import BadInput
from kvfid.records.plain import as_plain
from kvfid.protocol.protocol import parse_construction
from kvfid.records.record import ItemRef
from kvfid.diagnoses.rescore import (ALLOWED, CONSTRUCTIONS, check_constructions,  # noqa: F401
                                  reference_logits, rescored_logits)
from kvfid.diagnoses.replay_gaps import (DECADES, STEP, _quantile, aggregate_gaps,  # noqa: F401
                                      delta_decades, engine_logprobs, gap, render_gaps)
from kvfid.records.replay_record import LogprobMismatch, ReplayRecord
from kvfid.stacks.stack import Stack
from kvfid.inputs.trajectories import (Trajectory, as_row, check_fits,  # noqa: F401
                                       load_trajectories, trajectories_from_rows)

from kvfid.diagnoses.subject import check_model_name, check_subject
from kvfid.engines.check import engine_rollouts
from kvfid.engines.server import server_rollouts
from kvfid.inputs import items
from kvfid.inputs.models import load_model
from kvfid.outputs import write_files
from kvfid.protocol.constructions import check_rollback, split_arms
from kvfid.stacks.ranks import on_ranks



# --------------------------------------------------------------------------- scoring

def mismatch(reference: torch.Tensor, other: torch.Tensor, tokens,
             acceptance: tuple[int, ...] | None = None) -> LogprobMismatch:
    """Per-token logprob mismatch of `other` against `reference` (both [T, V] logits); a
    `spec:k` re-scoring's acceptance pattern is kept with it."""
    index = torch.tensor(list(tokens))
    picked_ref, picked = picked_logprobs(reference, index), picked_logprobs(other, index)
    differs = bits(picked_ref) != bits(picked)
    delta = (picked.double() - picked_ref.double()).abs()
    ref64, other64 = torch.log_softmax(reference.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (ref64.exp() * (ref64 - other64)).sum(-1).clamp_min(0.0)  # KL(reference || other)
    n = int(differs.sum())
    picked_gap = gap(picked_ref, picked)    # the K3 and importance-ratio figures, side by side
    return LogprobMismatch(
        tokens=len(index), differ=n, fraction=n / len(index), max_abs=float(delta.max()),
        mean_abs=float(delta.mean()), kl_mean=float(kl.mean()), kl_max=float(kl.max()),
        first_position=int(differs.nonzero()[0, 0]) if n else None,
        abs_deltas=tuple(float(d) for d in delta), logprobs_sha=sha_tensor(picked),
        k3_mean=picked_gap.k3_mean, ratio_min=picked_gap.ratio_min,
        ratio_mean=picked_gap.ratio_mean, ratio_max=picked_gap.ratio_max, acceptance=acceptance)


def picked_logprobs(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The fp32 logprob of each continuation token, as a trainer takes it."""
    return torch.log_softmax(logits.float(), -1)[range(len(index)), index]


def replay_trajectory(runner: Runner, t: Trajectory, constructions) -> tuple[str, dict, dict]:
    """One trajectory's reference (the SHA-256 of its picked logprobs' bits), each
    construction's LogprobMismatch against it and, when the trajectory carries the engine's
    logprobs, the engine's PickedGap against step-by-step (`STEP`) and against each construction:
    the one path of `kvfid replay` and the matrix."""
    index = torch.tensor(list(t.tokens))
    reference = reference_logits(runner, t)
    picked = picked_logprobs(reference, index)
    found, engine = {}, {}
    sampler = None if t.logprobs is None else engine_logprobs(t.logprobs)
    if sampler is not None:
        engine[STEP] = gap(sampler, picked)
    for c in constructions:
        other, acceptance = rescored_logits(runner, t, c)
        found[c] = mismatch(reference, other, t.tokens, acceptance)
        if sampler is not None:
            engine[c] = gap(sampler, picked_logprobs(other, index))
    return sha_tensor(picked), found, engine


def replay_unit(model, stack, t: Trajectory, constructions) -> ReplayRecord:
    """A matrix unit: one trajectory on one stack (what `kvfid run` stores for a replay case)."""
    start = time.perf_counter()
    with stack.activate(model) as module:
        ref_sha, found, engine = replay_trajectory(Runner(module), t, constructions)
    return ReplayRecord(ItemRef(t.id), model.name, stack.describe(), len(t.prompt_ids),
                        len(t.tokens), reference_sha=ref_sha, constructions=found,
                        wall_s=time.perf_counter() - start, engine=engine.pop(STEP, None),
                        engine_constructions=engine)


def _replay_ranked(model_name: str, stack, trajectories, constructions) -> dict:
    """One rank's part of a TP replay: the model loaded here, every trajectory re-scored by all."""
    return replay(load_model(model_name), stack, trajectories, constructions)


def replay(model, stack, trajectories: list[Trajectory], constructions=("prefill",), progress=None) -> dict:
    """Every trajectory re-scored by every construction on `stack`, against the generator's
    step-by-step reference. Returns a JSON-ready dict: per item, and aggregated per construction."""
    check_fits(trajectories, model.config.vocab_size, model.context_length)
    check_constructions(constructions, trajectories)
    items = []
    with stack.activate(model) as module:
        runner = Runner(module)
        for t in trajectories:
            if progress:
                progress(t.id)
            _, found, engine = replay_trajectory(runner, t, constructions)
            items.append({"id": t.id, "prompt_tokens": len(t.prompt_ids),
                          "constructions": {c: as_plain(m) for c, m in found.items()},
                          **({"engine": as_plain(engine)} if engine else {})})
    result = {"stack": stack.label, "model": model.name, "items": items,
              "aggregate": {c: aggregate([i["constructions"][c] for i in items]) for c in constructions}}
    if all("engine" in i for i in items):   # a file has logprobs on every line or on none
        result["engine_aggregate"] = {name: aggregate_gaps([i["engine"][name] for i in items])
                                      for name in (STEP, *constructions)}
    return result


def aggregate(rows: list[dict]) -> dict:
    """Over items: tokens, tokens whose bits differ, max and mean |delta|, mean KL, items exact."""
    deltas = [d for r in rows for d in r["abs_deltas"]]
    tokens = sum(r["tokens"] for r in rows)
    differ = sum(r["differ"] for r in rows)
    firsts = [r["first_position"] for r in rows if r["first_position"] is not None]
    out = {"items": len(rows), "items_exact": sum(r["differ"] == 0 for r in rows),
           "tokens": tokens, "differ": differ, "fraction": differ / tokens if tokens else 0.0,
           "max_abs": max(deltas, default=0.0), "mean_abs": statistics.fmean(deltas) if deltas else 0.0,
           "p99_abs": _quantile(deltas, 0.99), "kl_mean": statistics.fmean(r["kl_mean"] for r in rows),
           "first_position_median": statistics.median(firsts) if firsts else None,
           "abs_delta_decades": delta_decades(deltas)}
    if rows and all(r.get("k3_mean") is not None for r in rows):   # older records lack them
        gaps = aggregate_gaps(rows)
        out.update({k: gaps[k] for k in ("k3_mean", "ratio_min", "ratio_mean", "ratio_max")})
    return out




def render(result: dict) -> str:
    """Per item and aggregated, one line each; says so when the stack is exactly zero."""
    lines = [f"kvfid replay  model {result['model']}  stack {result['stack']}  "
             f"(reference: step-by-step generation)"]
    for item in result["items"]:
        for c, m in item["constructions"].items():
            first = "-" if m["first_position"] is None else m["first_position"]
            lines.append(f"  {item['id']:<14} {c:<11} {m['differ']:>4}/{m['tokens']:<4} tokens differ  "
                         f"max |dlogp| {m['max_abs']:.3g}  mean {m['mean_abs']:.3g}  "
                         f"KL {m['kl_mean']:.3g}  first at {first}")
    for c, a in result["aggregate"].items():
        verdict = ("exactly zero: every logprob bit-identical to generation" if a["differ"] == 0 else
                   f"{a['differ']}/{a['tokens']} tokens ({a['fraction']:.1%}) differ")
        lines.append(f"{c}: {verdict}; max |dlogp| {a['max_abs']:.3g}, mean {a['mean_abs']:.3g}, "
                     f"p99 {a['p99_abs']:.3g}, mean KL {a['kl_mean']:.3g}, items exact "
                     f"{a['items_exact']}/{a['items']}")
        shown = [f"{label}: {n}" for label, n in a["abs_delta_decades"] if n]
        lines.append(f"  |dlogp| by decade ({c}): " + ", ".join(shown))
    return "\n".join(lines + render_gaps(result))


def replay_command(trajectories: str, model_name: str, stack: Stack, constructions: str,
                   progress=None) -> dict:
    """`kvfid replay`: the options and the file checked before compute (exit 2 / 3), then `replay`
    (on ranks spawned here at a TP size above 1)."""
    model, stack, loaded, chosen = checked_replay(trajectories, model_name, stack, constructions)
    try:
        if stack.tp > 1:
            return on_ranks(stack.tp, _replay_ranked, model_name, stack, loaded, chosen,
                            device=stack.device)
        return replay(model, stack, loaded, chosen, progress)
    except ValueError as err:
        raise BadInput(str(err)) from None


def checked_replay(trajectories, model_name, stack: Stack, constructions: str):
    """(model, stack, trajectories, constructions) of a replay, each checked before compute
    (BadInput, exit 2; Unavailable, exit 3). `trajectories`: a JSONL path or rows in memory;
    `model_name`: a preset, `hf:<folder>` or a Model already loaded (the Python API's; at TP
    size 1 only: each rank loads the model by its name)."""
    chosen = split_arms(constructions)
    if any("@" in c for c in chosen):
        raise BadInput(f"--constructions {constructions}: a replay re-scores at the stack's TP "
                       f"size (--tp), not per construction")
    for c in chosen:
        try:
            kind = parse_construction(c).kind
        except ValueError as err:
            raise BadInput(f"--constructions: {err}") from None
        if kind not in CONSTRUCTIONS:
            raise BadInput(f"--constructions = {c!r} is not allowed; allowed: {ALLOWED}")
    subject = check_subject(model_name, stack, with_item=False, world=stack.tp)
    model = subject.model
    check_rollback(model, chosen)   # a cut a recurrent state cannot take (exit 3)
    try:
        rows = (load_trajectories(trajectories, model.codec) if isinstance(trajectories, (str, Path))
                else trajectories_from_rows(trajectories, model.codec))
        subject.check_serves(max((len(t.prompt_ids) + len(t.tokens) for t in rows), default=0))
        check_fits(rows, model.config.vocab_size, model.context_length)
        check_constructions(chosen, rows)
    except ValueError as err:
        raise BadInput(str(err)) from None
    return model, stack, rows, chosen


def rollouts_command(model_name: str, item_set: str, count: int, tokens: int, temperature: float,
                     seed: int, out: str, engine: str | None = None, server: str | None = None,
                     dtype: str = "bf16", faithful: bool = False, tp: int = 1,
                     threads: int | None = None, kv_cache_dtype: str = "auto") -> tuple[list[dict], str]:
    """`kvfid rollouts`: sample on sdpa/fp32 (one thread), with a serving engine (`engine`, a
    name in kvfid.engines.registry, at `dtype`; `faithful`: its faithful mode) or from an
    OpenAI-compatible server, and write the JSONL atomically."""
    check_model_name(model_name)
    engine_only = [name for name, given in (("--faithful", faithful), (f"--tp {tp}", tp != 1),
                                            (f"--threads {threads}", threads is not None),
                                            (f"--kv-cache-dtype {kv_cache_dtype}", kv_cache_dtype != "auto"))
                   if given]
    if engine_only and (engine is None or server is not None):
        raise BadInput(f"{engine_only[0]} is for a serving engine (--engine NAME), which runs "
                       "the model itself")
    if server is not None and engine is not None:
        raise BadInput("--server and --engine: one sampler, a server or an engine")
    if server is not None:
        rows = server_rollouts(server, model_name, item_set, count, tokens, temperature, seed)
    elif engine is not None:
        rows = engine_rollouts(engine, model_name, item_set, count, tokens, temperature, seed, dtype,
                               faithful, tp, threads, kv_cache_dtype)
    else:
        try:
            chosen = items.load_item_set(item_set, count)
        except ValueError as err:
            raise BadInput(f"--item-set {item_set}: {err}") from None
        model = load_model(model_name)
        prompts = [(i.id, model.codec.prompt_ids(i.prompt)) for i in chosen]
        rows = sample_trajectories(model, Stack("sdpa", "fp32", threads=1), prompts, tokens,
                                   temperature, seed)
    write_files({"rollouts": (Path(out), "".join(json.dumps(r) + "\n" for r in rows))})
    return rows, out


# --------------------------------------------------------------------------- sampling

def sample_trajectories(model, stack, prompts: list[tuple[str, list[int]]], tokens: int,
                        temperature: float, seed: int) -> list[dict]:
    """Sample a continuation of `tokens` ids per (id, prompt ids) with temperature (seeded, one
    generator per trajectory), stopping after an end-of-turn token. JSONL-ready rows, each with
    the sampler's fp32 logprob of every token under the model's own distribution (before the
    temperature: what vLLM reports by default, its `raw_logprobs`)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    rows = []
    with stack.activate(model) as module:
        runner = Runner(module)
        for index, (item_id, prompt) in enumerate(prompts):
            generator = torch.Generator().manual_seed(seed * 100003 + index)
            out, logprobs = [], []
            logits, cached = runner.forward(as_batch(prompt), new_cache(module))
            logits = logits[0]
            while len(out) < tokens:
                probs = torch.softmax(logits.double() / temperature, -1).cpu()
                token = int(torch.multinomial(probs, 1, generator=generator))
                out.append(token)
                # The model's logprob of the token (temperature 1), as an engine reports it.
                logprobs.append(float(picked_logprobs(logits[None], torch.tensor([token]))[0]))
                if token in model.codec.eos_ids or len(out) == tokens:
                    break
                logits, cached = runner.forward(as_batch([token]), cached)
                logits = logits[0]
            rows.append(as_row(Trajectory(item_id, tuple(prompt), tuple(out), tuple(logprobs)),
                               model=model.name, stack=stack.label, temperature=temperature,
                               seed=seed))
    return rows
