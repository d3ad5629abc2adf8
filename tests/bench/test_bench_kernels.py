"""Kernel benchmarks (pytest-benchmark): `pytest tests/bench --benchmark-only`, not `make test`.

Cases are data (the tables below); the timer is pytest-benchmark's. On a machine without CUDA the
Triton kernels run in the interpreter, so these numbers say what a CPU harness run costs, not what
the kernels cost on a GPU. Each result records its environment in `extra_info`. Outside a
`--benchmark-only` run (e.g. `pytest tests`) the module skips itself, to keep the test budget.
"""

from __future__ import annotations

import math
import platform

import pytest
import torch
import torch.nn.functional as F

import kernels  # noqa: F401  (selects the Triton interpreter without CUDA)
import triton
from kernels.attention import attention
from kernels.matmul import matmul
from kernels.mode import set_batch_invariant_mode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# SmolLM2-135M attention: 9 query heads, 3 KV heads, head dim 64; a decode step over ~128 keys.
DECODE = dict(n_q_heads=9, n_kv_heads=3, head_dim=64, context=128)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MATMUL_SHAPES = [(1, 576, 576), (1, 576, 1536), (16, 576, 576)]  # (M, K, N): decode and a small chunk


@pytest.fixture(autouse=True)
def _only_when_benchmarking(request):
    if not request.config.getoption("benchmark_only", default=False):
        pytest.skip("benchmarks run with --benchmark-only")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def environment() -> dict:
    return {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else cpu_model(),
            "torch": torch.__version__, "triton": triton.__version__,
            "threads": torch.get_num_threads(), "interpreter": DEVICE.type != "cuda"}


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def run(benchmark, fn, rounds: int):
    benchmark.extra_info.update(environment())
    benchmark.pedantic(lambda: (fn(), sync()), rounds=rounds, iterations=1, warmup_rounds=1)


# ---- attention: one decode step ----------------------------------------------------------------

def decode_inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    shape = DECODE
    q = torch.randn(1, shape["n_q_heads"], 1, shape["head_dim"], generator=gen)
    k, v = (torch.randn(1, shape["n_kv_heads"], shape["context"], shape["head_dim"], generator=gen)
            for _ in range(2))
    return [t.to(dtype).to(DEVICE) for t in (q, k, v)]


def eager_decode(q, k, v):
    """transformers' eager attention for one query: repeat KV heads, matmul, softmax, matmul."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


ATTENTION = {
    "triton": lambda q, k, v: attention(q, k, v),
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    "eager": eager_decode,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ATTENTION)
def test_bench_attention_decode_step(benchmark, impl, dtype):
    benchmark.group = f"attention decode step, SmolLM2 shape, context {DECODE['context']}, {dtype}"
    q, k, v = decode_inputs(DTYPES[dtype])
    run(benchmark, lambda: ATTENTION[impl](q, k, v), rounds=10 if impl == "triton" else 50)


# ---- matmul ------------------------------------------------------------------------------------

MATMUL = {  # name -> (function, batch-invariant mode it runs under, or None)
    "triton": (lambda a, w: matmul(a, w.t()), None),
    "torch.mm": (lambda a, w: torch.mm(a, w.t()), None),
    "rowwise-mode": (lambda a, w: F.linear(a, w), "rowwise"),  # mode entered once, outside the timer
}


@pytest.mark.parametrize("shape", MATMUL_SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("impl", MATMUL)
def test_bench_matmul(benchmark, impl, shape):
    m, k, n = shape
    benchmark.group = f"matmul fp32 M={m} K={k} N={n}"
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(m, k, generator=gen).to(DEVICE), torch.randn(n, k, generator=gen).to(DEVICE)
    fn, mode = MATMUL[impl]
    with set_batch_invariant_mode(enabled=mode is not None, impl=mode or "triton"):
        run(benchmark, lambda: fn(a, w), rounds=10 if impl == "triton" else 50)
