"""The kernels on a real GPU (tl.dot path) at model-sized shapes, and their variant twins.

The other kernel tests also run on CUDA when it is present (their tensors go to `device()`); these
add shapes too large for the interpreter. The controls are the deliberately variant twins
(kvfid.stacks.twins), which differ on any GPU; whether stock cuBLAS varies is machine-dependent and is
a finding of `kvfid kernels` (its stock probes), not a test assumption.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import BATCH_SIZES, DTYPE_IDS, DTYPES, assert_close_to_ref, bits_equal, randn

from kvfid.stacks.twins import attention_twin, matmul_twin
from kvfid.kernels.attention.kernel import attention, attention_ref
from kvfid.kernels.invariant.matmul import matmul

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


randn = partial(randn, on="cuda")  # the GPU tests' inputs live on the GPU


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)], ids=["smollm2", "llama-8b"])
def test_gpu_attention_every_position_same_bits(heads, dtype):
    n_q, n_kv, head_dim = heads
    length = 301
    q, k, v = randn(1, n_q, length, head_dim, dtype=dtype), *(randn(1, n_kv, length, head_dim, dtype=dtype,
                                                                   seed=s) for s in (1, 2))
    prefill = attention(q, k, v)
    assert_close_to_ref(prefill, attention_ref(q.double(), k.double(), v.double()), dtype)
    for chunk in (1, 7, 64):
        out = torch.cat([attention(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk])
                         for s in range(0, length, chunk)], dim=2)
        bad = [t for t in range(length) if not bits_equal(out[:, :, t], prefill[:, :, t])]
        assert not bad, f"chunks of {chunk}: positions {bad} differ from prefill"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_matmul_every_row_alone_equals_row_in_any_batch(dtype):
    pool, w = randn(max(BATCH_SIZES), 2048, dtype=dtype), randn(4096, 2048, dtype=dtype, seed=1)
    alone = [matmul(pool[i:i + 1], w.t()) for i in range(max(BATCH_SIZES))]
    for n in BATCH_SIZES:
        out = matmul(pool[:n], w.t())
        bad = [i for i in range(n) if not bits_equal(out[i:i + 1], alone[i])]
        assert not bad, f"batch of {n}: rows {bad} differ from alone"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_control_the_batch_check_catches_the_matmul_twin(dtype):
    pool, w = randn(max(BATCH_SIZES), 2048, dtype=dtype), randn(4096, 2048, dtype=dtype, seed=1)
    alone = matmul_twin(pool[:1], w)
    assert all(not bits_equal(matmul_twin(pool[:n], w)[:1], alone) for n in BATCH_SIZES)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_control_the_construction_check_catches_the_attention_twin(dtype):
    q, k, v = (randn(1, h, 301, 64, dtype=dtype, seed=s) for s, h in enumerate((9, 3, 3)))
    prefill = attention_twin(q, k, v)
    steps = torch.cat([attention_twin(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1])
                       for t in range(301)], dim=2)
    assert any(not bits_equal(steps[:, :, t], prefill[:, :, t]) for t in range(1, 301))


# ---- the mechanism variants at model shapes (windows over a window cache, softcap, sinks, MLA) ---

GPU_VARIANTS = {  # name: (Hq, Hkv, q/k dim, v dim, keyword arguments)
    "mistral-window": (32, 8, 128, 128, {"window": 256}),
    "gemma2-window-softcap-d256": (16, 8, 256, 256, {"window": 256, "softcap": 50.0}),
    "gpt-oss-window-sinks": (64, 8, 64, 64, {"window": 128}),
    "deepseek-mla": (16, 16, 192, 128, {}),
    "llama4-chunk": (40, 8, 128, 128, {"chunk": 192}),
}


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("name", GPU_VARIANTS)
def test_gpu_variant_window_cache_decode_same_bits_as_prefill(name, dtype):
    from kvfid.kernels.attention.kernel import attention_into

    n_q, n_kv, qk_dim, v_dim, kwargs = GPU_VARIANTS[name]
    if name == "gpt-oss-window-sinks":
        kwargs = {**kwargs, "sinks": randn(n_q, seed=9)}
    length = 600
    q = randn(1, n_q, length, qk_dim, dtype=dtype)
    k, v = randn(1, n_kv, length, qk_dim, dtype=dtype, seed=1), randn(1, n_kv, length, v_dim, dtype=dtype, seed=2)
    prefill = attention(q, k, v, **kwargs)
    ref_kwargs = {n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in kwargs.items()}
    assert_close_to_ref(prefill, attention_ref(q.double(), k.double(), v.double(), **ref_kwargs), dtype)
    held = max(kwargs.get("window", 0), kwargs.get("chunk", 0)) - 1
    for absolute in (True, False):  # the kernel, then its held-aligned twin (must differ if local)
        steps = []
        for t in range(length):
            start = max(0, t - held) if held > 0 else 0
            out = torch.empty(1, n_q, 1, v_dim, dtype=dtype, device=q.device)
            steps.append(attention_into(out, q[:, :, t:t + 1], k[:, :, start:t + 1], v[:, :, start:t + 1],
                                        key_start=start, align_absolute=absolute, **kwargs))
        steps = torch.cat(steps, dim=2)
        twin_prefill = prefill if absolute else attention_into(torch.empty_like(prefill), q, k, v,
                                                               align_absolute=False, **kwargs)
        bad = [t for t in range(length) if not bits_equal(steps[:, :, t], twin_prefill[:, :, t])]
        if absolute:
            assert not bad, f"{name}: decode over a window cache differs from prefill at {bad[:10]}"
        elif held > 0:
            assert bad, f"{name}: the held-aligned twin was not caught"
