"""`kvfid engine-check`: what an engine's own constructions do to the same tokens, bitwise.

Greedy continuations are generated once per prompt (alone), then the same tokens' logprobs are
taken again by each of the engine's constructions and compared bit for bit (fp32, as engines
return them). Every engine runs the first three; the others where it offers them
(kvfid.engines.seam: `offers`), named in its own words:

- `decode vs prefill re-scoring`: the decode's sampling logprobs against a prefill of prompt +
  continuation (what a trainer re-scoring with the engine sees);
- `alone vs batched` (decode and prefill): one request per call against every prompt in one call
  (other requests, other lengths, in the same forward passes);
- `chunked prefill off vs on` (CHUNKED): the re-scoring with the whole sequence in one step
  against a step budget that splits it into chunks;
- `prefix cache cold vs warm` (PREFIX_CACHE): the re-scoring not reading the prefix cache
  against the same request again, reading what the first one left there (positions whose
  logits the cache served have no logprob and are not compared; the row says how many);
- with `tp` N > 1 (TP), `decode TP=1 vs TP=N` and `prefill re-scoring TP=1 vs TP=N`.

A row counts the continuation tokens compared, those whose bits differ, max |delta logprob| and
items exact; with `kv` (KV) each row also compares the engine states read from the paged cache.
Decoded tokens that diverge between two runs are compared up to the divergence. The engine is
named once, by the registry; nothing here knows which it is.
"""

from __future__ import annotations

import time
from dataclasses import replace

from kvfid.engines.bits import compare_kv, compare_logprobs
from kvfid.engines.registry import engine_for
from kvfid.engines.seam import CHUNKED, KV, PREFIX_CACHE, TP, EngineConfig, started
from kvfid.errors import BadInput
from kvfid.inputs.trajectories import Trajectory, as_row, items_and_codec
from kvfid.records.engine import EngineCheckRecord


