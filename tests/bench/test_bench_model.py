"""Model step benchmarks: one SmolLM2-135M forward step per stack, `pytest tests/bench
--benchmark-only -k model`.

Declared as data (MODEL_STACKS, PHASES): a decode step (one token after a 64-token cache) and a
prefill (64 tokens into a fresh cache), on the stock stack (sdpa/bf16, the ratio's baseline), the
native faithful stack (native attention + the batch-invariant mode, kernels.attention_native) and
the Triton faithful stack, whose attention runs in the Triton interpreter on a CPU (its cost
reported beside the native one, never as the kernel's GPU speed; the cache its decode step reads
is built by the baseline stack, since only the step is timed and an interpreted prefill costs
seconds). The thread count is the bench
session's (one by default). harness.reports.benchreport puts each stack's median and its ratio to
the baseline of the same run in its "Model steps" table.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from harness.protocol.backends import parse_stack
from harness.protocol.decode import cache_keyword, new_cache

from test_bench_kernels import budget, device_clock, schedule

MODEL = "smollm2-135m"
CONTEXT = 64  # tokens in the cache a decode step sees; tokens a prefill feeds
BASELINE = "sdpa/bf16"
MODEL_STACKS = (BASELINE, "native/bf16+bi", "triton/bf16+bi")
PHASES = ("decode", "prefill")
INTERPRETER_ROUNDS = 1  # a Triton stack in the interpreter: seconds per call (no warm-up needed)

pytestmark = pytest.mark.benchmark(timer=device_clock)


@pytest.fixture(scope="module")
def smollm2():
    from harness.protocol.models import ModelUnavailable, load_model

    try:
        return load_model(MODEL)
    except ModelUnavailable as err:
        pytest.skip(str(err))


def _ids() -> torch.Tensor:
    return torch.randint(100, 40000, (1, CONTEXT), generator=torch.Generator().manual_seed(0))


def _prefill(module, ids: torch.Tensor):
    """CONTEXT tokens into a fresh cache: (the cache, the last position's logits)."""
    cache = new_cache(module)
    logits = module(input_ids=ids, use_cache=True, logits_to_keep=1,
                    **{cache_keyword(module): cache}).logits
    return cache, logits


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("label", MODEL_STACKS)
def test_bench_model(benchmark, request, smollm2, phase, label):
    benchmark.group = f"model-{phase}-{MODEL}-ctx{CONTEXT}"
    stack = parse_stack(label, device="cuda" if torch.cuda.is_available() else "cpu",
                        threads=torch.get_num_threads())
    ids = _ids().to(stack.device)
    interpreted = stack.backend == "triton" and kernels.interpreting()
    cache = None
    if phase == "decode" and interpreted:   # the cache a decode step reads, built without the
        with parse_stack(BASELINE, device=stack.device).activate(smollm2) as module:  # interpreter
            cache = _prefill(module, ids)[0]
    with stack.activate(smollm2) as module:
        keyword = cache_keyword(module)
        prefill = lambda: _prefill(module, ids)  # noqa: E731
        if phase == "decode" and cache is None:
            cache = prefill()[0]

        def decode():
            logits = module(input_ids=ids[:, -1:], use_cache=True, logits_to_keep=1,
                            **{keyword: cache}).logits
            cache.crop(-1)  # back to CONTEXT tokens: every round times the same step
            return logits

        step = decode if phase == "decode" else prefill
        if interpreted:
            rounds = INTERPRETER_ROUNDS
        else:
            rounds, _ = schedule(step, budget_s=budget(request.config, 2.0))
        result = benchmark.pedantic(step, rounds=rounds, iterations=1)  # the last call's
        logits = (result if phase == "decode" else result[1])[0, -1].float()
    # A fast wrong stack is not a result: its next-token logits must be those of the fp32 model.
    with parse_stack("sdpa/fp32", device=stack.device).activate(smollm2) as module:
        keyword = cache_keyword(module)
        cache = new_cache(module)
        if phase == "decode":
            module(input_ids=ids, use_cache=True, **{keyword: cache})
            reference = module(input_ids=ids[:, -1:], use_cache=True, **{keyword: cache}).logits
        else:
            reference = module(input_ids=ids, use_cache=True, **{keyword: cache}).logits
    torch.testing.assert_close(logits, reference[0, -1].float(), atol=0.5, rtol=0.05)
    benchmark.extra_info.update({
        "op": "model", "phase": phase, "stack": label, "baseline": BASELINE, "model": MODEL,
        "context": CONTEXT, "threads": torch.get_num_threads(), "interpreter": interpreted,
        "batch_invariant_impl": stack.batch_invariant_impl,
    })
