"""The seed paper's endpoints of a small stored run, held against values computed by hand.

The run is made of hand-written records stored in a ledger and read back: a stock stack on 161
items whose correctness table is Fagerland, Lydersen & Laake's worked example of Newcombe's
paired interval (the one tests/runs/test_stats.py holds), 24 items whose prefill suffix diverges at
indices chosen here, transplants both ways with seeded controls, a faithful stack on the first 8
items, and a crossing on the first 20. Every number asserted below is worked out in its comment.
Its controls: the same run with one record changed reads differently.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from kvfid.ledger.store import Ledger
from kvfid.records import record as rec
from kvfid.reports.paper_report import PAPER, is_paper_design
from kvfid.reports.report import aggregate, write_report
from kvfid.runs.case import load_case
from kvfid.tasks.ledger_views import show_run

Z2 = 1.959963984540054 ** 2        # z^2 = 3.841459
STOCK, FAITHFUL = "sdpa/bf16@t1", "native/bf16+bi@t1"
FP32 = "sdpa/fp32@t1"
N, S, CROSSED, FAITHFUL_ITEMS = 161, 48, 20, 8
CASE_TEXT = f"""
name = "paper-small"
model = "smollm2-135m"
B = 32
S = {S}
constructions = ["live", "prefill", "incremental"]
[items]
set = "arith"
n = {N}
[[stacks]]
backends = ["sdpa"]
dtypes = ["bf16"]
threads = 1
[[stacks]]
backends = ["native"]
dtypes = ["bf16"]
batch_invariant = [true]
threads = 1
items = {FAITHFUL_ITEMS}
[replicas]
arms = ["live", "prefill"]
[crossing]
reference = "sdpa/bf16"
dtypes = ["bf16", "fp32"]
items = {CROSSED}
[transplants]
pairs = ["live<-prefill", "prefill<-live"]
controls = 8
seed = 8
"""
# Correctness, live (a) then prefill (b), by item index: Fagerland et al.'s table
# [[59, 6], [16, 80]]: 59 both right, 16 live right only, 6 prefill right only, 80 both wrong.
LIVE_ONLY, PREFILL_ONLY = range(59, 75), range(75, 81)
# The 24 items whose prefill suffix differs from live's: the 22 flips and two both wrong, with the
# first-divergence index of each (item 59's is 0: its boundary argmax differs).
FIRST = dict(zip(range(59, 83), [0, 5, 8, 9, 12, 14, 15, 17, 20, 21, 22, 25, 26, 28, 30, 31, 33,
                                 36, 38, 40, 41, 44, 45, 47]))
CONTROLS = [11, 21, 32, 35, 49, 58, 94, 96]    # random.Random(8).sample(range(161), 8), sorted
CHANGED_CONTROL = 32                           # prefill<-live changes this control's suffix
THIRD = (70, 71)                               # prefill<-live: neither suffix on these two
D_K, D_V = (0.0, 0.004), (0.0, 0.006)          # d_rel per layer of every stock item


def _diff(bit_exact: bool) -> rec.CacheDiff:
    layers = tuple(rec.LayerDiff(i, rec.TensorDiff(equal=bit_exact, d_rel=0.0 if bit_exact else
                                                   D_K[i]),
                                 rec.TensorDiff(equal=bit_exact, d_rel=0.0 if bit_exact else
                                                D_V[i])) for i in range(2))
    return rec.CacheDiff(bit_exact=bit_exact, first_bad_layer=None if bit_exact else 1,
                         d_rel=0.0 if bit_exact else D_V[1], layers=layers)


def _comparison(a, b, kind, first=None, bit_exact=True):
    return rec.Comparison(a, b, kind, rec.SuffixDiff(identical=first is None,
                                                     first_divergence=first),
                          cache=_diff(bit_exact),
                          logits=rec.LogitsDiff(equal=bit_exact, argmax_agree=first != 0))


def _item(index: int, stack: str) -> rec.ItemRecord:
    stock = stack == STOCK
    first = FIRST.get(index) if stock else None
    live_right = index < 75
    prefill_right = index < 59 or index in PREFILL_ONLY
    live_suffix = tuple(range(S))
    prefill_suffix = live_suffix if first is None else live_suffix[:first] + (999,) * (S - first)
    arm = lambda label, suffix, right, cache: rec.ArmRecord(
        label, suffix, (1.0,) * S, correct=right if stock else live_right, cache_sha=cache)
    arms = {"live": arm("live", live_suffix, live_right, "c-live"),
            "prefill": arm("prefill", prefill_suffix, prefill_right,
                           "c-prefill" if stock else "c-live"),
            "incremental": arm("incremental", live_suffix, live_right, "c-live")}
    replicas = tuple(rec.Replica(a, rec.Fingerprints(), _comparison(a, a, "replica"))
                     for a in ("live", "prefill"))
    return rec.ItemRecord(
        rec.ItemRef(f"arith-{index:04d}", f"p{index}", "1"), "smollm2-135m",
        {"label": stack, "batch_invariant": not stock},
        32, S, "ok", prompt_length=4, prefix=(1, 2), prefix_sha="p", arms=arms,
        comparisons=(_comparison("live", "prefill", "arm", first, bit_exact=not stock),
                     _comparison("live", "incremental", "bridge")),
        replicas=replicas, transplants=_transplants(index, first))


def _transplants(index: int, first) -> tuple:
    if first is None and index not in CONTROLS:
        return ()      # the plan transplants divergent rows, and every row of a control item

    def outcome(pair):
        if first == 0:
            return "boundary"
        if first is None:
            return "third" if pair == "prefill<-live" and index == CHANGED_CONTROL else "recipient"
        return "third" if pair == "prefill<-live" and index in THIRD else "donor"

    return tuple(rec.TransplantRecord(f"{pair}:all", *pair.split("<-"), "all", first is None,
                                      outcome(pair)) for pair in ("live<-prefill", "prefill<-live"))


def _crossing(index: int) -> rec.CrossingRecord:
    cells = tuple(rec.CrossingCell(stack, c, rec.Fingerprints(), same_as_reference_live=True)
                  for stack in (STOCK, FP32) for c in ("incremental", "prefill"))
    within = tuple(rec.StackComparison(stack, _comparison(
        "incremental", "prefill", "crossing",
        3 if stack == STOCK and index in (3, 7) else None, bit_exact=False))
        for stack in (STOCK, FP32))
    return rec.CrossingRecord(rec.ItemRef(f"arith-{index:04d}"), {"label": STOCK}, 32, S, "ok",
                              prefix_sha="p", cells=cells, within=within)


def _store(path: Path, tmp_path: Path, change=None) -> tuple[Ledger, str]:
    case_file = tmp_path / "paper-small.toml"
    case_file.write_text(CASE_TEXT)
    case = load_case(case_file)
    assert case.transplants.control_indices(N) == tuple(CONTROLS)
    with Ledger(path) as ledger:
        ledger.create_run("r1", case, {"gpus": [], "cpu": {"model": "Test CPU"}}, "cpu/none/x")
        units = [(i, STOCK, _item(i, STOCK)) for i in range(N)]
        units += [(i, FAITHFUL, _item(i, FAITHFUL)) for i in range(FAITHFUL_ITEMS)]
        units += [(i, rec.CrossingRecord.UNIT, _crossing(i)) for i in range(CROSSED)]
        for index, stack, record in units:
            record = change(index, stack, record) if change else record
            ledger.write_unit("r1", index, f"arith-{index:04d}", stack, record, "cpu/none/x")
        ledger.finish("r1")
    return path


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paper")
    return _store(tmp / "l.sqlite", tmp)


@pytest.fixture(scope="module")
def ends(stored):
    with Ledger(stored, readonly=True) as ledger:
        summary = aggregate(ledger.units("r1"), ledger.run("r1").design)
    assert is_paper_design(summary)
    return summary.endpoints


def wilson(k, n):
    """Wilson's score interval written out once more, for the interior cases below."""
    p = k / n
    centre = (p + Z2 / (2 * n)) / (1 + Z2 / n)
    half = Z2 ** 0.5 / (1 + Z2 / n) * (p * (1 - p) / n + Z2 / (4 * n * n)) ** 0.5
    return centre - half, centre + half


