"""What the kernel tests share: seeded inputs, the test device, tolerances, the two checks.

Imported explicitly (`from helpers import ...`). Two kinds of check, never mixed:
`assert_close_to_ref` (tolerance, keyed by dtype, stated once here) and `assert_bitwise_equal`
(fidelity: `torch.equal`, reporting the exact difference).
"""

from __future__ import annotations

import torch

from kvfid.protocol.decode import cache_keyword  # noqa: F401  (the one compatibility point)
from kvfid.states.cache import bits, bits_equal

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ("fp32", "bf16", "fp16")

# Correctness against an fp64 reference: (atol, rtol) per dtype, for every kernel.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 2e-2),
}

# Batch sizes a row is placed among for the bitwise batch-invariance checks.
BATCH_SIZES = (2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 128)
# Rows of each batch an interpreted row-tiled kernel's batch check compares with the row alone
# (each row alone is its own launch, and the interpreter pays per launch): every batch's first
# and last row, the rows one below, at and one above each 16-row tile edge up to 64, and two rows
# inside tiles. Checks of stock-op paths compare every row.
CHECKED_ROWS = tuple(sorted({0, 1, 7, 15, 16, 17, 31, 32, 33, 63, 64, 100} | {n - 1 for n in BATCH_SIZES}))


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(*shape, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0,
          gen: torch.Generator | None = None, on: torch.device | str | None = None) -> torch.Tensor:
    """Seeded normal values, drawn in fp32 on the CPU (so every device and dtype sees the same
    numbers), times `scale`, cast to `dtype`, on `on` (default: `device()`). `gen` continues a
    generator the caller shares across tensors; else a fresh one is seeded with `seed`."""
    x = torch.randn(*shape, generator=gen if gen is not None else torch.Generator().manual_seed(seed))
    if scale != 1.0:
        x = x * scale
    return x.to(dtype).to(device() if on is None else on)


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Correctness: `out` (in `dtype`) against an fp64 reference, with the dtype's tolerance."""
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected {dtype}"
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Fidelity: identical bits. On failure, say where and by exactly how much."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    if bits_equal(a, b):
        return
    differ = bits(a) != bits(b)
    raise AssertionError(f"{what}: not bitwise equal: {int(differ.sum())} of {a.numel()} elements "
                         f"differ, max |diff| = {max_abs_diff(a, b)!r}, first at {differ.nonzero()[0].tolist()}")


def tiny_model(kind: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-weight 2-layer Llama or Qwen2 (hidden 128, 4 heads, 2 KV heads), fp32, eval mode,
    on `device()`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_cls(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        **overrides)
    torch.manual_seed(seed)
    return model_cls(config).eval().to(device())


def differing_positions(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Positions t (dim 2) whose [B, H, D] slices are not bitwise equal."""
    return [t for t in range(a.shape[2]) if not bits_equal(a[:, :, t], b[:, :, t])]


def probe_in_batches(attention, dtype: torch.dtype, sizes, on=None):
    """An attention's batch check: a probe sequence (a 3-query chunk over 21 keys, 2 query heads
    over 1 KV head) computed alone and as the last row among other sequences in a batch of each
    size. Yields (n, the probe's row of the batch of n, the probe alone)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (randn(max(sizes), h, 21, 16, dtype=dtype, gen=gen, on=on) for h in (2, 1, 1))
    q = q[:, :, -3:]
    probe = [t[-1:] for t in (q, k, v)]
    alone = attention(*probe)
    for n in sizes:
        yield n, attention(*(torch.cat([t[:n - 1], p]) for t, p in zip((q, k, v), probe)))[-1:], alone


def check_rejects_bad_inputs(attention, make_qkv) -> None:
    """An attention's contract: GQA needs Hq a multiple of Hkv, no more queries than keys, and
    fp64 is refused."""
    import pytest

    q, k, v = make_qkv(1, 3, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v)  # 3 query heads over 2 kv heads
    q, k, v = make_qkv(1, 2, 1, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="Tq <= Tk"):
        attention(torch.cat([q, q], dim=2), k, v)
    with pytest.raises(TypeError):
        attention(q.double(), k.double(), v.double())
