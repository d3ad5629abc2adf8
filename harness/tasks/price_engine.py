"""The faithful vLLM engine's rows of the price table: `kvfid engine-bench` and its `--load 8`
form, run by the kvfid of vLLM's own venv (`make install-vllm`: the main venv has no vLLM) as a
subprocess, their JSON read back as rows.

engine-bench starts the stock engine, times its calls, then the faithful one: the faithful
plugin is installed process-wide while its engine lives (kvfid.engines.faithful.installed), so
the two engines cannot take turns in one process, and these rows are marked sequential, not
interleaved. The prefill row's calls are engine-bench's one-token calls over every prompt; the
decode row's, each full call less the median prefill call (engine-bench's own difference); the
load row's, seconds per generated token of each repeat.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from kvfid.records.price import FAITHFUL, STOCK, ArmTimes, PriceRow

SEQUENTIAL = "sequential (engine-bench: the stock engine's calls, then the faithful engine's)"
# engine-bench on 8 prompts x 32 tokens; under load, 16 requests of 32 tokens from 8 clients in
# 18 KV blocks.
BENCH = ("-n", "8", "--tokens", "32")
LOAD = ("--load", "8", "-n", "16", "--tokens", "32", "--kv-blocks", "18")


def engine_command(plan, load: bool) -> list[str]:
    """The engine-bench command line the row runs (the venv's kvfid, JSON out)."""
    return [str(Path(plan.vllm_venv) / "bin" / "kvfid"), "engine-bench", "--format", "json",
            "--model", plan.engine_model, "--dtype", plan.faithful.split("/")[1].split("+")[0],
            "--threads", str(plan.threads), *(LOAD if load else BENCH)]


def bench_rows(result: dict, command: list[str], seconds: float) -> list[PriceRow]:
    """engine-bench's JSON (kvfid.engines.bench.engine_bench) as a prefill and a decode row."""
    engines, label = result["engines"], result["engine"]
    model, prompts = result["model"], result["prompts"]
    note = (f"{prompts} prompts, {engines[STOCK]['prompt_tokens']} prompt tokens, "
            f"{result['tokens']} tokens each; `{' '.join(command[1:])}`")
    rows = []
    for phase in ("prefill", "decode"):
        arms = []
        for name in (STOCK, FAITHFUL):
            m = engines[name]
            walls = m["prefill_wall_s"] if phase == "prefill" else \
                [f - statistics.median(m["prefill_wall_s"]) for f in m["full_wall_s"]]
            arms.append(ArmTimes(name, f"{label} {name}, {m.get('threads', '-')} thread(s)", tuple(walls)))
        unit = ("a call (one token each)" if phase == "prefill"
                else f"a call's {result['tokens'] - 1} decode steps")
        rows.append(PriceRow(model, f"engine {phase}", result["tokens"], prompts, unit, SEQUENTIAL,
                             tuple(arms), result["repeats"], seconds, note=note))
    return rows


def load_rows(result: dict, command: list[str], seconds: float) -> list[PriceRow]:
    """engine-bench --load's JSON (kvfid.engines.bench.load_bench) as one row."""
    label = result["engine"]
    arms = tuple(ArmTimes(name, f"{label} {name}, {result['engines'][name].get('threads', '-')} "
                          f"thread(s)", tuple(1 / r for r in result["engines"][name]["repeats"]))
                 for name in (STOCK, FAITHFUL))
    return [PriceRow(result["model"], f"engine load {result['clients']}", result["tokens"],
                     result["requests"], "a generated token", SEQUENTIAL, arms,
                     len(arms[0].wall_s), seconds,
                     note=f"{result['requests']} requests from {result['clients']} clients, "
                          f"{result['kv_blocks']} KV blocks; `{' '.join(command[1:])}`")]


def _skipped(plan, load: bool, why: str) -> list[PriceRow]:
    phases = [f"engine load {LOAD[1]}"] if load else ["engine prefill", "engine decode"]
    return [PriceRow(plan.engine_model, phase, 0, 0, "-", SEQUENTIAL, skipped=why) for phase in phases]


def engine_rows(plan, left, say) -> list[PriceRow]:
    """engine-bench and its --load form in vLLM's venv, each stopped where the budget ends
    (`left()`: seconds left); a row that could not run is shown skipped with why."""
    rows = []
    for load in (False, True):
        command = engine_command(plan, load)
        if not Path(command[0]).is_file():
            rows += _skipped(plan, load, f"no vLLM venv at {plan.vllm_venv} (`make install-vllm`)")
            continue
        if left() <= 0:
            rows += _skipped(plan, load, f"the {plan.budget_s:.0f} s budget is spent")
            continue
        say(f"engine: {' '.join(command[1:])} (at most {left():.0f} s)")
        begun = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=left())
        except subprocess.TimeoutExpired:
            rows += _skipped(plan, load, f"stopped after {time.monotonic() - begun:.0f} s: over "
                                         f"the {plan.budget_s:.0f} s budget")
            continue
        seconds = time.monotonic() - begun
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            rows += _skipped(plan, load, f"engine-bench failed (exit {done.returncode}): {last}")
            continue
        result = json.loads(done.stdout)
        rows += (load_rows if load else bench_rows)(result, command, seconds)
    return rows
