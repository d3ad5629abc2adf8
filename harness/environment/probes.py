"""Stock probes: search a fixed grid of shapes for a witness that a stock op is not invariant.

Whether stock torch.mm gives a row alone the bits it gets inside a batch, or SDPA gives a decode
step the bits of the prefill, depends on the machine (instruction set, BLAS code path, threads):
one shape's stock bf16 mm can differ by batch on one CPU and not on another (docs/environment.md,
"CPU numerics"). So these are findings per machine, never test assumptions. Each
probe walks its grid in a fixed order and stops at the first witness: the shape, batch size or
position, and the max abs difference. No witness anywhere is reported as "stock invariant here"
(kvfid.reports.invariance_table renders them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kvfid.environment.measure import BATCH_SIZES, max_abs_diff, randn
from kvfid.states.cache import bits_equal
from kvfid.kernels import DTYPES

# (K, N): SmolLM2's k/v projection, its MLP up projection, the down projection, a small odd one.
MATMUL_GRID = ((576, 192), (576, 1536), (1536, 576), (96, 80))
# (query heads, kv heads, head dim, length): SmolLM2, a small GQA, head dim 128, Qwen2.5-0.5B.
ATTENTION_GRID = ((9, 3, 64, 130), (4, 2, 64, 64), (2, 1, 128, 40), (14, 2, 64, 96))


def mm_batch_witness(mm: Callable, dtype: torch.dtype, device: torch.device,
                     grid: Sequence[tuple[int, int]] = MATMUL_GRID,
                     batch_sizes: Sequence[int] = BATCH_SIZES) -> dict | None:
    """First (K, N, batch) where some row of `mm(x[:n], w)` differs from `mm(x[i:i+1], w)`."""
    gen = torch.Generator().manual_seed(0)
    for k, n in grid:
        x = randn(gen, max(batch_sizes), k).to(device, dtype)
        w = randn(gen, n, k, scale=k ** -0.5).to(device, dtype)
        alone = [mm(x[i:i + 1].clone(), w) for i in range(max(batch_sizes))]
        for size in batch_sizes:
            out = mm(x[:size].clone(), w)
            bad = [i for i in range(size) if not bits_equal(out[i:i + 1], alone[i])]
            if bad:
                return {"shape": f"[{size}, {k}] x [{k}, {n}]", "batch": size, "rows": len(bad),
                        "max_abs_diff": max(max_abs_diff(out[i:i + 1], alone[i]) for i in bad)}
    return None


def _sdpa(q, k, v) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)


def attention_decode_witness(attention: Callable, dtype: torch.dtype, device: torch.device,
                             grid: Sequence[tuple[int, int, int, int]] = ATTENTION_GRID) -> dict | None:
    """First (heads, head dim, length, position) where a decode step over a growing cache differs
    from the prefill of the same positions. `attention(q, k, v)`: q the last positions of k, v."""
    gen = torch.Generator().manual_seed(0)
    for n_q, n_kv, head_dim, length in grid:
        q, k, v = (randn(gen, 1, h, length, head_dim).to(device, dtype) for h in (n_q, n_kv, n_kv))
        prefill = attention(q, k, v)  # [1, Hq, T, D]
        bad = [t for t in range(length) if not bits_equal(
            attention(q[:, :, t:t + 1].clone(), k[:, :, :t + 1].clone(), v[:, :, :t + 1].clone()),
            prefill[:, :, t:t + 1])]
        if bad:
            t = bad[0]
            step = attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1])
            return {"shape": f"Hq={n_q} Hkv={n_kv} D={head_dim} T={length}", "position": t,
                    "positions": len(bad), "max_abs_diff": max_abs_diff(step, prefill[:, :, t:t + 1])}
    return None


def probe_stock(dtypes: Sequence[str], device: str = "cpu") -> list[dict]:
    """Stock mm (batch) and SDPA (decode vs prefill) per dtype: a witness, or None."""
    torch_device = torch.device(device)
    rows = []
    with torch.inference_mode():
        for dtype in dtypes:
            rows.append({"op": "mm", "check": "batch", "dtype": dtype,
                         "witness": mm_batch_witness(lambda x, w: x @ w.t(), DTYPES[dtype], torch_device)})
            rows.append({"op": "sdpa", "check": "decode vs prefill", "dtype": dtype,
                         "witness": attention_decode_witness(_sdpa, DTYPES[dtype], torch_device)})
    return rows
