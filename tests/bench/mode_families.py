"""The table of issue 17 part 3: per tiny model, is eager (stock), eager + the batch-invariant mode
(rowwise) and eager + mode + the faithful recurrence bit-exact prefill~incremental and
batch-1~batch-2 (logits and every cache tensor), and the faithful prefill's cost.

    PYTHONPATH=$PWD python tests/bench/mode_families.py [--length 12] [--families qwen3_next ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))
import mode_models as mm  # noqa: E402

from kvfid.kernels.invariant.mode import set_batch_invariant_mode  # noqa: E402
from kvfid.kernels.recurrence import faithful_recurrence  # noqa: E402


def arms(model):
    """(name, context) of each arm; the faithful ones only where the model has recurrent layers
    (elsewhere they change nothing)."""
    recurrent = bool(faithful_recurrence(model).layers)
    yield "eager", contextlib.nullcontext()
    if recurrent:
        yield "eager+faithful", faithful_recurrence(model)
    yield "eager+mode", set_batch_invariant_mode(impl="rowwise")
    if not recurrent:
        return
    stack = contextlib.ExitStack()
    stack.enter_context(set_batch_invariant_mode(impl="rowwise"))
    stack.enter_context(faithful_recurrence(model))
    yield "eager+mode+faithful", stack


def cell(names: list[str]) -> str:
    return "yes" if not names else "NO: " + ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")


def prefill_time(model, length: int, repeats: int) -> float:
    ids = mm.prompt(length)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mm.run(model, ids, [length])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--families", nargs="*", default=list(mm.FAMILIES))
    parser.add_argument("--experts", default=None, help="experts_implementation (default: transformers')")
    parser.add_argument("--cost-length", type=int, default=64)
    parser.add_argument("--cost-only", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    print("| model | arm | prefill~incremental | batch-1~batch-2 |\n|---|---|---|---|")
    for family in [] if args.cost_only else args.families:
        model = mm.build(family, experts=args.experts, dtype=getattr(torch, args.dtype))
        for arm, ctx in arms(model):
            with ctx:
                row = (cell(mm.prefill_vs_incremental(model, args.length)), cell(mm.batch1_vs_batch2(model, args.length)))
            print(f"| {family} ({model.config._experts_implementation}) | {arm} | {row[0]} | {row[1]} |", flush=True)
    for family in [f for f in args.families if faithful_recurrence(mm.build(f)).layers]:
        model = mm.build(family, experts=args.experts, dtype=getattr(torch, args.dtype))
        for label, mode in (("eager", contextlib.nullcontext), ("eager+mode", lambda: set_batch_invariant_mode(impl="rowwise"))):
            with mode():
                chunked = prefill_time(model, args.cost_length, 3)
                with faithful_recurrence(model):
                    faithful = prefill_time(model, args.cost_length, 3)
            print(f"cost {family} {label} prefill of {args.cost_length}: chunked {chunked:.3f}s, "
                  f"faithful {faithful:.3f}s, ratio {faithful / chunked:.1f}x", flush=True)


if __name__ == "__main__":
    main()
