"""The |delta logprob| distribution of a replay: decade bins, every token counted once."""

import random

from kvfid.diagnoses.replay import aggregate, delta_decades


def test_decade_bins_at_their_bounds():
    counts = dict(delta_decades([0.0, 0.0, 1e-12, 1e-9, 9.99e-9, 1e-8, 3e-4, 0.1, 0.999, 1.0, 40.0]))
    assert counts["0"] == 2 and counts["<1e-9"] == 1
    assert counts["1e-9"] == 2 and counts["1e-8"] == 1    # [1e-9, 1e-8) then [1e-8, 1e-7)
    assert counts["1e-4"] == 1 and counts["1e-1"] == 2 and counts["1e0"] == 2


def test_every_token_in_exactly_one_bin():
    rng = random.Random(0)
    deltas = [0.0] * 7 + [10 ** rng.uniform(-12, 2) for _ in range(500)]
    rows = delta_decades(deltas)
    assert sum(n for _, n in rows) == len(deltas)
    assert [label for label, _ in rows][:3] == ["0", "<1e-9", "1e-9"]


def test_aggregate_carries_the_distribution():
    row = {"tokens": 3, "differ": 2, "abs_deltas": [0.0, 2e-3, 0.5], "kl_mean": 0.0,
           "first_position": 1}
    out = aggregate([row, {**row, "differ": 0, "abs_deltas": [0.0, 0.0, 0.0], "first_position": None}])
    assert dict(out["abs_delta_decades"]) == {**dict(delta_decades([])), "0": 4, "1e-3": 1, "1e-1": 1}
