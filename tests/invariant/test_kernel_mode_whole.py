"""kvfid.kernels.invariant.whole: one stock call per product where a probe shows it gives every
row the bits of its floor's tile; the floor, the ceiling, the tiles above it, the kept spans.

The probe's own verdicts are held against kernels variant by construction (a path below five
rows, a path above 300 rows, a split chosen from every row count): they fail on any machine. The
stock kernels under a whole-call route are held to the invariance itself (a row alone equals the
row in every batch and sequence), whatever floor this machine's probe finds.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import BATCH_SIZES, assert_bitwise_equal, assert_close_to_ref, randn

from kvfid.kernels.invariant import route as mode_route, tiled as mode_tiled, whole
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.invariant.route import Route

CPU = torch.device("cpu")
WIDTH, OUT = 24, 16


@pytest.fixture
def fresh_spans(monkeypatch, tmp_path):
    """This process's spans and routes forgotten, the stores in tmp_path, restored afterwards."""
    monkeypatch.setattr(whole, "_spans", {})
    monkeypatch.setattr(mode_route, "_routes", {})
    monkeypatch.setattr(mode_route, "_records", {})
    monkeypatch.setenv("KVFID_CACHE", str(tmp_path))
    monkeypatch.delenv(mode_route.PIN_ENV, raising=False)
    return tmp_path


def _weight() -> torch.Tensor:
    return randn(WIDTH, OUT, seed=7, on="cpu")


