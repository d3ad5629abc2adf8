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
  (other requests, other lengths, in the same forward passes).

A row counts the continuation tokens compared, those whose bits differ, max |delta logprob| and
items exact. Decoded tokens that diverge between two runs are compared up to the divergence.
"""

from __future__ import annotations

import json
import os
import time

from harness.errors import BadInput, Unavailable
from harness.protocol import engine as vllm_engine
from harness.protocol.engine import EngineConfig


def _compare(a: list[list[float]], b: list[list[float]]) -> dict:
    """Bitwise over paired logprob lists (each pair compared over its common length)."""
    import torch

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
                 item_set: str = "arith", batch_invariant: bool = False, progress=None) -> dict:
    """The in-engine table for one model and dtype on vLLM (see the module docstring), with
    VLLM_BATCH_INVARIANT set to `batch_invariant` for its engines and restored after."""
    before = os.environ.get("VLLM_BATCH_INVARIANT")
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if batch_invariant else "0"
    try:
        return _engine_check(model_name, dtype, count, tokens, chunk, item_set, batch_invariant,
                             progress)
    finally:                       # what the process had before, as it had it
        if before is None:
            os.environ.pop("VLLM_BATCH_INVARIANT", None)
        else:
            os.environ["VLLM_BATCH_INVARIANT"] = before


def _engine_check(model_name, dtype, count, tokens, chunk, item_set, batch_invariant, progress):
    from harness.protocol.trajectories import items_and_codec

    vllm_engine.require_vllm()
    folder = vllm_engine.model_folder(model_name)
    note = vllm_engine.batch_invariant_refusal() if batch_invariant else None
    if chunk < vllm_engine.BLOCK or chunk % vllm_engine.BLOCK:
        raise BadInput(f"--chunk {chunk}: a multiple of {vllm_engine.BLOCK} (vLLM-CPU's KV block)")
    chosen, codec = items_and_codec(model_name, item_set, count)
    prompts = [codec.prompt_ids(i.prompt) for i in chosen]
    say = progress or (lambda _: None)
    start = time.perf_counter()
    rows, served = [], []
    longest = max(len(p) for p in prompts) + tokens + 1
    with vllm_engine.engine(folder, dtype, max_len=longest) as llm:
        say("decode, one request at a time")
        alone = [vllm_engine.generate(llm, [p], tokens, ignore_eos=True)[0] for p in prompts]
        say("decode, every prompt in one batch")
        batched = vllm_engine.generate(llm, prompts, tokens, ignore_eos=True)
        sequences = [p + ids for p, (ids, _) in zip(prompts, alone)]
        starts = [len(p) for p in prompts]
        say("prefill re-scoring, alone and batched")
        pre_alone = [vllm_engine.rescore(llm, [s], [f])[0][0] for s, f in zip(sequences, starts)]
        pre_batched = [lp for lp, _ in vllm_engine.rescore(llm, sequences, starts)]
    decoded = [lp for _, lp in alone]
    rows.append(("decode vs prefill re-scoring", _compare(decoded, pre_alone)))
    same = [_common(a, b) for (a, _), (b, _) in zip(alone, batched)]
    row = _compare([lp[:n] for (_, lp), n in zip(alone, same)],
                   [lp[:n] for (_, lp), n in zip(batched, same)])
    row["diverged"] = sum(n < len(ids) for (ids, _), n in zip(alone, same))
    rows.append(("decode alone vs batched", row))
    rows.append(("prefill alone vs batched", _compare(pre_alone, pre_batched)))
    say(f"chunked prefill by {chunk}")
    with vllm_engine.engine(folder, dtype, EngineConfig(chunk=chunk), longest) as llm:
        chunked = [vllm_engine.rescore(llm, [s], [f])[0][0] for s, f in zip(sequences, starts)]
    rows.append((f"chunked prefill off vs on ({chunk})", _compare(pre_alone, chunked)))
    say("prefix cache, cold then warm")
    with vllm_engine.engine(folder, dtype, EngineConfig(prefix_caching=True), longest) as llm:
        cold = [vllm_engine.rescore(llm, [s], [f])[0][0] for s, f in zip(sequences, starts)]
        warm = [vllm_engine.rescore(llm, [s], [f], read_cache=True)[0] for s, f in zip(sequences, starts)]
    served = [n for _, n in warm]
    row = _compare(cold, [lp for lp, _ in warm])
    row["served_tokens"] = sum(served)
    rows.append(("prefix cache cold vs warm", row))
    return {"model": model_name, "folder": folder, "dtype": dtype, "engine": f"vllm {vllm_engine.version()}",
            "prompts": len(prompts), "tokens": tokens, "chunk": chunk,
            "batch_invariant": batch_invariant, "batch_invariant_note": note,
            "rows": [{"construction": name, **r} for name, r in rows],
            "wall_s": time.perf_counter() - start}


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def render(result: dict) -> str:
    """The in-engine table, one row per pair of constructions."""
    lines = [f"kvfid engine-check  {result['engine']}  model {result['model']}  {result['dtype']}  "
             f"{result['prompts']} prompts x {result['tokens']} greedy tokens"
             + ("  VLLM_BATCH_INVARIANT=1" if result["batch_invariant"] else "")]
    if result.get("batch_invariant_note"):
        lines.append(f"note: {result['batch_invariant_note']}")
    lines.append(f"  {'constructions':<34} {'tokens differ':>15} {'max |dlogp|':>12}  items exact")
    for r in result["rows"]:
        extra = (f"  ({r['served_tokens']} positions served by the cache)" if "served_tokens" in r
                 else f"  ({r['diverged']} items' greedy tokens diverge; compared up to there)"
                 if r.get("diverged") else "")
        lines.append(f"  {r['construction']:<34} {r['differ']:>7}/{r['tokens']:<7} "
                     f"{r['max_abs']:>12.4g}  {r['items_exact']}/{r['items']}{extra}")
    return "\n".join(lines)


def engine_rollouts(model_name: str, item_set: str, count: int, tokens: int, temperature: float,
                    seed: int, dtype: str) -> list[dict]:
    """`kvfid rollouts --engine vllm`: sampled by vLLM (seeded per request), its logprobs kept."""
    from harness.protocol.trajectories import Trajectory, as_row, items_and_codec

    vllm_engine.require_vllm()
    folder = vllm_engine.model_folder(model_name)
    chosen, codec = items_and_codec(model_name, item_set, count)
    prompts = [codec.prompt_ids(i.prompt) for i in chosen]
    longest = max(len(p) for p in prompts) + tokens + 1
    with vllm_engine.engine(folder, dtype, max_len=longest, seed=seed) as llm:
        made = vllm_engine.generate(llm, prompts, tokens, temperature, seed * 100003,
                                    stop_ids=sorted(codec.eos_ids))
    label = f"vllm {vllm_engine.version()}/{dtype}"
    return [as_row(Trajectory(i.id, tuple(p), tuple(ids), tuple(lp)), model=model_name,
                   stack=label, temperature=temperature, seed=seed)
            for i, p, (ids, lp) in zip(chosen, prompts, made) if ids]


def check_command(fmt: str, **options) -> tuple[str, dict]:
    """What `kvfid engine-check` prints."""
    result = engine_check(**options)
    return (json.dumps(result, indent=1) if fmt == "json" else render(result)), result


__all__ = ["engine_check", "engine_rollouts", "render", "check_command", "Unavailable"]
