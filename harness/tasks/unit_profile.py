"""Where a unit's time goes: one prefill and one decode step of a case's model, per stack, under
torch.profiler (`make gpu-check`'s profile step).

A unit of a case is mostly forward calls (prefill, decode steps) plus the host-side work around
them: reading the boundary state out of the cache, its SHA-256 fingerprints (bytes copied to the
host), the bitwise comparison of two states, the greedy token read back each step. Per stack this
times each part (median of a few repeats after an untimed warm-up, so no Triton compile or
allocator growth is counted) and profiles one pass of them: the top ops and kernels by self device
time (by self CPU time without CUDA), and the counts that say whether a step is host-bound:
kernel launches, device-to-host copies and synchronizations per part. Prints the tables, then one
JSON line per stack. `--dry-run`: the tiny model on the CPU (CPU activities only), to prove the
step runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import kvfid
from kvfid.inputs.items import load_item_set
from kvfid.inputs.models import load_model
from kvfid.protocol.decode import Runner, as_batch, new_cache
from kvfid.runs.case import load_case
from kvfid.stacks.stack import parse_stack
from kvfid.states import cache as kv

CASE = "cases/gpu-qwen2.5-shape.toml"
PARTS = ("prefill", "decode step", "token to host", "state read", "fingerprint", "compare")
REPEATS = 3
TOP = 15
# Profiler event names that count as a kernel launch, a copy to the host, a host-device sync.
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_TO_HOST = "Memcpy DtoH"


@dataclass(frozen=True)
class StackProfile:
    """One stack's parts: wall milliseconds (median), and per profiled pass the launches, copies
    to the host and syncs, with the device's and the host's busy time."""

    stack: str
    prefix_tokens: int
    wall_ms: dict            # part -> median wall ms
    launches: int            # kernel launches in the profiled pass (all parts)
    copies_to_host: int
    syncs: int
    device_ms: float         # summed self device time of every event (0 without CUDA)
    host_ms: float           # summed self CPU time of every event
    table: str               # the top ops and kernels


def _events_count(averages, names) -> int:
    return sum(e.count for e in averages if any(e.key.startswith(n) for n in names))


def _self_device_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_stack(model, stack, prefix: list[int], cuda: bool) -> StackProfile:
    """Warm up, time each part REPEATS times, then profile one pass of the parts on `stack`."""
    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with stack.activate(model) as module:
        runner = Runner(module)

        def one_pass(mark) -> dict:
            seconds, cache = {}, new_cache(module)

            def part(name, fn):
                sync()
                start = time.perf_counter()
                with mark(name):
                    value = fn()
                sync()
                seconds[name] = time.perf_counter() - start
                return value

            logits, cache = part("prefill", lambda: runner.forward(as_batch(prefix), cache))
            state = part("state read", lambda: kv.snapshot(cache.cache, prefix, logits,
                                                             config=module.config))
            part("fingerprint", lambda: (kv.sha_cache(state), kv.sha_tensor(state.logits)))
            part("compare", lambda: kv.compare_states(state, state))
            token = part("token to host", lambda: kv.top2(logits[0])[0])
            part("decode step", lambda: runner.forward(as_batch([token]), cache))
            return seconds

        one_pass(_Null)   # warm-up: compiles, caches, allocator
        passes = [one_pass(_Null) for _ in range(REPEATS)]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            one_pass(record_function)
        sync()
    averages = prof.key_averages()
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    try:
        table = averages.table(sort_by=sort_by, row_limit=TOP, max_name_column_width=60)
    except (AttributeError, KeyError):   # an older torch names the device column after CUDA
        table = averages.table(sort_by="self_cuda_time_total", row_limit=TOP,
                               max_name_column_width=60)
    return StackProfile(
        stack=stack.label, prefix_tokens=len(prefix),
        wall_ms={name: round(statistics.median(p[name] for p in passes) * 1e3, 3)
                 for name in PARTS},
        launches=_events_count(averages, LAUNCH_EVENTS),
        copies_to_host=_events_count(averages, (COPY_TO_HOST,)),
        syncs=_events_count(averages, SYNC_EVENTS),
        device_ms=round(sum(_self_device_us(e) for e in averages) / 1e3, 3),
        host_ms=round(sum(e.self_cpu_time_total for e in averages) / 1e3, 3),
        table=table)


class _Null:
    """A context that marks nothing (the timed passes run without profiler labels)."""

    def __init__(self, _name: str = "") -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def profile_case(case_path: str, dry_run: bool) -> list[StackProfile]:
    """Every distinct bf16 stack of the case (the dry run: the smoke case's model on the CPU,
    one stock and the headline stack), over the first item's prompt plus B tokens."""
    cuda = torch.cuda.is_available() and not dry_run
    case = load_case(case_path)
    if dry_run:
        stacks = [parse_stack(label, "cpu", threads=1) for label in ("sdpa/bf16", "triton/bf16+bi")]
    else:
        stacks = list(dict.fromkeys(s for s in case.stacks if s.dtype == "bf16"))
    model = load_model(case.model)
    item = load_item_set(case.items.set, 1, case.items.seed)[0]
    prompt = model.codec.prompt_ids(item.prompt)
    prefix = prompt + [prompt[-1]] * case.B   # the boundary's length; the tokens do not matter
    return [profile_stack(model, stack, prefix, cuda) for stack in stacks]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default=CASE, help=f"the case whose model and stacks (default {CASE})")
    parser.add_argument("--dry-run", action="store_true", help="the smoke case's model on the CPU")
    args = parser.parse_args(argv)
    case = "cases/smoke.toml" if args.dry_run and args.case == CASE else args.case
    profiles = profile_case(case, args.dry_run)
    for p in profiles:
        print(f"===== {p.stack}: prefix {p.prefix_tokens} tokens; wall ms (median of {REPEATS}) "
              f"{p.wall_ms}\n{p.table}", flush=True)
    for p in profiles:
        print(json.dumps({k: v for k, v in asdict(p).items() if k != "table"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
