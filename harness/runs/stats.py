"""Small-sample statistics for fidelity rates and paired correctness.

This module owns the numbers the reports quote beside every count: Wilson score intervals for a
rate (disagreement, bit-exact, transplant outcome), the paired comparison of two arms' correctness
on the same items (accuracy difference with Newcombe's interval, flips each way, exact McNemar),
and order statistics for first-divergence indices (quantiles, median, integer histogram).
Pure Python; every function takes plain counts or sequences and returns plain floats, tuples
and lists, or for the paired comparison a frozen `PairedDifference` (NaN where there is no data).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from collections.abc import Sequence

Z_95 = 1.959963984540054  # two-sided 95% standard normal quantile


def wilson_interval(k: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval (no continuity correction) for k successes in n trials.

    n == 0 gives the uninformative (0.0, 1.0).
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"wilson_interval needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At k == 0 or k == n one bound is exactly 0 or 1; rounding must not move it off.
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return (low, high)


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: binomial test of b vs c discordant pairs at p = 1/2.

    p = min(1, 2 * P[X <= min(b, c)]) with X ~ Binomial(b + c, 1/2); b + c == 0 gives 1.0.
    """
    if b < 0 or c < 0:
        raise ValueError(f"mcnemar_exact needs non-negative counts, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    # Integer numerator and denominator: the division is exact to the last bit even for large n.
    return min(1.0, 2 * tail / 2**n)


@dataclass(frozen=True)
class PairedDifference:
    """Two arms' correctness on the same items: accuracies (NaN without items), b - a with its
    interval, the four cells of the 2x2 and McNemar's exact p."""

    n: int
    accuracy_a: float | None
    accuracy_b: float | None
    difference: float | None
    ci_low: float
    ci_high: float
    ci_method: str
    both_right: int
    both_wrong: int
    a_right_b_wrong: int
    a_wrong_b_right: int
    mcnemar_p: float


def paired_difference(a: Sequence[bool], b: Sequence[bool], z: float = Z_95) -> PairedDifference:
    """Compare two arms' correctness on the same items: accuracies, b - a, interval, flips, McNemar.

    The interval is Newcombe's method 10 (square-and-add of Wilson intervals with the
    continuity-adjusted correlation, Newcombe 1998, Stat Med 17:2635), truncated to [-1, 1].
    """
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs equal lengths, got {len(a)} and {len(b)}")
    if any(x is None for x in a) or any(x is None for x in b):
        raise ValueError("paired_difference got None (an item without a reference answer); "
                         "filter those items first")
    n = len(a)
    both_right = sum(1 for x, y in zip(a, b) if x and y)
    a_only = sum(1 for x, y in zip(a, b) if x and not y)  # a right -> b wrong
    b_only = sum(1 for x, y in zip(a, b) if not x and y)  # a wrong -> b right
    both_wrong = n - both_right - a_only - b_only
    result = PairedDifference(n, math.nan, math.nan, math.nan, -1.0, 1.0, "newcombe-10",
                              both_right, both_wrong, a_only, b_only,
                              mcnemar_exact(a_only, b_only))
    if n == 0:
        return result
    right_a, right_b = both_right + a_only, both_right + b_only
    pa, pb = right_a / n, right_b / n
    la, ua = wilson_interval(right_a, n, z)
    lb, ub = wilson_interval(right_b, n, z)
    phi = _newcombe_phi(both_right, b_only, a_only, both_wrong)
    d = pb - pa
    low = d - _square_and_add(pb - lb, ua - pa, phi)
    high = d + _square_and_add(ub - pb, pa - la, phi)
    return dataclasses.replace(result, accuracy_a=pa, accuracy_b=pb, difference=d,
                               ci_low=max(-1.0, low), ci_high=min(1.0, high))


def _square_and_add(x: float, y: float, phi: float) -> float:
    """sqrt(x^2 - 2 phi x y + y^2): the half-width of one side of Newcombe's interval."""
    return math.sqrt(max(0.0, x * x - 2 * phi * x * y + y * y))


def _newcombe_phi(n11: int, n12: int, n21: int, n22: int) -> float:
    """Correlation of the two paired proportions, with Newcombe's continuity adjustment."""
    n = n11 + n12 + n21 + n22
    margins = (n11 + n12) * (n21 + n22) * (n11 + n21) * (n12 + n22)
    if margins == 0:
        return 0.0
    cross = n11 * n22 - n12 * n21
    if cross > n / 2:
        cross -= n / 2
    elif cross >= 0:
        cross = 0
    return cross / math.sqrt(margins)


def quantiles(xs: Sequence[float], qs: Sequence[float] = (0.25, 0.5, 0.75)) -> list[float]:
    """Quantiles by linear interpolation between order statistics (numpy's default method).

    An empty xs gives NaN for every q.
    """
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q} is outside [0, 1]")
    ordered = sorted(float(x) for x in xs)
    if not ordered:
        return [math.nan for _ in qs]
    out = []
    for q in qs:
        h = (len(ordered) - 1) * q
        lo = math.floor(h)
        hi = min(lo + 1, len(ordered) - 1)
        a, b, t = ordered[lo], ordered[hi], h - lo
        # Interpolate from the nearer end, as numpy does, so the upper half rounds like it.
        out.append(a + (b - a) * t if t < 0.5 else b - (b - a) * (1 - t))
    return out


def median(xs: Sequence[float]) -> float:
    """Median (linear interpolation for an even count); NaN when xs is empty."""
    return quantiles(xs, (0.5,))[0]


def histogram(xs: Sequence[int], bins: int | Sequence[int]) -> list[tuple[int, int, int]]:
    """Histogram of integers as (lo, hi, count) rows, each bin holding lo <= x < hi.

    bins is the most equal integer-width bins to use from min(xs), or explicit increasing edges
    (values outside [edges[0], edges[-1]) raise ValueError, so nothing is dropped silently).
    """
    values = [_as_int(x) for x in xs]
    if isinstance(bins, int):
        if bins < 1:
            raise ValueError(f"histogram needs at least one bin, got {bins}")
        if not values:
            return []
        start, span = min(values), max(values) - min(values) + 1
        width = -(-span // bins)  # ceil: every value gets a bin and widths stay integers
        count = -(-span // width)  # fewer than `bins` when the values span fewer integers
        edges = [start + i * width for i in range(count + 1)]
    else:
        edges = [_as_int(e) for e in bins]
        if len(edges) < 2 or any(e1 <= e0 for e0, e1 in zip(edges, edges[1:])):
            raise ValueError(f"histogram edges must be 2+ increasing integers, got {edges}")
        outside = [x for x in values if not edges[0] <= x < edges[-1]]
        if outside:
            raise ValueError(f"histogram: {len(outside)} values outside [{edges[0]}, {edges[-1]}), "
                             f"e.g. {outside[0]}")
    counts = [0] * (len(edges) - 1)
    for x in values:
        counts[bisect.bisect_right(edges, x) - 1] += 1
    return [(edges[i], edges[i + 1], counts[i]) for i in range(len(counts))]


def _as_int(x) -> int:
    """x as an int, refusing non-integral values (first-divergence indices are integers)."""
    if isinstance(x, bool) or int(x) != x:
        raise ValueError(f"histogram takes integers, got {x!r}")
    return int(x)
