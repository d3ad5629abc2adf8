"""The slices `kvfid blame` compares: one op's tensors on the two sides, cut down to the blamed
position (its row along a query dimension, the keys up to it along a key dimension), and how
their bits compare."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfid.states.cache import bits_equal, ulp_ordered


@dataclass(frozen=True)
class Spans:
    """Which positions each side's traced call covers ([start, end)), and the position blamed."""

    a: tuple[int, int]
    b: tuple[int, int]
    position: int


def boundary(x: torch.Tensor, y: torch.Tensor, spans: Spans) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The blamed position's slices of two corresponding tensors, or None when not comparable.

    A dimension whose sizes differ is a query dimension when they are the two calls' lengths (the
    position's row is selected) and a key dimension when they are the two cache lengths after the
    calls (positions up to the blamed one are kept: causal attention sees no later key)."""
    if x.dim() != y.dim():
        return None
    (sa, ea), (sb, eb), p = spans.a, spans.b, spans.position
    for d in range(x.dim()):
        sizes = (x.shape[d], y.shape[d])
        if sizes[0] == sizes[1]:
            continue
        if sizes == (ea - sa, eb - sb):
            x, y = x.narrow(d, p - sa, 1), y.narrow(d, p - sb, 1)
        elif sizes == (ea, eb):
            x, y = x.narrow(d, 0, p + 1), y.narrow(d, 0, p + 1)
        else:
            return None
    return x, y


def compare(xs: list[torch.Tensor], ys: list[torch.Tensor], spans: Spans) -> str:
    """"equal" when every pair's slices have the same bits, "differ" when one does not,
    "unknown" when none differs but some pair cannot be compared."""
    if len(xs) != len(ys):
        return "unknown"
    verdict = "equal"
    for x, y in zip(xs, ys):
        pair = boundary(x, y, spans)
        if pair is None or pair[0].dtype != pair[1].dtype:
            verdict = "unknown"
        elif not bits_equal(*pair):
            return "differ"
    return verdict


def diff(xs: list[torch.Tensor], ys: list[torch.Tensor], spans: Spans) -> tuple[int, float, int]:
    """Elements differing, max |diff| and max ULP over the comparable output slices."""
    n, worst, ulp = 0, 0.0, 0
    for x, y in zip(xs, ys):
        pair = boundary(x, y, spans)
        if pair is None or pair[0].dtype != pair[1].dtype or bits_equal(*pair):
            continue
        x, y = (p.contiguous() for p in pair)
        n += int((x != y).sum()) or 1
        worst = max(worst, float((x.double() - y.double()).abs().max()))
        ulp = max(ulp, int((ulp_ordered(x) - ulp_ordered(y)).abs().max()))
    return n, worst, ulp