def test_disagreement_and_its_wilson_interval(ends):
    d = ends[STOCK].disagreement
    assert (d.k, d.n) == (24, 161)
    # p = 24/161 = 0.149068; centre (p + z²/322)/(1 + z²/161) = 0.160998/1.023860 = 0.157246;
    # half 1.914289 * sqrt(p(1-p)/161 + z²/103684) = 1.914289 * 0.0287214 = 0.054981
    assert [round(x, 4) for x in d.ci] == [0.1023, 0.2122]
    assert d.ci == pytest.approx(wilson(24, 161), abs=1e-12)
    f = ends[FAITHFUL].disagreement
    # 0 of n: the upper bound is z²/(n + z²) = 3.841459/11.841459 (the paper's 32.4% for 0/8)
    assert (f.k, f.n, f.ci[0]) == (0, 8, 0.0)
    assert f.ci[1] == pytest.approx(Z2 / (8 + Z2)) and round(f.ci[1], 3) == 0.324


def test_replica_floors_exact_within_construction(ends):
    for arm in ("live", "prefill"):
        r = ends[STOCK].replicas[arm]
        assert (r.k, r.n, r.cache_bit_exact) == (0, 161, 161)
        assert r.ci[1] == pytest.approx(Z2 / (161 + Z2))      # 0.023304


