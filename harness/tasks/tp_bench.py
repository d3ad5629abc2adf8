"""The TP-invariant stack's price: stock and faithful stacks at TP=1 and TP=N on one model, prefill
and decode tokens per second (medians of the repeats) and faithful over stock per TP size.

`python -m kvfid.tasks.tp_bench --model qwen2.5-0.5b-shape --tp 1,2`. Each (stack, TP size) is
timed by its own ranks (kvfid.stacks.tp; TP=1 in this process): an untimed warm-up, then per
repeat a prefill of `prompt` tokens (one forward) and `decode` one-token steps after it; wall
time end to end (`time.perf_counter`) around each call, read on rank 0 after every rank's call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from kvfid.environment import envinfo
from kvfid.inputs.models import load_model
from kvfid.protocol.decode import Runner, as_batch, new_cache
from kvfid.stacks.ranks import on_ranks, ranks
from kvfid.stacks.stack import parse_stack


@dataclass(frozen=True)
class TPBench:
    """What is measured (data, apart from the timer)."""

    model: str = "qwen2.5-0.5b-shape"
    dtype: str = "bf16"
    stacks: tuple[tuple[str, str], ...] = (("stock", "sdpa/{dtype}@t1@tp{tp}"),
                                           ("faithful", "native/{dtype}+bi@t1@tp{tp}"))
    sizes: tuple[int, ...] = (1, 2)
    prompt: int = 64
    decode: int = 8
    repeats: int = 3


def _timed(label: str, bench: TPBench) -> dict:
    """On every rank: one stack's prefill and decode walls (rank 0's figures come back)."""
    model, stack = load_model(bench.model), parse_stack(label)
    ids = [(7 * i + 3) % 250 for i in range(bench.prompt)]
    prefill, decode = [], []
    with stack.activate(model) as module:
        runner = Runner(module)

        def barrier():
            if ranks().size > 1:
                torch.distributed.barrier()

        for repeat in range(bench.repeats + 1):       # the first: an untimed warm-up
            cached = new_cache(module)
            barrier()
            start = time.perf_counter()
            logits, cached = runner.forward(as_batch(ids), cached)
            barrier()
            middle = time.perf_counter()
            for _ in range(bench.decode):
                logits, cached = runner.forward(as_batch([int(logits[0].argmax())]), cached)
            barrier()
            if repeat:
                prefill.append(middle - start)
                decode.append(time.perf_counter() - middle)
    p, d = statistics.median(prefill), statistics.median(decode)
    return {"stack": label, "prefill_tok_s": bench.prompt / p, "decode_tok_s": bench.decode / d,
            "prefill_s": prefill, "decode_s": decode}


def tp_bench(bench: TPBench = TPBench(), progress=None) -> dict:
    """Every stack at every TP size, then faithful / stock per size and phase (how many times
    slower the TP-invariant stack is)."""
    say = progress or (lambda _: None)
    measured = {}
    for size in bench.sizes:
        for name, pattern in bench.stacks:
            label = pattern.format(dtype=bench.dtype, tp=size).removesuffix("@tp1")
            say(f"{label}")
            measured[(name, size)] = (on_ranks(size, _timed, label, bench) if size > 1
                                      else _timed(label, bench))
    slowdown = {size: {phase: measured[("stock", size)][f"{phase}_tok_s"]
                       / measured[("faithful", size)][f"{phase}_tok_s"]
                       for phase in ("prefill", "decode")} for size in bench.sizes}
    environment = envinfo.collect()
    return {"bench": bench.__dict__, "rows": [{"kind": k, "tp": n, **m} for (k, n), m in measured.items()],
            "slowdown": slowdown, "environment_key": envinfo.environment_key(environment)}


def render(result: dict) -> str:
    b = result["bench"]
    lines = [f"TP bench  {b['model']}  {b['dtype']}  prefill {b['prompt']} tokens, {b['decode']} "
             f"decode steps, median of {b['repeats']}  ({result['environment_key']})",
             f"  {'stack':<26} {'TP':>3} {'prefill tok/s':>14} {'decode tok/s':>13}"]
    for row in result["rows"]:
        lines.append(f"  {row['stack']:<26} {row['tp']:>3} {row['prefill_tok_s']:>14.1f} "
                     f"{row['decode_tok_s']:>13.2f}")
    for size, s in result["slowdown"].items():
        lines.append(f"  TP={size}: faithful / stock time: prefill {s['prefill']:.2f}x, "
                     f"decode {s['decode']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=TPBench.model)
    parser.add_argument("--dtype", default=TPBench.dtype)
    parser.add_argument("--tp", default="1,2", help="TP sizes, comma-separated")
    parser.add_argument("--prompt", type=int, default=TPBench.prompt)
    parser.add_argument("--decode", type=int, default=TPBench.decode)
    parser.add_argument("--repeats", type=int, default=TPBench.repeats)
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    bench = TPBench(args.model, args.dtype, sizes=tuple(int(n) for n in args.tp.split(",")),
                    prompt=args.prompt, decode=args.decode, repeats=args.repeats)
    result = tp_bench(bench, progress=lambda s: print(f"tp-bench: {s}", file=sys.stderr, flush=True))
    print(json.dumps(result, indent=1, default=str) if args.format == "json" else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
