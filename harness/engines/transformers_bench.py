"""`kvfid engine-bench --engine transformers`: the faithful engine's price in transformers'
continuous batching, stock against faithful on the same requests, timed as vLLM's are
(kvfid.engines.bench: `measure`, `slowdown` and the same tables).

Prefill and decode: one manager of each kind (block sharing off, so every prefill is computed;
pages of 32 tokens; the step's token budget the engine check's default, the longest request or
2048), every prompt added in one call and every result collected (its generation loop in its
own thread, as a user runs it), no K/V read. `engine-bench --load K`: both engines serve
engine-load's greedy plan from K clients under the same block budget, stepped as engine-load
steps them (kvfid.engines.transformers_load) with nothing recorded but the tokens, every cached
block evicted before each repeat; generated tokens/s per repeat, the median, and stock / faithful.
"""

from __future__ import annotations

import statistics

import torch

from kvfid.engines.bench import EngineBench, measure, slowdown
from kvfid.engines.load_plan import LoadShape, plan_load
from kvfid.engines.seam import EngineConfig
from kvfid.engines.transformers_batching import manager, refusal, version
from kvfid.engines.transformers_load import BLOCK, alone, drive, load_config, stepped_manager
from kvfid.errors import BadInput, Unavailable
from kvfid.inputs.trajectories import items_and_codec


def engine_bench(model_name: str, dtype: str, count: int, tokens: int, item_set: str = "arith",
                 bench: EngineBench = EngineBench(), progress=None, threads: int | None = None,
                 tp: int = 1, kv_cache_dtype: str = "auto") -> dict:
    """Stock and faithful transformers engines on the same prompts: tokens/s per phase and
    stock / faithful (the result kvfid.engines.bench.render shows)."""
    if tokens < 2:
        raise BadInput(f"--tokens {tokens}: at least 2 (decode is timed after the first token)")
    chosen, codec = items_and_codec(model_name, item_set, count)
    prompts = [codec.prompt_ids(i.prompt) for i in chosen]
    longest = max(len(p) for p in prompts) + tokens + 1
    say = progress or (lambda _: None)
    threads = bench.threads if threads is None else threads
    measured = {}
    for name, faithful in bench.engines:
        say(f"{name} engine")
        config = EngineConfig(model_name, dtype, longest, faithful=faithful, block_size=BLOCK,
                              threads=threads, tp=tp)
        why = refusal(config)
        if why:
            raise BadInput(f"--engine transformers: {why}")
        with manager(config) as made:
            running = _Timed(made)
            measured[name] = {**measure(running.generate, prompts, tokens, bench.repeats),
                              "threads": torch.get_num_threads()}
    return {"model": model_name, "dtype": dtype, "engine": version(), "prompts": len(prompts),
            "tokens": tokens, "repeats": bench.repeats, "tp": tp, "kv_cache_dtype": kv_cache_dtype,
            "engines": measured, "slowdown": slowdown(measured)}


class _Timed:
    """A looping manager's generate as a user calls it: every prompt added, every result taken."""

    def __init__(self, made):
        self.manager, self.count = made, 0

    def generate(self, prompts, n: int) -> None:
        ids = [f"bench-{self.count + i}" for i in range(len(prompts))]
        self.count += len(prompts)
        for request, prompt in zip(ids, prompts):
            self.manager.add_request(list(prompt), request_id=request, max_new_tokens=n, eos_token_id=-1)
        for _ in ids:
            out = self.manager.get_result(timeout=600)
            if out is None or out.error:
                raise RuntimeError(f"transformers' continuous batching gave no result "
                                   f"({out.error if out is not None else 'timed out'})")


def load_bench(model_name: str, dtype: str, shape: LoadShape, seed: int = 0, kv_blocks: int = 18,
               repeats: int = 3, threads: int | None = None, progress=None,
               kv_cache_dtype: str = "auto") -> dict:
    """Stock and faithful under the same load (engine-load's greedy plan, clients and block
    budget): generated tokens/s of each repeat, their median per engine and stock / faithful
    (the result kvfid.engines.bench.render_load shows)."""
    plan = plan_load(shape, seed)
    say = progress or (lambda _: None)
    measured = {}
    for name, faithful in EngineBench().engines:
        say(f"{name} engine under load")
        config = load_config(model_name, dtype, plan, kv_blocks, None, faithful, True, threads)
        with stepped_manager(config) as stepped:
            alone(stepped, plan.requests[:1])                  # warm-up, not timed
            rates = []
            for _ in range(repeats):
                while stepped.cache.evict_cached_blocks():
                    pass
                run = drive(stepped, plan)
                if run.missing:
                    raise Unavailable(f"engine-bench --load: {len(run.missing)} requests missing "
                                      f"({next(iter(run.missing.values()))})")
                rates.append(sum(len(s.tokens) for s in run.served.values()) / run.wall_s)
            measured[name] = {"tok_s": statistics.median(rates), "repeats": rates,
                              "threads": torch.get_num_threads()}
    return {"model": model_name, "dtype": dtype, "engine": version(), "requests": len(plan.requests),
            "clients": shape.clients, "tokens": shape.tokens, "kv_blocks": kv_blocks, "seed": seed,
            "kv_cache_dtype": kv_cache_dtype, "engines": measured,
            "slowdown": measured["stock"]["tok_s"] / measured["faithful"]["tok_s"]}
