"""Kernel speed benchmarks: `pytest tests/bench --benchmark-only --benchmark-json=PATH`.

Cases are data (CPU_CASES, GPU_CASES below; the GPU table is chosen when CUDA is available); each
case runs every implementation kvfid.environment.invariance registers for its op (stock torch, SDPA and
eager as transformers calls them, the Triton kernels, the batch-invariant modes), so the speed
table and the invariance table describe the same functions. The timer is pytest-benchmark's with
a device-aware clock: `time.perf_counter` on CPU; on CUDA the clock synchronizes the device first,
so a round of `iterations` launches is timed from an idle GPU to an idle GPU. On CUDA,
`triton.testing.do_bench`'s median (L2 flushed between launches) goes into `extra_info` beside it.
On a machine without CUDA the Triton kernels run in the interpreter: those numbers say what a CPU
harness run costs, not what the kernels cost on a GPU. Each result carries its bytes, FLOPs and
achieved GB/s or GFLOP/s (from the median) in `extra_info`; the environment is in machine_info.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import helpers
import pytest
import torch

from kvfid import kernels
from kvfid.environment.invariance import DTYPES, IMPLEMENTATIONS
from kvfid.kernels.invariant.mode import set_batch_invariant_mode

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def device_clock() -> float:
    """Seconds; on CUDA after the queued work is done, so a round's time is the GPU's."""
    if CUDA:
        torch.cuda.synchronize()
    return time.perf_counter()


pytestmark = pytest.mark.benchmark(timer=device_clock)


@dataclass(frozen=True)
class Case:
    """One op at one shape and dtype. Attention: batch, n_q_heads, n_kv_heads, head_dim, q_len,
    kv_len. Row ops: rows x width (matmul: [rows, width] @ [width, out])."""

    op: str
    phase: str  # "decode" or "prefill"
    dtype: str
    batch: int = 1
    n_q_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    q_len: int = 0
    kv_len: int = 0
    rows: int = 0
    width: int = 0
    out: int = 0
    skip_impls: tuple[str, ...] = ()  # too slow at this shape to be worth timing

    @property
    def id(self) -> str:
        if self.op.startswith("attention"):  # the op names the phase
            return (f"{self.op}-B{self.batch}-Hq{self.n_q_heads}-Hkv{self.n_kv_heads}-D{self.head_dim}"
                    f"-q{self.q_len}-kv{self.kv_len}-{self.dtype}")
        shape = f"M{self.rows}-K{self.width}" + (f"-N{self.out}" if self.out else "")
        return f"{self.op}-{self.phase}-{shape}-{self.dtype}"


def _attention(phase, dtype, batch, heads, context, **extra):
    n_q, n_kv, dim = heads
    q_len = 1 if phase == "decode" else context
    return Case(f"attention-{phase}", phase, dtype, batch=batch, n_q_heads=n_q, n_kv_heads=n_kv,
                head_dim=dim, q_len=q_len, kv_len=context, **extra)


def _row_ops(dtype, rows_by_phase, hidden, matmul_out, softmax_width, log_softmax_width, **extra):
    cases = []
    for phase, rows in rows_by_phase.items():
        cases += [Case("matmul", phase, dtype, rows=rows, width=hidden, out=matmul_out, **extra),
                  Case("rms-norm", phase, dtype, rows=rows, width=hidden, **extra),
                  Case("softmax", phase, dtype, rows=rows, width=softmax_width, **extra),
                  Case("log-softmax", phase, dtype, rows=rows, width=log_softmax_width, **extra)]
    return cases


SMOLLM2 = (9, 3, 64)
# CPU: SmolLM2-135M shapes, small enough for the Triton interpreter.
CPU_CASES = [
    case
    for dtype in ("fp32", "bf16")
    for case in [_attention("decode", dtype, 1, SMOLLM2, 256), _attention("prefill", dtype, 1, SMOLLM2, 64),
                 *_row_ops(dtype, {"decode": 1, "prefill": 64}, 576, 576, 2048, 4096)]
]
# GPU: decode at batch 1 and 32 over 1k and 8k keys, Qwen2.5-like (14/2 heads, dim 64) and
# Llama-like (32/8, dim 128); prefill of 2k tokens; matmul M = 1 .. 2048 at 4096 x 4096.
_ROWWISE_SLOW = ("eager+rowwise-mode", "rowwise-mode")  # a kernel launch per row at 2k rows x heads
GPU_CASES = [
    *(_attention("decode", "bf16", batch, heads, context)
      for heads in ((14, 2, 64), (32, 8, 128)) for batch in (1, 32) for context in (1024, 8192)),
    *(_attention("prefill", "bf16", 1, heads, 2048, skip_impls=_ROWWISE_SLOW)
      for heads in ((14, 2, 64), (32, 8, 128))),
    *(Case("matmul", "decode" if m <= 32 else "prefill", "bf16", rows=m, width=4096, out=4096)
      for m in (1, 16, 256, 2048)),
    *(case for case in _row_ops("bf16", {"decode": 32}, 4096, 4096, 8192, 32768)
      if case.op != "matmul"),
    *(case for case in _row_ops("bf16", {"prefill": 2048}, 4096, 4096, 8192, 32768,
                                skip_impls=("rowwise-mode",))
      if case.op != "matmul"),
]
CASES = GPU_CASES if CUDA else CPU_CASES
# The native CPU paths (plain-PyTorch tiles: a launch per tile op) are timed on CPU only; on a GPU
# the Triton kernels are the product.
CPU_PATHS = ("native", "tiled-mode", "eager+tiled-mode")

PARAMS = [pytest.param(case, impl, id=f"{case.id}-{impl.name}")
          for case in CASES for impl in IMPLEMENTATIONS.values()
          if impl.op == case.op and impl.name not in case.skip_impls and (CUDA or not impl.cpu_skip)
          and not impl.control and not (CUDA and impl.name in CPU_PATHS)]  # the variant twins are controls of the checks, not kernels to time


# ---- inputs and work per case ------------------------------------------------------------------

def inputs(case: Case) -> tuple:
    """The op's arguments, on DEVICE in the case's dtype."""
    gen = torch.Generator().manual_seed(0)
    dtype = DTYPES[case.dtype]

    def randn(*shape, scale=1.0):
        return helpers.randn(*shape, dtype=dtype, scale=scale, gen=gen, on=DEVICE)

    if case.op.startswith("attention"):
        return (randn(case.batch, case.n_q_heads, case.q_len, case.head_dim),
                randn(case.batch, case.n_kv_heads, case.kv_len, case.head_dim),
                randn(case.batch, case.n_kv_heads, case.kv_len, case.head_dim))
    if case.op == "matmul":
        return randn(case.rows, case.width), randn(case.out, case.width, scale=case.width ** -0.5)
    if case.op == "rms-norm":
        return randn(case.rows, case.width), 1 + 0.1 * randn(case.width), 1e-5
    return (randn(case.rows, case.width, scale=3.0),)


def work(case: Case) -> tuple[int, int]:
    """(bytes an ideal kernel moves, floating-point operations) for one call."""
    size = DTYPES[case.dtype].itemsize
    if case.op.startswith("attention"):
        q_bytes = case.batch * case.n_q_heads * case.q_len * case.head_dim * size
        kv_bytes = 2 * case.batch * case.n_kv_heads * case.kv_len * case.head_dim * size
        # (query, key) pairs a causal mask lets through when the queries are the last q_len keys
        pairs = case.q_len * (case.kv_len - case.q_len) + case.q_len * (case.q_len + 1) // 2
        return 2 * q_bytes + kv_bytes, 4 * case.batch * case.n_q_heads * pairs * case.head_dim
    if case.op == "matmul":
        m, k, n = case.rows, case.width, case.out
        return (m * k + k * n + m * n) * size, 2 * m * n * k
    if case.op == "rms-norm":
        return (2 * case.rows * case.width + case.width) * size, 4 * case.rows * case.width
    return 2 * case.rows * case.width * size, 4 * case.rows * case.width


def budget(config, seconds: float) -> float:
    """Seconds of timed rounds per benchmark: `seconds`, or none beyond the 5 rounds under
    `--bench-rehearsal`."""
    return 0.0 if config.getoption("bench_rehearsal", default=False) else seconds


def schedule(fn, budget_s: float) -> tuple[int, int]:
    """(rounds, iterations): a round lasts at least a millisecond; about `budget_s` in all, 5 rounds
    at least."""
    fn()  # warm-up: Triton compiles (GPU) or builds its interpreter state, caches fill
    start = device_clock()
    fn()
    once = max(device_clock() - start, 1e-7)
    iterations = max(1, math.ceil(1e-3 / once))
    rounds = max(5, min(50, int(budget_s / (once * iterations))))
    return rounds, iterations


@pytest.mark.parametrize("case,impl", PARAMS)
def test_bench(benchmark, request, case, impl):
    benchmark.group = case.id
    args = inputs(case)
    mode = contextlib.nullcontext() if impl.mode is None else set_batch_invariant_mode(impl=impl.mode)
    with mode, torch.inference_mode():  # the mode is entered once, outside the timer
        rounds, iterations = schedule(lambda: impl.run(*args),
                                      budget_s=budget(request.config, 0.3 if CUDA else 0.5))
        benchmark.pedantic(impl.run, args=args, rounds=rounds, iterations=iterations)
        do_bench_ms = None
        if CUDA:
            import triton.testing

            do_bench_ms = triton.testing.do_bench(lambda: impl.run(*args), warmup=10, rep=50,
                                                  return_mode="median")
    # A fast wrong kernel is not a result: the timed output must match the stock op's.
    stock = next(i for (op, _), i in IMPLEMENTATIONS.items() if op == case.op and not i.claims_batch)
    with mode, torch.inference_mode():
        out = impl.run(*args)
    with torch.inference_mode():
        expected = stock.run(*args)
    atol, rtol = helpers.TOLERANCES[DTYPES[case.dtype]]
    torch.testing.assert_close(out.double(), expected.double(), atol=atol, rtol=rtol)
    median = benchmark.stats.stats.median
    moved, flops = work(case)
    benchmark.extra_info.update({
        "op": case.op, "phase": case.phase, "impl": impl.name, "dtype": case.dtype,
        "mode": impl.mode, "device": str(DEVICE), "interpreter": kernels.interpreting(),
        "threads": torch.get_num_threads(),
        "timer": "perf_counter after cuda.synchronize" if CUDA else "perf_counter",
        "bytes": moved, "flops": flops,
        "gbps": moved / median / 1e9, "gflops": flops / median / 1e9,
        "do_bench_median_ms": do_bench_ms,
    })
