"""Known values for kvfid.runs.stats: the seed paper's Wilson bounds, textbook McNemar and Newcombe."""

import math
import random

import numpy as np
import pytest

from kvfid.runs.stats import (
    histogram,
    mcnemar_exact,
    median,
    paired_difference,
    quantiles,
    wilson_interval,
)


# --- Wilson -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, upper_percent", [(200, 1.88), (8, 32.4), (5, 43.4)])
def test_wilson_upper_bounds_quoted_by_the_seed_paper(n, upper_percent):
    low, high = wilson_interval(0, n)
    assert low == 0.0
    assert round(100 * high, 1 if n < 100 else 2) == upper_percent


def test_wilson_known_interior_value():
    # 8/10: score interval 0.4902 to 0.9433 (the textbook example, z = 1.96).
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4901625, abs=1e-6)
    assert high == pytest.approx(0.9433178, abs=1e-6)


def test_wilson_is_symmetric_under_swapping_successes_and_failures():
    for k, n in [(0, 7), (3, 10), (5, 10), (17, 40)]:
        low, high = wilson_interval(k, n)
        mirror_low, mirror_high = wilson_interval(n - k, n)
        assert low == pytest.approx(1 - mirror_high, abs=1e-15)
        assert high == pytest.approx(1 - mirror_low, abs=1e-15)


def test_wilson_all_successes_and_empty():
    assert wilson_interval(5, 5)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_wilson_interval_contains_the_estimate_and_narrows_with_n():
    low, high = wilson_interval(30, 100)
    assert low < 0.3 < high
    assert wilson_interval(300, 1000)[1] - wilson_interval(300, 1000)[0] < high - low


@pytest.mark.parametrize("k, n", [(-1, 5), (6, 5), (0, -1)])
def test_wilson_rejects_impossible_counts(k, n):
    with pytest.raises(ValueError):
        wilson_interval(k, n)


# --- McNemar ------------------------------------------------------------------------------------

def test_mcnemar_known_value():
    assert mcnemar_exact(1, 9) == 0.021484375  # 2 * (1 + 10) / 2**10, exactly


def test_mcnemar_is_symmetric_and_capped_at_one():
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 1) == 1.0


def test_mcnemar_extremes():
    assert mcnemar_exact(0, 6) == 2 / 2**6
    assert mcnemar_exact(0, 1000) == 2.0**-999  # big-integer ratio: no overflow, no rounding to 0
    assert 0.0 < mcnemar_exact(1500, 1600) < 0.1


def test_mcnemar_rejects_negative_counts():
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 3)


# --- paired difference --------------------------------------------------------------------------

def _paired(both_right, a_only, b_only, both_wrong):
    a = [True] * both_right + [True] * a_only + [False] * b_only + [False] * both_wrong
    b = [True] * both_right + [False] * a_only + [True] * b_only + [False] * both_wrong
    return a, b


def test_paired_difference_matches_newcombe_method_10_textbook_example():
    # Cavo et al. 2012 as worked in Fagerland, Lydersen & Laake, "Statistical Analysis of
    # Contingency Tables", ch. 8: table [[59, 6], [16, 80]], Newcombe -0.0621 (-0.1186 to -0.0046),
    # exact McNemar p = 0.052.
    a, b = _paired(both_right=59, a_only=16, b_only=6, both_wrong=80)
    r = paired_difference(a, b)
    assert r.n == 161
    assert r.difference == pytest.approx(-10 / 161)
    assert round(r.ci_low, 4) == -0.1186
    assert round(r.ci_high, 4) == -0.0046
    assert round(r.mcnemar_p, 3) == 0.052
    assert (r.a_right_b_wrong, r.a_wrong_b_right) == (16, 6)
    assert (r.both_right, r.both_wrong) == (59, 80)
    assert r.accuracy_a == 75 / 161 and r.accuracy_b == 65 / 161
    assert r.ci_method == "newcombe-10"


def test_paired_difference_reverses_sign_when_arms_swap():
    a, b = _paired(both_right=40, a_only=3, b_only=11, both_wrong=6)
    forward, backward = paired_difference(a, b), paired_difference(b, a)
    assert forward.difference == pytest.approx(-backward.difference)
    assert forward.ci_low == pytest.approx(-backward.ci_high)
    assert forward.ci_high == pytest.approx(-backward.ci_low)
    assert forward.mcnemar_p == backward.mcnemar_p
    assert forward.a_wrong_b_right == backward.a_right_b_wrong == 11


def test_identical_arms_have_zero_difference_and_p_one():
    a = [True, False, True, True, False]
    r = paired_difference(a, list(a))
    assert r.difference == 0.0
    assert r.ci_low < 0.0 < r.ci_high
    assert r.mcnemar_p == 1.0
    assert r.a_right_b_wrong == r.a_wrong_b_right == 0


def test_paired_difference_all_flips_stays_inside_bounds():
    r = paired_difference([False] * 10, [True] * 10)
    assert r.difference == 1.0
    assert 0.0 < r.ci_low < 1.0 and r.ci_high == 1.0
    assert r.mcnemar_p == 2 / 2**10


def test_paired_difference_empty_and_errors():
    r = paired_difference([], [])
    assert r.n == 0 and math.isnan(r.difference)
    assert (r.ci_low, r.ci_high, r.mcnemar_p) == (-1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([True], [True, False])
    with pytest.raises(ValueError, match="None"):
        paired_difference([True, None], [True, False])


# --- quantiles and histogram --------------------------------------------------------------------

def test_quantiles_match_numpy_default():
    rng = random.Random(0)
    for _ in range(200):
        xs = [rng.randint(0, 60) for _ in range(rng.randint(1, 25))]
        qs = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, rng.random()]
        assert quantiles(xs, qs) == pytest.approx(np.quantile(xs, qs).tolist(), abs=1e-12)


def test_quantiles_known_values_and_empty():
    assert quantiles([1, 2, 3, 4]) == [1.75, 2.5, 3.25]
    assert quantiles([7]) == [7.0, 7.0, 7.0]
    assert all(math.isnan(q) for q in quantiles([]))
    assert median([5, 1, 3]) == 3.0
    assert median([4, 1, 3, 2]) == 2.5
    assert math.isnan(median([]))
    with pytest.raises(ValueError):
        quantiles([1, 2], [1.5])


def test_histogram_with_bin_count_covers_every_value():
    rows = histogram([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert rows == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 12, 1)]
    assert histogram([5, 5, 5], 3) == [(5, 6, 3)]  # one integer: one bin, not empty trailers
    assert histogram([], 3) == []
    assert histogram([2, 9], 1) == [(2, 10, 2)]


def test_histogram_with_edges():
    assert histogram([0, 1, 2, 9], [0, 2, 10]) == [(0, 2, 2), (2, 10, 2)]
    assert histogram(np.array([3, 3]), [0, 4]) == [(0, 4, 2)]
    with pytest.raises(ValueError, match="outside"):
        histogram([10], [0, 2, 10])
    with pytest.raises(ValueError, match="increasing"):
        histogram([1], [3, 3])


def test_histogram_refuses_non_integers_and_zero_bins():
    with pytest.raises(ValueError, match="integers"):
        histogram([1.5], 2)
    with pytest.raises(ValueError):
        histogram([1], 0)