def engine_check(model_name: str, dtype: str, count: int, tokens: int, chunk: int,
                 item_set: str = "arith", batch_invariant: bool = False, kv: bool = False,
                 faithful: bool = False, progress=None, threads: int | None = None,
                 tp: int = 1, block_size: int | None = 32, engine: str = "vllm",
                 attention: str | None = None, kv_cache_dtype: str = "auto") -> EngineCheckRecord:
    """The in-engine table for one model and dtype on `engine` (see the module docstring).
    `batch_invariant`: the engine's own switch; `kv`: each row also compares the engine states;
    `faithful`: the engine runs kvfid's batch-invariant attention and mode; `threads`: the
    engine's calls at that many torch threads (None: its own); `block_size`: the KV block in
    tokens (None: the engine's default); `attention`: the engine's attention implementation;
    `kv_cache_dtype`: the paged cache's stored format (fp8: `kv` compares its bytes and scales,
    then the values they stand for)."""

    chosen_engine = engine_for(engine)
    base = EngineConfig(model_name, dtype, faithful=faithful, batch_invariant=batch_invariant,
                        block_size=block_size, threads=threads, attention=attention,
                        kv_cache_dtype=kv_cache_dtype,
                        tp_invariant=tp > 1)   # a TP check's TP=1 side computes the TP-invariant products
    offers = chosen_engine.offers
    for wanted, option in ((tp > 1, TP), (kv, KV)):
        if wanted and option not in offers:
            raise BadInput(f"--engine {engine}: --{option} is not offered by this engine")
    chosen_engine.checked(base)
    if CHUNKED in offers:
        chosen_engine.checked(base.with_(chunk=chunk))      # refused before any engine starts
    note = chosen_engine.batch_invariant_note() if batch_invariant else None
    chosen, codec = items_and_codec(model_name, item_set, count)
    prompts = [codec.prompt_ids(i.prompt) for i in chosen]
    say = progress or (lambda _: None)
    start = time.perf_counter()
    base = base.with_(max_len=max(len(p) for p in prompts) + tokens + 1)
    name = chosen_engine.name_of
    with started(chosen_engine, base) as running:
        block, folder = running.block_size, getattr(running, "folder", "")
        say("decode, one request at a time")
        alone, kv_alone = _alone(_decode, running, prompts, tokens, kv)
        say("decode, every prompt in one batch")
        batched, kv_batched = _decode(running, prompts, tokens, kv)
        sequences = [p + g.ids for p, g in zip(prompts, alone)]
        starts = [len(p) for p in prompts]
        say("prefill re-scoring, alone and batched")
        pre_alone, kv_pre = _alone(_rescore, running, sequences, starts, kv)
        pre_batched, kv_pre_batched = _rescore(running, sequences, starts, kv)
    decoded = [g.logprobs for g in alone]
    scored = [r.logprobs for r in pre_alone]
    rows = [(compare_logprobs("decode vs prefill re-scoring", decoded, scored,
                              **_diverged(pre_alone)), (kv_alone, kv_pre, None))]
    rows.append(_decode_row("decode alone vs batched", prompts, alone, batched, (kv_alone, kv_batched)))
    rows.append((compare_logprobs("prefill alone vs batched", scored, [r.logprobs for r in pre_batched],
                                  **_diverged(pre_alone, pre_batched)), (kv_pre, kv_pre_batched, None)))
    if CHUNKED in offers:
        say(f"{name(CHUNKED)} by {chunk}")
        with started(chosen_engine, base.with_(chunk=chunk)) as running:
            chunked, kv_chunked = _alone(_rescore, running, sequences, starts, kv)
        rows.append((compare_logprobs(f"{name(CHUNKED)} off vs on ({chunk})", scored,
                                      [r.logprobs for r in chunked], **_diverged(pre_alone, chunked)),
                     (kv_pre, kv_chunked, None)))
    if PREFIX_CACHE in offers:
        say(f"{name(PREFIX_CACHE)}, cold then warm")
        with started(chosen_engine, base.with_(prefix_caching=True)) as running:
            cold, kv_cold = _alone(_rescore, running, sequences, starts, kv)
            warm, kv_warm = _alone(_rescore, running, sequences, starts, kv, True)
        rows.append((compare_logprobs(f"{name(PREFIX_CACHE)} cold vs warm", [r.logprobs for r in cold],
                                      [r.logprobs for r in warm], **_diverged(cold, warm),
                                      served_tokens=sum(r.served for r in warm)),
                     (kv_cold, kv_warm, None)))
    if tp > 1:
        say(f"TP={tp}: decode and prefill re-scoring, one request at a time")
        with started(chosen_engine, base.with_(tp=tp)) as running:
            sharded = measure_alone(running, prompts, tokens, kv, sequences)
        rows += tp_rows((alone, kv_alone, scored, kv_pre), sharded, prompts, tp)
    made = tuple(row if not kv else _with_kv(row, *compare_kv(*states)) for row, states in rows)
    return EngineCheckRecord(
        model=model_name, dtype=dtype, engine=chosen_engine.version(), prompts=len(prompts),
        tokens=tokens, chunk=chunk, rows=made, folder=folder,
        item_set=item_set, batch_invariant=batch_invariant, batch_invariant_note=note,
        faithful=faithful, kv=kv, wall_s=time.perf_counter() - start, threads=threads,
        block_size=block, tp=tp, attention=attention or "", engine_name=chosen_engine.name,
        kv_cache_dtype=kv_cache_dtype)


def _diverged(*sides) -> dict:
    """`diverged`: the items some side re-scored only up to where the engine's own token parted
    from the sequence (an engine without prompt logprobs re-scores by generating), where any did."""
    count = sum(any(r.diverged for r in items) for items in zip(*sides))
    return {"diverged": count} if count else {}


def _with_kv(row, kv, kv_dequantized=None):

    return replace(row, kv=kv, kv_dequantized=kv_dequantized)


def _decode(running, prompts, tokens, kv):
    """One generate call; with `kv`, each request's engine state (the prompt and every generated
    token but the last, which is never fed)."""
    made = running.generate(prompts, tokens, ignore_eos=True)
    states = running.read_states([g.request for g in made], [p + g.ids[:-1] for p, g in zip(prompts, made)]) \
        if kv else [None] * len(made)
    return made, states