def test_flips_and_the_paired_interval(ends):
    p = ends[STOCK].correctness
    assert (p.a_right_b_wrong, p.a_wrong_b_right, p.n) == (16, 6, 161)    # 22 labels flip
    # Fagerland et al.: -10/161 = -0.0621, Newcombe's interval (-0.1186, -0.0046), McNemar 0.052
    assert p.difference == pytest.approx(-10 / 161)
    assert (round(p.ci_low, 4), round(p.ci_high, 4)) == (-0.1186, -0.0046)
    assert round(p.mcnemar_p, 3) == 0.052


def test_first_divergence_median_quartiles_range_and_histogram(ends):
    d = ends[STOCK].first_divergence
    assert (d.horizon, d.n, d.low, d.high) == (S, 24, 0, 47)
    # 24 sorted values: median between the 12th and 13th (25, 26); q1 at rank 5.75 between
    # 14 and 15; q3 at rank 17.25 between 36 and 38
    assert (d.median, d.q1, d.q3) == (25.5, 14.75, 36.5)
    # S/8 = 6 wide: [0,6) 0 5; [6,12) 8 9; [12,18) 12 14 15 17; [18,24) 20 21 22; [24,30) 25 26
    # 28; [30,36) 30 31 33; [36,42) 36 38 40 41; [42,48) 44 45 47
    assert d.histogram == ((0, 6, 2), (6, 12, 2), (12, 18, 4), (18, 24, 3), (24, 30, 3),
                           (30, 36, 3), (36, 42, 4), (42, 48, 3))
    assert ends[FAITHFUL].first_divergence.n == 0


def test_the_fixed_prefix_crossing_and_the_bridge(ends):
    x = ends[STOCK].crossing
    assert x.prefix == STOCK
    assert (x.suffix_differs.k, x.suffix_differs.n, x.cache_bit_exact) == (2, 20, 0)
    # 2/20: centre 0.196037/1.192073 = 0.164450, half 1.644194 * 0.083072 = 0.136587
    assert [round(v, 4) for v in x.suffix_differs.ci] == [0.0279, 0.3010]
    own = ends[STOCK].own_prefix        # incremental = live, so it differs where prefill does
    assert (own.suffix_differs.k, own.suffix_differs.n, own.cache_bit_exact) == (24, 161, 0)
    faithful = ends[FAITHFUL]
    assert faithful.crossing is None
    assert (faithful.own_prefix.suffix_differs.k, faithful.own_prefix.cache_bit_exact) == (0, 8)
    b = ends[STOCK].bridge
    assert (b.cache_bit_exact.k, b.cache_bit_exact.n, b.suffix_differs.k) == (161, 161, 0)
    assert b.cache_bit_exact.ci[0] == pytest.approx(161 / (161 + Z2))   # n of n: n/(n + z²)


def test_donor_following_share_and_the_control_stratum(ends):
    live_from_prefill, prefill_from_live = ends[STOCK].transplants
    assert live_from_prefill.transplant == "live<-prefill:all"
    # 24 divergent rows, item 59's boundary argmax differs: 23 decode a suffix, all the donor's
    assert (live_from_prefill.divergent, live_from_prefill.boundary) == (24, 1)
    donor = live_from_prefill.follows_donor
    assert (donor.k, donor.n) == (23, 23) and donor.ci[0] == pytest.approx(23 / (23 + Z2))
    assert round(donor.ci[0], 4) == 0.8569
    # the other way, items 70 and 71 decode neither suffix: 21/23; centre 0.996553/1.167020 =
    # 0.853930, half 1.679461 * 0.0725768 = 0.121890
    donor = prefill_from_live.follows_donor
    assert (donor.k, donor.n) == (21, 23)
    assert [round(v, 4) for v in donor.ci] == [0.7320, 0.9758]
    # the 8 controls: none changed one way (0/8, upper 32.4%), item 32 the other way (1/8:
    # centre 0.365093/1.480182 = 0.246654, half 1.324139 * 0.169347 = 0.224240)
    unchanged, changed = live_from_prefill.controls_changed, prefill_from_live.controls_changed
    assert (unchanged.k, unchanged.n, round(unchanged.ci[1], 3)) == (0, 8, 0.324)
    assert (changed.k, changed.n) == (1, 8)
    assert [round(v, 3) for v in changed.ci] == [0.022, 0.471]


