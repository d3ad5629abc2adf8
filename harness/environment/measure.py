"""What the invariance checks (invariance.py) and the stock probes (probes.py) both measure with:
the batch sizes, seeded inputs and the largest difference; the one bitwise comparison is
kvfid.states.cache.bits_equal."""

from __future__ import annotations

import torch

BATCH_SIZES = (2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 128)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in fp64 (NaN when one side has a NaN or an inf the other lacks)."""
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def randn(gen: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal inputs (fp32, on the CPU), scaled."""
    return torch.randn(*shape, generator=gen) * scale