def _rescore(running, sequences, starts, kv, read_cache=False):
    """One re-scoring call; with `kv`, each request's engine state over its whole sequence."""
    scored = running.rescore(sequences, starts, read_cache)
    states = running.read_states([r.request for r in scored], sequences) if kv else [None] * len(scored)
    return scored, states


def _alone(call, running, items, *rest):
    """`call` once per item (one request per call); the outputs and states in order."""
    made = [call(running, [item], *[[r[i]] if isinstance(r, list) else r for r in rest])
            for i, item in enumerate(items)]
    return [m[0][0] for m in made], [m[1][0] for m in made]


def _decode_row(construction, prompts, one, other, states):
    """Two decodes of the same prompts compared up to where their greedy tokens diverge."""
    same = [_common(a.ids, b.ids) for a, b in zip(one, other)]
    row = compare_logprobs(construction, [a.logprobs[:n] for a, n in zip(one, same)],
                           [b.logprobs[:n] for b, n in zip(other, same)],
                           diverged=sum(n < len(a.ids) for a, n in zip(one, same)))
    lengths = [len(p) + min(n, len(a.ids) - 1) for p, a, n in zip(prompts, one, same)]
    return row, (*states, lengths)


def measure_alone(running, prompts, tokens: int, kv: bool, sequences=None):
    """Greedy decode and prefill re-scoring of each prompt, one request per call: (decoded,
    their engine states, re-scored logprobs, their engine states). The re-scoring is of
    `sequences` (default: each prompt and its own decoded tokens)."""
    decoded, kv_decoded = _alone(_decode, running, prompts, tokens, kv)
    sequences = sequences or [p + g.ids for p, g in zip(prompts, decoded)]
    scored, kv_scored = _alone(_rescore, running, sequences, [len(p) for p in prompts], kv)
    return decoded, kv_decoded, [r.logprobs for r in scored], kv_scored


def tp_rows(one, sharded, prompts, tp: int) -> list[tuple]:
    """The rows `decode TP=1 vs TP=N` and `prefill re-scoring TP=1 vs TP=N` from two engines'
    `measure_alone` (the TP=N engine re-scoring TP=1's decoded sequences)."""
    (alone, kv_alone, pre, kv_pre), (other, kv_other, other_pre, kv_other_pre) = one, sharded
    return [_decode_row(f"decode TP=1 vs TP={tp}", prompts, alone, other, (kv_alone, kv_other)),
            (compare_logprobs(f"prefill re-scoring TP=1 vs TP={tp}", pre, other_pre),
             (kv_pre, kv_other_pre, None))]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def render(record: EngineCheckRecord) -> str:
    """The in-engine table, one row per pair of constructions; with `kv`, the engine-state table."""
    r = record
    lines = [f"kvfid engine-check  {r.engine}  model {r.model}  {r.dtype}  "
             f"{r.prompts} prompts x {r.tokens} greedy tokens"
             + ("  batch-invariant switch on" if r.batch_invariant else "")
             + ("  faithful (kvfid attention + batch-invariant mode)" if r.faithful else "")
             + (f"  attention {r.attention}" if r.attention else "")
             + (f"  {r.threads} torch thread(s)" if r.threads else "")
             + f"  KV blocks of {r.block_size}"
             + (f"  KV cache {r.kv_cache_dtype}" if r.kv_cache_dtype != "auto" else "")
             + (f"  TP=1 against TP={r.tp}" if r.tp > 1 else "")]
    if r.batch_invariant_note:
        lines.append(f"note: {r.batch_invariant_note}")
    lines.append(f"  {'constructions':<34} {'tokens differ':>15} {'max |dlogp|':>12}  items exact")
    for row in r.rows:
        extra = (f"  ({row.served_tokens} positions served by the cache)" if row.served_tokens is not None
                 else f"  ({row.diverged} items' greedy tokens diverge; compared up to there)"
                 if row.diverged else "")
        lines.append(f"  {row.construction:<34} {row.differ:>7}/{row.tokens:<7} "
                     f"{row.max_abs:>12.4g}  {row.items_exact}/{row.items}{extra}")
    if r.kv:
        stored = r.kv_cache_dtype != "auto"
        lines += ["", "engine state (each layer's K and V read from the engine's paged cache), bitwise"
                  + (f", in its stored format ({r.kv_cache_dtype} bytes and their scales):" if stored else ":")]
        lines += _kv_table(r.rows, lambda row: row.kv)
        if stored:
            lines += ["", "the same engine states dequantized (fp32(stored) * scale):"]
            lines += _kv_table(r.rows, lambda row: row.kv_dequantized)
        lines.append("  (d_rel: the worst item; per layer the worst of K and V; positions compared: "
                     "those both states hold over identical tokens"
                     + ("; max ULP in fp8's units stored, fp32's dequantized, counted through zero"
                        if stored else "") + ")")
    return "\n".join(lines)


