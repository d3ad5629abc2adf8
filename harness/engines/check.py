"""`kvfid engine-check`: what vLLM's own constructions do to the same tokens, bitwise.

Greedy continuations are generated once per prompt (alone), then the same tokens' logprobs are
taken again by each of vLLM's constructions and compared bit for bit (fp32, as vLLM returns them):

- `decode vs prefill re-scoring`: the decode's sampling logprobs against `prompt_logprobs` of
  prompt + continuation in one prefill (what a trainer re-scoring with the engine sees);
- `prefix cache cold vs warm`: the re-scoring not reading the prefix cache against the same
  request again, reading the full KV blocks the first one left there (positions whose logits
  the cache served have no logprob and are not compared; the row says how many were served);
- `chunked prefill off vs on`: the re-scoring with the whole sequence in one step against a
  scheduler budget that splits it into chunks;
- `alone vs batched` (prefill and decode): one request per call against every prompt in one call
  (other requests, other lengths, in the same forward passes);
- with `tp` N > 1, `decode TP=1 vs TP=N` and `prefill re-scoring TP=1 vs TP=N`: the same requests
  on an engine sharded over N worker processes (each rank's K/V heads read and joined).

A row counts the continuation tokens compared, those whose bits differ, max |delta logprob| and
items exact. Decoded tokens that diverge between two runs are compared up to the divergence.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from kvfid.errors import BadInput, Unavailable
from kvfid.records.plain import as_plain
from kvfid.engines import engine as vllm_engine
from kvfid.engines import kv as engine_kv
from kvfid.engines.engine import EngineConfig
from kvfid.inputs.trajectories import Trajectory, as_row, items_and_codec


def _compare(a: list[list[float]], b: list[list[float]]) -> dict:
    """Bitwise over paired logprob lists (each pair compared over its common length)."""
    tokens = differ = exact = 0
    worst = 0.0
    for x, y in zip(a, b):
        pairs = [(u, v) for u, v in zip(x, y) if u is not None and v is not None]
        n = len(pairs)
        if n == 0:
            continue
        tx = torch.tensor([u for u, _ in pairs], dtype=torch.float32)
        ty = torch.tensor([v for _, v in pairs], dtype=torch.float32)
        d = int((tx.view(torch.int32) != ty.view(torch.int32)).sum())
        tokens, differ, exact = tokens + n, differ + d, exact + (d == 0)
        worst = max(worst, float((tx.double() - ty.double()).abs().max()))
    return {"tokens": tokens, "differ": differ, "max_abs": worst, "items_exact": exact,
            "items": len(a)}


def engine_check(model_name: str, dtype: str, count: int, tokens: int, chunk: int,
                 item_set: str = "arith", batch_invariant: bool = False, kv: bool = False,
                 faithful: bool = False, progress=None, threads: int | None = None,
                 tp: int = 1, block_size: int | None = vllm_engine.BLOCK) -> dict:
    """The in-engine table for one model and dtype on vLLM (see the module docstring), with
    VLLM_BATCH_INVARIANT set to `batch_invariant` for its engines and restored after. `kv`: each
    row also compares the engine states (kv.py); `faithful`: the engines run kvfid's
    batch-invariant attention and mode (faithful.py); `threads`: the engines' calls at
    that many torch threads (None: vLLM-CPU's own, a thread per core); `block_size`: the KV
    block in tokens (None: vLLM's own default)."""
    before = os.environ.get("VLLM_BATCH_INVARIANT")
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if batch_invariant else "0"
    try:
        return _engine_check(model_name, dtype, count, tokens, chunk, item_set, batch_invariant,
                             kv, faithful, progress, threads, tp, block_size)
    finally:                       # what the process had before, as it had it
        if before is None:
            os.environ.pop("VLLM_BATCH_INVARIANT", None)
        else:
            os.environ["VLLM_BATCH_INVARIANT"] = before


def _decode(llm, prompts, tokens, kv):
    """One generate call; with `kv`, each request's engine state (the prompt and every generated
    token but the last, which is never fed)."""
    requests = []
    made = vllm_engine.generate(llm, prompts, tokens, ignore_eos=True, requests=requests)
    states = engine_kv.read_states(llm, requests, [p + ids[:-1] for p, (ids, _) in zip(prompts, made)]) \
        if kv else [None] * len(made)
    return made, states


def _rescore(llm, sequences, starts, kv, read_cache=False):
    """One re-scoring call; with `kv`, each request's engine state over its whole sequence."""
    requests = []
    scored = vllm_engine.rescore(llm, sequences, starts, read_cache, requests=requests)
    states = engine_kv.read_states(llm, requests, sequences) if kv else [None] * len(scored)
    return scored, states


def _alone(call, llm, items, *rest):
    """`call` once per item (one request per generate call); the outputs and states in order."""
    made = [call(llm, [item], *[[r[i]] if isinstance(r, list) else r for r in rest])
            for i, item in enumerate(items)]
    return [m[0][0] for m in made], [m[1][0] for m in made]


def _engine_check(model_name, dtype, count, tokens, chunk, item_set, batch_invariant, kv,
                  faithful, progress, threads, tp=1, block_size=vllm_engine.BLOCK):
    vllm_engine.require_vllm()
    folder = vllm_engine.model_folder(model_name)
    note = vllm_engine.batch_invariant_refusal() if batch_invariant else None
    if chunk < vllm_engine.BLOCK or chunk % vllm_engine.BLOCK:
        raise BadInput(f"--chunk {chunk}: a multiple of {vllm_engine.BLOCK} (vLLM-CPU's KV block)")
    chosen, codec = items_and_codec(model_name, item_set, count)
    prompts = [codec.prompt_ids(i.prompt) for i in chosen]
    say = progress or (lambda _: None)
    start = time.perf_counter()
    rows = []
    longest = max(len(p) for p in prompts) + tokens + 1
    # A TP check compares TP=1 with TP=N: the TP=1 engine computes the TP-invariant products too.
    config = functools.partial(EngineConfig, faithful=faithful, block_size=block_size,
                               tp_invariant=tp > 1)
    threaded = functools.partial(vllm_engine.torch_threads, threads)
    with vllm_engine.engine(folder, dtype, config(), max_len=longest) as llm, threaded():
        block = vllm_engine.block_size(llm)
        say("decode, one request at a time")
        alone, kv_alone = _alone(_decode, llm, prompts, tokens, kv)
        say("decode, every prompt in one batch")
        batched, kv_batched = _decode(llm, prompts, tokens, kv)
        sequences = [p + ids for p, (ids, _) in zip(prompts, alone)]
        starts = [len(p) for p in prompts]
        say("prefill re-scoring, alone and batched")
        pre_alone, kv_pre = _alone(_rescore, llm, sequences, starts, kv)
        pre_batched, kv_pre_batched = _rescore(llm, sequences, starts, kv)
    decoded = [lp for _, lp in alone]
    pre_alone = [lp for lp, _ in pre_alone]
    rows.append(("decode vs prefill re-scoring", _compare(decoded, pre_alone), (kv_alone, kv_pre, None)))
    same = [_common(a, b) for (a, _), (b, _) in zip(alone, batched)]
    row = _compare([lp[:n] for (_, lp), n in zip(alone, same)],
                   [lp[:n] for (_, lp), n in zip(batched, same)])
    row["diverged"] = sum(n < len(ids) for (ids, _), n in zip(alone, same))
    lengths = [len(p) + min(n, len(ids) - 1) for p, (ids, _), n in zip(prompts, alone, same)]
    rows.append(("decode alone vs batched", row, (kv_alone, kv_batched, lengths)))
    rows.append(("prefill alone vs batched", _compare(pre_alone, [lp for lp, _ in pre_batched]),
                 (kv_pre, kv_pre_batched, None)))
    say(f"chunked prefill by {chunk}")
    with vllm_engine.engine(folder, dtype, config(chunk=chunk), longest) as llm, threaded():
        chunked, kv_chunked = _alone(_rescore, llm, sequences, starts, kv)
    rows.append((f"chunked prefill off vs on ({chunk})", _compare(pre_alone, [lp for lp, _ in chunked]),
                 (kv_pre, kv_chunked, None)))
    say("prefix cache, cold then warm")
    with vllm_engine.engine(folder, dtype, config(prefix_caching=True), longest) as llm, threaded():
        cold, kv_cold = _alone(_rescore, llm, sequences, starts, kv)
        warm, kv_warm = _alone(_rescore, llm, sequences, starts, kv, True)
    row = _compare([lp for lp, _ in cold], [lp for lp, _ in warm])
    row["served_tokens"] = sum(n for _, n in warm)
    rows.append(("prefix cache cold vs warm", row, (kv_cold, kv_warm, None)))
    if tp > 1:
        say(f"TP={tp}: decode and prefill re-scoring, one request at a time")
        with vllm_engine.engine(folder, dtype, config(tp=tp), longest) as llm:
            sharded = measure_alone(llm, prompts, tokens, kv, sequences)
        rows += tp_rows((alone, kv_alone, pre_alone, kv_pre), sharded, prompts, tp)
    made = [{"construction": name, **r,
             **({"kv": as_plain(engine_kv.compare_rows(*states))} if kv else {})}
            for name, r, states in rows]
    return {"model": model_name, "folder": folder, "dtype": dtype, "engine": f"vllm {vllm_engine.version()}",
            "prompts": len(prompts), "tokens": tokens, "chunk": chunk, "item_set": item_set,
            "batch_invariant": batch_invariant, "batch_invariant_note": note, "faithful": faithful,
            "kv": kv, "rows": made, "wall_s": time.perf_counter() - start, "threads": threads,
            "block_size": block,
            **({"tp": tp} if tp > 1 else {})}


def measure_alone(llm, prompts, tokens: int, kv: bool, sequences=None):
    """Greedy decode and prefill re-scoring of each prompt, one request per call: (decoded,
    their engine states, re-scored logprobs, their engine states). The re-scoring is of
    `sequences` (default: each prompt and its own decoded tokens)."""
    decoded, kv_decoded = _alone(_decode, llm, prompts, tokens, kv)
    sequences = sequences or [p + ids for p, (ids, _) in zip(prompts, decoded)]
    scored, kv_scored = _alone(_rescore, llm, sequences, [len(p) for p in prompts], kv)
    return decoded, kv_decoded, [lp for lp, _ in scored], kv_scored


def tp_rows(one, sharded, prompts, tp: int) -> list[tuple]:
    """The rows `decode TP=1 vs TP=N` and `prefill re-scoring TP=1 vs TP=N` from two engines'
    `measure_alone` (the TP=N engine re-scoring TP=1's decoded sequences)."""
    (alone, kv_alone, pre, kv_pre), (other, kv_other, other_pre, kv_other_pre) = one, sharded
    same = [_common(a, b) for (a, _), (b, _) in zip(alone, other)]
    row = _compare([lp[:n] for (_, lp), n in zip(alone, same)],
                   [lp[:n] for (_, lp), n in zip(other, same)])
    row["diverged"] = sum(n < len(ids) for (ids, _), n in zip(alone, same))
    lengths = [len(p) + min(n, len(ids) - 1) for p, (ids, _), n in zip(prompts, alone, same)]
    return [(f"decode TP=1 vs TP={tp}", row, (kv_alone, kv_other, lengths)),
            (f"prefill re-scoring TP=1 vs TP={tp}", _compare(pre, other_pre),
             (kv_pre, kv_other_pre, None))]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def render(result: dict) -> str:
    """The in-engine table, one row per pair of constructions; with `kv`, the engine-state table."""
    lines = [f"kvfid engine-check  {result['engine']}  model {result['model']}  {result['dtype']}  "
             f"{result['prompts']} prompts x {result['tokens']} greedy tokens"
             + ("  VLLM_BATCH_INVARIANT=1" if result["batch_invariant"] else "")
             + ("  faithful (kvfid attention + batch-invariant mode)" if result.get("faithful") else "")
             + (f"  {result['threads']} torch thread(s)" if result.get("threads") else "")
             + f"  KV blocks of {result.get('block_size', vllm_engine.BLOCK)}"
             + (f"  TP=1 against TP={result['tp']}" if result.get("tp") else "")]
    if result.get("batch_invariant_note"):
        lines.append(f"note: {result['batch_invariant_note']}")
    lines.append(f"  {'constructions':<34} {'tokens differ':>15} {'max |dlogp|':>12}  items exact")
    for r in result["rows"]:
        extra = (f"  ({r['served_tokens']} positions served by the cache)" if "served_tokens" in r
                 else f"  ({r['diverged']} items' greedy tokens diverge; compared up to there)"
                 if r.get("diverged") else "")
        lines.append(f"  {r['construction']:<34} {r['differ']:>7}/{r['tokens']:<7} "
                     f"{r['max_abs']:>12.4g}  {r['items_exact']}/{r['items']}{extra}")
    if result.get("kv"):
        lines += ["", "engine state (each layer's K and V read from vLLM's paged cache), bitwise:",
                  f"  {'constructions':<34} {'KV exact':>8} {'1st bad layer':>13} {'1st pos':>7} "
                  f"{'elements':>9} {'max |diff|':>10} {'max ULP':>7} {'d_rel':>9}  d_rel per layer"]
        for r in result["rows"]:
            k = r["kv"]
            show = lambda v: "-" if v is None else str(v)   # noqa: E731
            lines.append(f"  {r['construction']:<34} {k['items_exact']:>4}/{k['items']:<3} "
                         f"{show(k['first_bad_layer']):>13} {show(k['first_position']):>7} "
                         f"{k['n_diff']:>9} {k['max_abs']:>10.3g} {k['max_ulp']:>7} {k['d_rel']:>9.2e}  "
                         + " ".join(f"{d:.1e}" for d in k["d_rel_per_layer"]))
        lines.append("  (d_rel: the worst item; per layer the worst of K and V; positions compared: "
                     "those both states hold over identical tokens)")
    return "\n".join(lines)


def engine_rollouts(model_name: str, item_set: str, count: int, tokens: int, temperature: float,
                    seed: int, dtype: str, faithful: bool = False, tp: int = 1) -> list[dict]:
    """`kvfid rollouts --engine vllm`: sampled by vLLM (seeded per request), its logprobs kept;
    `faithful`: by the faithful engine; `tp`: sharded over that many worker processes."""
    vllm_engine.require_vllm()
    folder = vllm_engine.model_folder(model_name)
    chosen, codec = items_and_codec(model_name, item_set, count)
    prompts = [codec.prompt_ids(i.prompt) for i in chosen]
    longest = max(len(p) for p in prompts) + tokens + 1
    with vllm_engine.engine(folder, dtype, EngineConfig(faithful=faithful, tp=tp), max_len=longest,
                            seed=seed) as llm:
        made = vllm_engine.generate(llm, prompts, tokens, temperature, seed * 100003,
                                    stop_ids=sorted(codec.eos_ids))
    label = (f"vllm {vllm_engine.version()}/{dtype}" + ("+faithful" if faithful else "")
             + (f"@tp{tp}" if tp > 1 else ""))
    return [as_row(Trajectory(i.id, tuple(p), tuple(ids), tuple(lp)), model=model_name,
                   stack=label, temperature=temperature, seed=seed)
            for i, p, (ids, lp) in zip(chosen, prompts, made) if ids]


__all__ = ["engine_check", "engine_rollouts", "render", "Unavailable"]