def test_d_rel_per_layer_is_the_median_over_items(ends):
    assert ends[STOCK].d_rel_per_layer == {"k": D_K, "v": D_V}
    assert ends[FAITHFUL].d_rel_per_layer == {"k": (0.0, 0.0), "v": (0.0, 0.0)}


def test_the_report_and_show_print_the_endpoints_and_the_side_by_side(stored, tmp_path):
    with Ledger(stored, readonly=True) as ledger:
        paths = write_report(ledger, "r1", tmp_path / "reports")
    text = paths["markdown"].read_text()
    for shown in (text, show_run(stored, "r1")):
        assert "## The paper's endpoints" in shown and "## Side by side with the paper" in shown
        assert "| live ≠ prefill suffix [95% Wilson] | 24/161 (14.9%) [10.2%, 21.2%] | " \
               "0/8 (0.0%) [0.0%, 32.4%] |" in shown
        assert "22 of 161 (16 live right, prefill wrong; 6 the reverse)" in shown
        assert "-6.2 points [-11.9, -0.5]" in shown
        assert "median 25.5 [14.8, 36.5], range 0-47 (24 diverging; S=48)" in shown
        assert "0-5: 2, 6-11: 2, 12-17: 4, 18-23: 3, 24-29: 3, 30-35: 3, 36-41: 4, 42-47: 3" \
            in shown
        assert "live<-prefill:all: 23/23 (100.0%) [85.7%, 100.0%] (1 whose boundary argmax " \
               "differs, apart)" in shown
        assert "prefill<-live:all: 1/8 (12.5%) [2.2%, 47.1%] changed" in shown
        assert "20 labels flip" in shown and "median 88, range 4-453" in shown
        assert "S=48 tokens after B=32 live tokens" in shown and "Test CPU" in shown
    plain = json.loads(paths["summary"].read_text())["endpoints"][STOCK]
    assert plain["first_divergence"]["low"] == 0 and plain["first_divergence"]["high"] == 47
    assert plain["transplants"][0]["follows_donor"]["k"] == 23


def test_every_paper_figure_names_an_endpoint_the_report_has():
    from kvfid.reports.paper_report import ENDPOINTS

    assert [f.endpoint for f in PAPER] == [key for key, _, _ in ENDPOINTS]


def test_control_one_changed_record_moves_the_endpoints(tmp_path):
    """The negative control: item 60 stored as not diverging changes every endpoint it feeds."""
    def change(index, stack, record):
        if (index, stack) != (60, STOCK):
            return record
        live = record.arms["live"]
        arms = {**record.arms, "prefill": dataclasses.replace(record.arms["prefill"],
                                                              suffix=live.suffix)}
        comparisons = (_comparison("live", "prefill", "arm", None, bit_exact=False),
                       record.comparisons[1])
        return dataclasses.replace(record, arms=arms, comparisons=comparisons, transplants=())

    path = _store(tmp_path / "l.sqlite", tmp_path, change)
    with Ledger(path, readonly=True) as ledger:
        changed = aggregate(ledger.units("r1"), ledger.run("r1").design).endpoints[STOCK]
    assert (changed.disagreement.k, changed.first_divergence.n) == (23, 23)
    assert changed.first_divergence.median != 25.5
    assert changed.transplants[0].follows_donor.n == 22
    assert changed.own_prefix.suffix_differs.k == 23


def test_the_endpoints_read_back_from_summary_json(stored):
    from kvfid.runs.summary import RunSummary

    with Ledger(stored, readonly=True) as ledger:
        summary = aggregate(ledger.units("r1"), ledger.run("r1").design)
    plain = json.loads(json.dumps(summary.to_plain()))
    assert RunSummary.from_plain(plain).endpoints == summary.endpoints