def _kv_table(rows, part) -> list[str]:
    """The engine-state table's lines, each row's `part(row)` (an EngineKV or None)."""
    lines = [f"  {'constructions':<34} {'KV exact':>8} {'1st bad layer':>13} {'1st pos':>7} "
             f"{'elements':>9} {'max |diff|':>10} {'max ULP':>7} {'d_rel':>9}  d_rel per layer"]
    show = lambda v: "-" if v is None else str(v)   # noqa: E731
    for row in rows:
        k = part(row)
        if k is None:
            lines.append(f"  {row.construction:<34} {'-':>8}")
            continue
        lines.append(f"  {row.construction:<34} {k.items_exact:>4}/{k.items:<3} "
                     f"{show(k.first_bad_layer):>13} {show(k.first_position):>7} "
                     f"{k.n_diff:>9} {k.max_abs:>10.3g} {k.max_ulp:>7} {k.d_rel:>9.2e}  "
                     + " ".join(f"{d:.1e}" for d in k.d_rel_per_layer))
    return lines


def engine_rollouts(engine: str, model_name: str, item_set: str, count: int, tokens: int,
                    temperature: float, seed: int, dtype: str, faithful: bool = False,
                    tp: int = 1, threads: int | None = None, kv_cache_dtype: str = "auto") -> list[dict]:
    """`kvfid rollouts --engine NAME`: sampled by that engine (seeded per request), its logprobs
    kept; `faithful`: its faithful mode; `tp`: sharded over that many worker processes;
    `kv_cache_dtype`: its paged cache's stored format."""

    chosen_engine = engine_for(engine)
    if tp > 1 and TP not in chosen_engine.offers:
        raise BadInput(f"--engine {engine}: --tp is not offered by this engine")
    config = EngineConfig(model_name, dtype, faithful=faithful, tp=tp, seed=seed, threads=threads,
                          kv_cache_dtype=kv_cache_dtype)
    chosen_engine.checked(config)
    chosen, codec = items_and_codec(model_name, item_set, count)
    prompts = [codec.prompt_ids(i.prompt) for i in chosen]
    config = config.with_(max_len=max(len(p) for p in prompts) + tokens + 1)
    with started(chosen_engine, config) as running:
        made = running.generate(prompts, tokens, temperature, seed * 100003,
                                stop_ids=sorted(codec.eos_ids))
    label = (f"{chosen_engine.version()}/{dtype}" + ("+faithful" if faithful else "")
             + (f"+kv:{kv_cache_dtype}" if kv_cache_dtype != "auto" else "") + (f"@tp{tp}" if tp > 1 else ""))
    return [as_row(Trajectory(i.id, tuple(p), tuple(g.ids), tuple(g.logprobs)), model=model_name,
                   stack=label, temperature=temperature, seed=seed)
            for i, p, g in zip(chosen, prompts, made) if g.ids]


__all__ = ["engine_check", "engine_rollouts", "render"]