def by_rows(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """t @ w one row at a time (a vector-matrix product each): a row's bits whatever the count."""
    return torch.stack([row @ w for row in t])


def split_product(t: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    """by_rows with K cut in `splits` parts, each rounded to bf16 before the parts are added:
    other bits than by_rows on any machine."""
    parts = [by_rows(a, b).bfloat16().float() for a, b in zip(t.tensor_split(splits, 1), w.tensor_split(splits, 0))]
    return sum(parts[1:], parts[0])


def path_below(rows_limit: int):
    """A product that takes another path (split K) for calls of fewer than `rows_limit` rows."""
    w = _weight()
    return lambda t: split_product(t, w, 2) if t.shape[0] < rows_limit else by_rows(t, w)


def path_above(rows_limit: int):
    """A product that takes another path for calls of more than `rows_limit` rows."""
    w = _weight()
    return lambda t: split_product(t, w, 3) if t.shape[0] > rows_limit else by_rows(t, w)


def _span(name: str, fn, rows: int) -> whole.Span:
    return whole.span((name, WIDTH, None, torch.float32), fn, rows, WIDTH, torch.float32, CPU, 1.0, False)


def _alone(fn, rows: torch.Tensor, floor: int) -> torch.Tensor:
    """Each row alone at place 0 of a zero tile of `floor` rows: the bits a span must give it."""
    outs = []
    for i in range(rows.shape[0]):
        tile = rows.new_zeros(floor, rows.shape[1])
        tile[0] = rows[i]
        outs.append(fn(tile)[:1])
    return torch.cat(outs)


def test_the_sample_takes_both_sides_of_each_power_of_two_and_the_ceiling():
    assert whole.sample(64, 256) == [65, 99, 127, 128, 129, 195, 255, 256]
    assert whole.sample(256, 1024) == [257, 387, 511, 512, 513, 771, 1023, 1024]
    assert whole.sample(256, 256) == []


def test_a_kernel_with_another_path_below_five_rows_gets_floor_eight(fresh_spans):
    fn = path_below(5)
    served = _span("below-five", fn, 100)
    assert (served.floor, served.ceiling, served.probed, served.small) == (8, 256, 256, 0), served
    rows = randn(40, WIDTH, on="cpu")
    for m in (1, 3, 8, 13, 40):      # padded to 8, one call, a row alone at place 0: one set of bits
        assert_bitwise_equal(whole.call(fn, rows[:m], served), _alone(fn, rows[:m], 8), f"{m} rows")


def test_a_kernel_with_another_path_for_17_to_48_rows_serves_1_to_16_rows_as_they_are(fresh_spans):
    """The AMX shape of a kernel: one path for a few rows and from 49 on (the same bits), another
    between: floor 64, and 1 to 16 rows one call unpadded; 20 rows padded to 64."""
    w = _weight()
    seen = []
    def fn(t):
        seen.append(t.shape[0])
        return split_product(t, w, 2) if 17 <= t.shape[0] <= 48 else by_rows(t, w)
    served = _span("band", fn, 100)
    assert (served.floor, served.small) == (64, 16), served
    assert "1 to 16 rows as they are" in served.why
    rows = randn(40, WIDTH, on="cpu")
    for m, calls in ((1, [1]), (16, [16]), (17, [64]), (40, [64])):
        seen.clear()
        out = whole.call(fn, rows[:m], served)
        assert seen == calls, (m, seen)
        assert_bitwise_equal(out, _alone(fn, rows[:m], 64), f"{m} rows")
    assert not torch.equal(fn(rows[:20]), _alone(fn, rows[:20], 64))   # the control: the band differs


@pytest.mark.parametrize("band_cheaper", [True, False])
def test_a_kernel_with_one_path_to_32_rows_and_another_above_keeps_the_cheaper_of_band_and_floor(
        fresh_spans, monkeypatch, band_cheaper):
    """The AMX shape of a kernel: one path up to 32 rows, another from 33 on (each consistent):
    the band (one call to 32 rows, tiles of 32 above) or floor 64 (the other path), whichever
    the timing says costs less (stood in for here); either gives every row one set of bits."""
    w = _weight()
    seen = []
    def fn(t):
        seen.append(t.shape[0])
        return by_rows(t, w) if t.shape[0] <= 32 else split_product(t, w, 2)
    costs = iter([1.0, 2.0] if band_cheaper else [2.0, 1.0])
    monkeypatch.setattr(whole, "_cost_ms", lambda *a: next(costs))
    served = _span("two paths", fn, 100)
    rows = randn(100, WIDTH, on="cpu")
    if band_cheaper:
        assert (served.floor, served.ceiling, served.tile) == (1, 32, 32), served
        assert "floor 64: 2 ms" in served.why
        expect = {1: [1], 32: [32], 100: [32, 32, 32, 32]}
        alone = _alone(fn, rows, 1)
    else:
        assert (served.floor, served.tile) == (64, 0) and served.ceiling >= 256, served
        assert "floor 1 with tiles of 32: 2 ms" in served.why
        expect = {1: [64], 32: [64], 100: [100]}
        alone = _alone(fn, rows, 64)
    for m, calls in expect.items():
        seen.clear()
        out = whole.call(fn, rows[:m], served)
        assert seen == calls, (m, seen)
        assert_bitwise_equal(out, alone[:m], f"{m} rows")
    assert not torch.equal(fn(rows), _alone(fn, rows, 1))    # the control: the two paths differ


def test_control_a_split_chosen_from_every_row_count_has_no_floor_and_runs_in_tiles(fresh_spans):
    w = _weight()
    twin = lambda t: split_product(t, w, 1 if t.shape[0] == 1 else 2 + t.shape[0] % 2)  # noqa: E731
    served = _span("twin", twin, 40)
    assert served.floor is None and "no floor up to 64 rows" in served.why, served
    rows = randn(40, WIDTH, on="cpu")
    out = mode_tiled.by_tiles(("twin", WIDTH, None, torch.float32), twin, rows, route=Route(4, whole=True))
    assert_bitwise_equal(out, whole.in_tiles(twin, rows, 4), "tiles of the route's 4 rows")


def test_a_kernel_switching_path_above_300_rows_stops_the_ceiling_below_it(fresh_spans):
    fn = path_above(300)
    first = _span("above-300", fn, 100)
    assert (first.floor, first.ceiling, first.probed) == (1, 256, 256)
    extended = _span("above-300", fn, 1000)       # the probe follows the call: sample (256, 1024]
    assert (extended.floor, extended.ceiling, extended.probed) == (1, 257, 1024), extended
    assert "tiles of 1 above" in extended.why
    rows = randn(600, WIDTH, on="cpu")
    out = whole.call(fn, rows, extended)          # above the ceiling: tiles of the floor
    assert_bitwise_equal(out, _alone(fn, rows, 1), "600 rows")
    assert not torch.equal(fn(rows), out)         # the control: one call there differs


def test_a_span_is_kept_per_machine_and_read_back_by_another_process(fresh_spans, monkeypatch):
    fn = path_below(3)
    served = _span("kept", fn, 10)
    kept = json.loads((fresh_spans / whole.STORE).read_text())
    (record,) = kept.values()
    assert record == {f"kept [M, {WIDTH}] float32": {"floor": 4, "ceiling": 256, "probed": 256,
                                                       "why": served.why, "small": 0, "tile": 0}}
    monkeypatch.setattr(whole, "_spans", {})
    monkeypatch.setattr(whole, "_find", lambda *a: pytest.fail("probed again"))
    assert _span("kept", fn, 200) == served
    assert any(v["call"].startswith("kept [M, 24] float32") and v["floor"] == 4 for v in whole.verdicts())
    assert any(name.startswith("kept [M, 24] float32 @t") for name in whole.kept())


def test_without_a_writable_store_a_span_is_probed_and_not_kept(fresh_spans, monkeypatch):
    blocked = fresh_spans / "blocked"
    blocked.write_text("a file where the store's folder would be")
    monkeypatch.setenv("KVFID_CACHE", str(blocked / "below"))
    assert _span("unkept", path_below(2), 10).floor == 2
    assert not (blocked / "below").exists()


WHOLE_ROUTES = (Route(1, whole=True), Route(16, whole=True), Route(4, widen=True, whole=True))


@pytest.mark.parametrize("route", WHOLE_ROUTES, ids=lambda r: r.spec())
def test_under_a_whole_call_route_a_row_has_its_bits_in_any_batch_and_sequence(fresh_spans, monkeypatch, route):
    """Stock linear rows (addmm) under each whole-call route: a row alone equals the row in every
    batch and inside one [1, T, K] sequence, bit for bit, whatever floor this machine's probe
    found (or none: the tiles); the span says what it found."""
    monkeypatch.setenv(mode_route.PIN_ENV, f"bf16={route.spec()}")
    x = randn(max(BATCH_SIZES), 96, dtype=torch.bfloat16, on="cpu")
    layer = torch.nn.Linear(96, 80).to(torch.bfloat16)
    with torch.inference_mode(), set_batch_invariant_mode(impl="tiled"):
        alone = [layer(x[i:i + 1].clone()) for i in range(x.shape[0])]
        for n in BATCH_SIZES:
            out = layer(x[:n].clone())
            for i in range(n):
                assert_bitwise_equal(out[i:i + 1], alone[i], f"row {i} of {n}")
        sequence = layer(x[None, :40].clone())[0]
        for t in range(40):
            assert_bitwise_equal(sequence[t:t + 1], alone[t], f"position {t}")
    spans = [v for v in whole.verdicts() if v["call"].startswith("addmm [M, 96] x [96, 80]")]
    assert len(spans) == 1 and ("widened to fp32" in spans[0]["call"]) == route.widen, spans
    assert spans[0]["floor"] is not None or "no floor" in spans[0]["why"]


def test_a_whole_call_product_is_close_to_the_fp64_product(fresh_spans, monkeypatch):
    monkeypatch.setenv(mode_route.PIN_ENV, "bf16=whole:1")
    a, b = randn(70, 96, dtype=torch.bfloat16, on="cpu"), randn(96, 80, dtype=torch.bfloat16, on="cpu")
    with torch.inference_mode(), set_batch_invariant_mode(impl="tiled"):
        out = torch.mm(a, b)
    assert_close_to_ref(out, a.double() @ b.double(), torch.bfloat16)


def test_a_span_of_floor_one_is_the_stock_call_itself_and_any_other_floor_goes_through_the_span(
        fresh_spans, monkeypatch):
    """Under a stock whole-call route, a product whose span has floor 1 and covers its rows is
    the stock call on the rows as they are (`whole.call` never runs); with floor 4 (the control)
    `whole.call` serves it and pads the rows to 4."""
    monkeypatch.setenv(mode_route.PIN_ENV, "fp32=whole:1")
    x, w = randn(3, 96, seed=1, on="cpu"), randn(40, 96, seed=2, on="cpu")
    stock = torch.nn.functional.linear(x, w)
    chained = []
    real = whole.call
    monkeypatch.setattr(whole, "call", lambda fn, rows, served: chained.append(rows.shape[0]) or
                        real(fn, rows, served))
    with set_batch_invariant_mode(impl="tiled"):
        torch.nn.functional.linear(x, w)                     # probes the span of this key
    (key, widen, threads), = [k for k in whole._spans if k[0][0] == "mm"]
    for floor, through in ((1, []), (4, [3])):
        whole._spans[key, widen, threads] = whole.Span(floor, 64, 64, f"floor {floor}, given")
        chained.clear()
        with set_batch_invariant_mode(impl="tiled"):
            out = torch.nn.functional.linear(x, w)
        assert chained == through
        if floor == 1:
            assert_bitwise_equal(out, stock, "the stock call's bits")


def ordered_product(t: torch.Tensor, w: torch.Tensor, reverse: bool) -> torch.Tensor:
    """t @ w [M, N] with each output's terms added in fp32 one by one, first to last or last to
    first, and rounded once to t's dtype: the same function, two orders (exact in IEEE fp32 on
    any machine: an element-wise multiply and add per term)."""
    acc = torch.zeros(t.shape[0], w.shape[1])
    for k in (reversed(range(t.shape[1])) if reverse else range(t.shape[1])):
        acc = acc + t[:, k:k + 1].float() * w[k].float()
    return acc.to(t.dtype)


def test_a_probe_reveals_a_change_of_summation_order_that_random_rows_hide():
    # A kernel that adds a row's terms in another order when it has company: bf16 rounds the two
    # fp32 sums alike almost always, so random rows pass it; revealing rows on a stand-in operand
    # change by whole small terms and fail it at one row.
    w = randn(WIDTH, OUT, seed=7, on="cpu").bfloat16()
    order_by_count = lambda t, b: ordered_product(t, b, reverse=t.shape[0] > 1)   # noqa: E731
    one_order = lambda t, b: ordered_product(t, b, reverse=False)                  # noqa: E731
    on_random_rows = whole.parts(lambda t: order_by_count(t, w), 1.0, reveal=False)
    assert whole._find(on_random_rows, WIDTH, torch.bfloat16, CPU, 0).floor == 1
    revealed = whole.floor_of(lambda t: order_by_count(t, w), WIDTH, torch.bfloat16, CPU,
                              probe=lambda: mode_tiled.on_stand_in(order_by_count, w))
    assert revealed == 2     # a one-row call takes the other order; from two rows on, one order
    assert whole.floor_of(lambda t: one_order(t, w), WIDTH, torch.bfloat16, CPU,
                          probe=lambda: mode_tiled.on_stand_in(one_order, w)) == 1


def test_revealing_rows_cancel_on_a_stand_in_and_keep_every_small_term_in_exact_arithmetic():
    rows = whole.revealing_rows(8, WIDTH, torch.bfloat16, CPU, seed=3)   # [8, WIDTH]
    operand = whole.stand_in(torch.empty(OUT, WIDTH, dtype=torch.bfloat16).t())   # [WIDTH, OUT]
    assert operand.stride() == (1, WIDTH)   # the operand's layout, kept
    exact = rows.double() @ operand.double()   # [8, OUT]: the big pairs cancel in every column
    small = rows.double().abs() < 1
    assert (rows.double().abs()[~small] == whole.BIG).all() and (~small).sum(1).eq(2 * whole.PAIRS).all()
    assert torch.equal(exact, (rows.double() * small) @ operand.double())
