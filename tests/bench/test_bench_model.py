"""Model step benchmarks: one SmolLM2-135M forward step per stack and prefix length, `pytest
tests/bench --benchmark-only -k model`.

Declared as data (MODEL_STACKS, PHASES, CONTEXTS): a decode step (one token after a cache of the
context's length) and a prefill (the context's tokens into a fresh cache), on the stock stack
(sdpa/bf16, the ratio's baseline), the native faithful stack (native attention + the
batch-invariant mode, kvfid.kernels.attention.native) and the Triton faithful stack, whose attention runs
in the Triton interpreter on a CPU (its cost reported beside the native one, never as the kernel's
GPU speed). CONTEXTS is the scale curve: how the cost of faithfulness grows with the prefix. Per
context, every prefill runs before any decode step, and the decode steps read the cache the
baseline's timed prefill left (only the step is timed); where that prefill was over the bench's
budget and skipped, the cache the first stack's timed prefill left at that length (a bf16 cache
of the same shape: a decode step's cost does not depend on which stack wrote it; the result says
which). The fp32 model's next-token logits are the references every stack's result is checked
against (a fast wrong stack is not a result). The thread count is the bench session's (one by default). kvfid.reports.benchreport
puts each stack's median and its ratio to the baseline of the same run and context in its "Model
steps" table, and the medians by context in its scale curve.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from kvfid import kernels
from kvfid.stacks.stack import parse_stack
from kvfid.protocol.decode import cache_keyword, new_cache
from kvfid.kernels.invariant import route as mode_route

from test_bench_kernels import budget, device_clock, schedule

MODEL = "smollm2-135m"
CONTEXT = 64  # the headline prefix length (the ratios the targets are read at)
CONTEXTS = (CONTEXT, 512, 2048)  # the scale curve
BASELINE = "sdpa/bf16"
TRITON = "triton/bf16+bi"
# sdpa/fp32: the stock stack of the CPU default case's other dtype (what `kvfid bench` sizes that
# case by, kvfid.tasks.bench.item_seconds), at the headline length only.
FP32 = "sdpa/fp32"
MODEL_STACKS = (BASELINE, "native/bf16+bi", TRITON, FP32)
# Prefills first, at each length: the baseline's timed prefill (or, where it is skipped as over
# budget, another stack's) leaves the cache the decode steps read. No untimed prefill of that
# length: on a CPU where stock bf16 rows are slow (an AVX2-only EPYC) the baseline's long prefill
# would dominate the decode step's time (docs/hazards.md, "The bench's model steps").
PHASES = ("prefill", "decode")
# In the interpreter a SmolLM2 step takes seconds even at the headline length, and the work grows
# with the keys each query tile reads: the interpreted stack runs at the headline length only (on a
# GPU it runs compiled, at every length).
INTERPRETED_CONTEXTS = (CONTEXT,) if kernels.interpreting() else CONTEXTS
ONE_ROUND_FROM = 2048  # a prefill this long: one timed call, no warm-up (seconds to a minute a call)
# A step of seconds is timed fewer times: 3 rounds after a warm-up call of LONG_STEP_S or more, and
# one round after a warm-up of ONE_CALL_S or more (or with no warm-up where the same stack's
# shorter prefill, scaled linearly, says it would take that long): the default schedule's 5 rounds
# and 2 untimed calls of a step of seconds would take most of the bench's budget.
LONG_STEP_S = 1.0
LONG_STEP_ROUNDS = 3
ONE_CALL_S = 5.0
# A prefill whose time, scaled linearly from the same stack's longest shorter prefill timed in
# this session (for the long part's first, an untimed headline-length prefill), would pass this is
# not run (said in the skip): stock bf16 rows are slow on an AVX2-only CPU. The nearest length,
# not the shortest: it predicts the long prefill better (docs/hazards.md, "The bench's model
# steps").
LONG_CALL_BUDGET_S = 90.0
# The longest context is the long part (`--bench-part long`, tests/bench/conftest.py): `kvfid
# bench` times it in a second process beside the rest on a CPU of two cores or more; only the
# longest context, so that the two parts take about as long (docs/hazards.md, "The bench's model
# steps").
LONG_CONTEXT = CONTEXTS[-1]
PARAMS = [pytest.param(context, phase, label, id=f"{context}-{label}-{phase}",
                       marks=[pytest.mark.bench_long] if context == LONG_CONTEXT else [])
          for context in CONTEXTS for phase in PHASES for label in MODEL_STACKS
          if (label != TRITON or context in INTERPRETED_CONTEXTS)
          and (label != FP32 or context == CONTEXT)]

pytestmark = pytest.mark.benchmark(timer=device_clock)


@pytest.fixture(scope="module")
def smollm2():
    from kvfid.inputs.models import ModelUnavailable, load_model

    try:
        return load_model(MODEL)
    except ModelUnavailable as err:
        pytest.skip(str(err))


def _ids(context: int) -> torch.Tensor:
    return torch.randint(100, 40000, (1, context), generator=torch.Generator().manual_seed(0))


def _prefill(module, ids: torch.Tensor):
    """The ids into a fresh cache: (the cache, the last position's logits)."""
    cache = new_cache(module).cache
    logits = module(input_ids=ids, use_cache=True, logits_to_keep=1,
                    **{cache_keyword(module): cache}).logits
    return cache, logits


@pytest.fixture(scope="module")
def built():
    """Per context, built once: the baseline's cache, the fp32 model's next-token logits."""
    return {}


def _decode_cache(built, model, ids, stack):
    """A copy of the cache the decode steps of the stack's dtype at this length read, and the
    stack that built it: the one a timed prefill of that dtype left (the baseline's, else the
    first stack's), or where none ran (a `-k` selection of decode steps), the baseline's prefill
    in that dtype, untimed. Not the fp32 model's cast to bf16: a bf16 decode step over that cast
    cache was 4.3 from the fp32 logits at 512 tokens (0.8 over its own stack's cache), past the
    check below."""
    key = ("cache", ids.shape[1], stack.dtype)
    if key not in built:
        builder = parse_stack(BASELINE, device=stack.device).with_dtype(stack.dtype)
        with builder.activate(model) as module:
            built[key] = (_prefill(module, ids)[0], builder.label)
    cache, label = built[key]
    return copy.deepcopy(cache), label


def _fp32(built, model, ids, device) -> dict:
    """The fp32 model's next-token logits after the ids and after one more step (the references),
    from one run per context."""
    key = ("fp32", ids.shape[1])
    if key not in built:
        with parse_stack("sdpa/fp32", device=device).activate(model) as module:
            keyword, cache = cache_keyword(module), new_cache(module).cache
            step = lambda x: module(input_ids=x, use_cache=True, logits_to_keep=1,  # noqa: E731
                                    **{keyword: cache}).logits[0, -1].float()
            built[key] = {"prefill": step(ids), "decode": step(ids[:, -1:])}
    return built[key]


def _headline_prefill_s(model, stack) -> float:
    """Seconds of one headline-length prefill of the stack, its second call (the first warms
    up): what sizes the long part's first prefill of that stack, in a process that has not timed
    its headline prefill (`--bench-part long`), instead of a warm-up call of the long length
    (which costs as much as the step it warms up)."""
    ids = _ids(CONTEXT).to(stack.device)
    with stack.activate(model) as module:
        _prefill(module, ids)
        start = device_clock()
        _prefill(module, ids)
        return device_clock() - start


def _rounds(step, budget_s: float) -> int:
    """Timed rounds for a model step after one warm-up call (probes of new call shapes,
    allocations): 1 after a warm-up of ONE_CALL_S or more, 3 after one of LONG_STEP_S or more,
    else the kernel benches' schedule (5 to 50 rounds in about `budget_s`)."""
    start = device_clock()
    step()
    took = device_clock() - start
    if took >= ONE_CALL_S:
        return 1
    if took >= LONG_STEP_S:
        return LONG_STEP_ROUNDS
    return schedule(step, budget_s=budget_s)[0]


@pytest.mark.parametrize("context,phase,label", PARAMS)
def test_bench_model(benchmark, request, smollm2, built, phase, context, label):
    benchmark.group = f"model-{phase}-{MODEL}-ctx{context}"
    stack = parse_stack(label, device="cuda" if torch.cuda.is_available() else "cpu",
                        threads=torch.get_num_threads())
    ids = _ids(context).to(stack.device)
    interpreted = stack.backend == "triton" and kernels.interpreting()
    if phase == "prefill" and context > CONTEXT and not interpreted \
            and ("prefill_s", label) not in built:
        built["prefill_s", label] = (CONTEXT, _headline_prefill_s(smollm2, stack))
    nearest = built.get(("prefill_s", label))   # (context, median s)
    estimate = nearest[1] * context / nearest[0] if nearest and phase == "prefill" else 0.0
    if estimate > LONG_CALL_BUDGET_S:
        pytest.skip(f"{label} prefill of {context} tokens: about {estimate:.0f} s from its "
                    f"{nearest[0]}-token prefill ({nearest[1]:.2f} s), over {LONG_CALL_BUDGET_S:.0f} s")
    cache, cache_from = (_decode_cache(built, smollm2, ids, stack) if phase == "decode"
                         else (None, None))
    with stack.activate(smollm2) as module:
        keyword = cache_keyword(module)

        def decode():
            logits = module(input_ids=ids[:, -1:], use_cache=True, logits_to_keep=1,
                            **{keyword: cache}).logits
            cache.crop(-1)  # back to `context` tokens: every round times the same step
            return logits

        step = decode if phase == "decode" else (lambda: _prefill(module, ids))
        if interpreted:
            # Seconds per call: one timed call after one warm-up, as the other stacks' steps
            # have (the first call is the slowest; later ones agree closely: docs/hazards.md,
            # "The bench's model steps").
            step()
            rounds = 1
        elif phase == "prefill" and (context >= ONE_ROUND_FROM or estimate >= ONE_CALL_S):
            rounds = 1   # seconds per call: one timed call (the bench's budget)
        else:
            rounds = _rounds(step, budget(request.config, 2.0))
        cpu = time.thread_time()
        result = benchmark.pedantic(step, rounds=rounds, iterations=1)  # the last call's
        # This thread's CPU seconds per call beside the wall median: on a shared machine other
        # jobs stretch wall time several-fold, CPU time much less.
        cpu_s = (time.thread_time() - cpu) / rounds
        logits = (result if phase == "decode" else result[1])[0, -1].float()
        routes = mode_route.routes() if stack.batch_invariant_impl == "tiled" else {}
    # A fast wrong stack is not a result: its next-token logits must be those of the fp32 model.
    torch.testing.assert_close(logits, _fp32(built, smollm2, ids, stack.device)[phase], atol=0.5, rtol=0.05)
    if phase == "prefill" and context >= built.get(("prefill_s", label), (0,))[0]:
        built["prefill_s", label] = (context, benchmark.stats.stats.median)   # the longest yet
    if phase == "prefill" and (label == BASELINE or ("cache", context, stack.dtype) not in built):
        built["cache", context, stack.dtype] = (result[0], label)   # the last call's cache
    benchmark.extra_info.update({
        "op": "model", "phase": phase, "stack": label, "baseline": BASELINE, "model": MODEL,
        "context": context, "threads": torch.get_num_threads(), "interpreter": interpreted,
        "batch_invariant_impl": stack.batch_invariant_impl, "cpu_s_per_call": cpu_s,
        "tiled_routes": {name: r["route"] for name, r in routes.items()},
        **({"cache_from": cache_from} if phase == "decode" else {}),
    })
