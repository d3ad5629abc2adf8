"""kvfid.kernels.invariant.route: the tiled mode's tile and dtype route, chosen from timings on this machine,
kept per machine, pinnable; every route bitwise batch- and sequence-invariant (with its control)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import BATCH_SIZES, assert_bitwise_equal, randn

from kvfid.kernels.invariant import route as mode_route, tiled as mode_tiled
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.invariant.route import Route

BF16 = torch.bfloat16


@pytest.fixture
def fresh_routes(monkeypatch, tmp_path):
    """This process's routes forgotten and the store in tmp_path, restored afterwards."""
    monkeypatch.setattr(mode_route, "_routes", {})
    monkeypatch.setattr(mode_route, "_records", {})
    monkeypatch.setenv("KVFID_CACHE", str(tmp_path))
    monkeypatch.delenv(mode_route.PIN_ENV, raising=False)
    return tmp_path


def _scores(per_row_ms: float, fixed_ms: float, widened_row_ms: float, call_ms: float = 0.0):
    """A cost model: a call of T rows costs fixed + T * per_row (stock) or widened (fp32), plus
    call_ms of overhead; each route's score against the stock decode row and prefill."""
    def one(r):
        return fixed_ms + call_ms + r.tile * (widened_row_ms if r.widen else per_row_ms)
    rows = mode_route.PREFILL_ROWS
    stock = (fixed_ms + per_row_ms, fixed_ms + rows * per_row_ms)
    return {r: mode_route.score(one(r), -(-rows // r.tile) * one(r), *stock)
            for r in mode_route.candidates(BF16)}


def test_choose_keeps_large_stock_tiles_where_rows_are_nearly_free():
    scores = _scores(per_row_ms=0.001, fixed_ms=0.14, widened_row_ms=0.014)     # AMX-like
    assert mode_route.choose(scores, mode_route.candidates(BF16)) == Route(64)


def test_choose_widens_where_stock_half_precision_is_slow():
    scores = _scores(per_row_ms=1.3, fixed_ms=0.0, widened_row_ms=0.012, call_ms=0.11)  # AVX2-EPYC-like
    chosen = mode_route.choose(scores, mode_route.candidates(BF16))
    assert chosen.widen and chosen.tile <= 4


def test_choose_prefers_the_earlier_route_unless_another_is_clearly_faster():
    order = [Route(16), Route(1)]
    scores = {Route(16): 1.4, Route(1): 1.0}          # within NEAR: the earlier route
    assert mode_route.choose(scores, order) == Route(16)
    scores[Route(16)] = 2.0                            # out of the tie
    assert mode_route.choose(scores, order) == Route(1)


def test_timing_goes_on_while_a_score_is_near_the_margin():
    order = [Route(16), Route(1)]
    assert mode_route.near_margin({Route(16): 1.5, Route(1): 1.0}, order)
    assert not mode_route.near_margin({Route(16): 1.1, Route(1): 1.0}, order)
    assert not mode_route.near_margin({Route(16): 3.0, Route(1): 1.0}, order)


def test_the_candidates_lie_a_factor_four_apart_largest_first():
    assert [r.spec() for r in mode_route.candidates(BF16)] == \
        ["64", "16", "4", "1", "widen:64", "widen:16", "widen:4", "widen:1"]
    assert [r.spec() for r in mode_route.candidates(torch.float32)] == ["64", "16", "4", "1"]


def test_the_whole_call_candidates_come_first_where_the_timed_product_has_a_floor():
    assert [r.spec() for r in mode_route.candidates(BF16, {False: 1, True: 4})] == \
        ["whole:1", "64", "16", "4", "1", "widen:whole:4", "widen:64", "widen:16", "widen:4", "widen:1"]
    assert [r.spec() for r in mode_route.candidates(BF16, {False: None, True: 16})] == \
        ["64", "16", "4", "1", "widen:whole:16", "widen:64", "widen:16", "widen:4", "widen:1"]


def _floors(record: dict) -> dict[bool, int | None]:
    return {kind == "widened": floor for kind, floor in record.get("floors", {}).items()}


def test_a_timed_route_says_how_it_was_chosen():
    record = mode_route.timed(BF16, {False: 1, True: None})
    order = mode_route.candidates(BF16, _floors(record))
    assert [r.spec() for r in order][0] == "whole:1"
    assert set(record["scores"]) == {r.spec() for r in order}
    assert Route(**record["route"]) == mode_route.choose(
        {Route.from_spec(k): v for k, v in record["scores"].items()}, order)
    assert "rounds" in record["rule"] and set(record["costs_ms"]) == set(record["scores"])


def test_a_stock_floor_of_one_row_is_the_route_untimed_and_any_other_is_timed(monkeypatch):
    """Where the timed product's stock floor is one row the route is the stock call (nothing
    timed); a floor above one, or none, goes to the timing (the control)."""
    timings = []
    monkeypatch.setattr(mode_route, "timed", lambda dtype, floors: timings.append(floors) or
                        {"route": {"tile": 4, "widen": False, "whole": False}})
    for stock, chosen in ((1, Route(1, whole=True)), (4, Route(4)), (None, Route(4))):
        monkeypatch.setattr(mode_route.whole, "floor_of",
                            lambda fn, width, dtype, device, probe=None, stock=stock: stock)
        record = mode_route.measure(torch.float32)
        assert Route(**record["route"]) == chosen
        assert (stock == 1) == ("untimed" in record.get("rule", ""))
    assert timings == [{False: 4}, {False: None}]


def test_pinned_routes_parse_and_bad_ones_are_refused(monkeypatch):
    monkeypatch.setenv(mode_route.PIN_ENV, "bf16=widen:1, fp32=16, fp16=widen:whole:4")
    assert mode_route.pinned() == {BF16: Route(1, widen=True), torch.float32: Route(16),
                                   torch.float16: Route(4, widen=True, whole=True)}
    for bad in ("bf16=0", "fp32=widen:4", "int8=4", "bf16=wide:2", "bf16", "bf16=whole:widen:4",
                "fp32=whole"):
        monkeypatch.setenv(mode_route.PIN_ENV, bad)
        with pytest.raises(ValueError, match=mode_route.PIN_ENV):
            mode_route.pinned()


def test_a_route_is_timed_once_per_machine_then_read_back(fresh_routes, monkeypatch):
    first = mode_route.route(BF16, torch.device("cpu"))
    kept = json.loads((fresh_routes / "tiled-routes.json").read_text())
    assert Route(**kept[mode_route.machine_key()]["bf16"]["route"]) == first
    assert "timed now" in mode_route.routes()[f"bf16@t{torch.get_num_threads()}"]["source"]
    # A second process of this machine reads it, whatever timing would say now.
    monkeypatch.setattr(mode_route, "_routes", {})
    monkeypatch.setattr(mode_route, "measure", lambda dtype: pytest.fail("timed again"))
    assert mode_route.route(BF16, torch.device("cpu")) == first
    assert mode_route.routes()[f"bf16@t{torch.get_num_threads()}"]["source"].startswith("kept in")


def test_the_isa_variables_are_part_of_the_machine_key(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = mode_route.machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert mode_route.machine_key() != plain and "ONEDNN_MAX_CPU_ISA=AVX2" in mode_route.machine_key()


def test_a_route_kept_under_an_earlier_rule_is_not_reused(monkeypatch):
    """A store written by an earlier selection rule (another machine key) is timed again: two
    fresh choices and one kept from before never share one key."""
    key = mode_route.machine_key()
    monkeypatch.setattr(mode_route, "RULE", mode_route.RULE - 1)
    assert mode_route.machine_key() != key and key.endswith(f"rule {mode_route.RULE + 1}")


def test_a_weight_is_widened_once_per_version():
    weight = torch.nn.Parameter(randn(6, 4, dtype=BF16, on="cpu"), requires_grad=False)
    wide = mode_route.widened(weight.t())
    assert wide.dtype == torch.float32 and wide.stride() == weight.t().stride()
    assert mode_route.widened(weight.t()) is wide
    with torch.no_grad():
        weight.mul_(2)                              # a new version: widened again, new bits
    again = mode_route.widened(weight.t())
    assert again is not wide and torch.equal(again, weight.t().float())


def test_the_parts_of_a_merged_weight_are_each_widened_once():
    """Views of one Parameter (q, k, v of a merged projection, as the faithful engine splits it)
    are kept side by side: widening one does not evict another."""
    weight = torch.nn.Parameter(randn(12, 4, dtype=BF16, on="cpu"), requires_grad=False)
    parts = [w.t() for w in weight.split([6, 3, 3], 0)]
    wide = [mode_route.widened(p) for p in parts]
    assert all(mode_route.widened(p) is w for p, w in zip(parts, wide))
    assert all(torch.equal(w, p.float()) for p, w in zip(parts, wide))


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40])
def test_a_widened_product_has_the_bits_of_its_tiles_one_by_one(fresh_routes, monkeypatch, rows):
    """The widened route widens a's rows and rounds the product back once for all tiles: the bits
    of widening, multiplying and rounding each zero-padded tile of 16 rows apart."""
    monkeypatch.setenv(mode_route.PIN_ENV, "bf16=widen:16")
    a, b = randn(rows, 96, dtype=BF16, on="cpu"), randn(96, 80, dtype=BF16, on="cpu")
    tiles = []
    for start in range(0, rows, 16):
        tile = a.new_zeros(16, 96)
        tile[:min(16, rows - start)] = a[start:start + 16]
        tiles.append(torch.mm(tile.float(), b.float()).to(BF16)[:min(16, rows - start)])
    with torch.inference_mode(), set_batch_invariant_mode(impl="tiled"):
        out = torch.mm(a, b)
    assert_bitwise_equal(out, torch.cat(tiles), f"{rows} rows")


ROUTES = (Route(32), Route(8), Route(1), Route(16, widen=True), Route(1, widen=True))


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.spec())
def test_every_route_gives_a_row_its_bits_in_any_batch_and_in_a_sequence(fresh_routes, monkeypatch, route):
    """Pinned to each candidate route: linear (addmm) rows alone equal the rows in every batch
    and inside one long [1, T, K] sequence, bit for bit; widened, a row is the fp32 product of
    the exact fp32 copies, rounded once."""
    monkeypatch.setenv(mode_route.PIN_ENV, f"bf16={route.spec()}")
    x = randn(max(BATCH_SIZES), 96, dtype=BF16, on="cpu")
    layer = torch.nn.Linear(96, 80).to(BF16)
    with torch.inference_mode(), set_batch_invariant_mode(impl="tiled"):
        alone = [layer(x[i:i + 1].clone()) for i in range(x.shape[0])]
        for n in BATCH_SIZES:
            out = layer(x[:n].clone())
            for i in range(n):
                assert_bitwise_equal(out[i:i + 1], alone[i], f"row {i} of {n}")
        sequence = layer(x[None, :40].clone())[0]
        for t in range(40):
            assert_bitwise_equal(sequence[t:t + 1], alone[t], f"position {t}")
    if route.widen:
        wide = torch.addmm(layer.bias.float(), x[:1].float(), layer.weight.t().float()).to(BF16)
        assert_bitwise_equal(alone[0], wide, "widened row 0")
    assert any(v["route"] == route.spec() and v["call"].startswith(f"addmm [{route.tile}, 96]")
               and ("widened to fp32" in v["call"]) == route.widen for v in mode_tiled.verdicts())


def test_the_kernel_table_names_each_dtypes_route(quick_kernels):
    from kvfid.reports.invariance_table import invariance_document
    from kvfid.reports.document import markdown

    routes = quick_kernels["tiled_routes"]
    assert set(routes) == {"bf16@t1", "fp32@t1"}
    for name, record in routes.items():
        dtype = torch.bfloat16 if name.startswith("bf16") else torch.float32
        assert Route(**record["route"]) in mode_route.candidates(dtype, _floors(record)) \
            or "pinned" in record["source"]
    text = markdown(invariance_document(quick_kernels))
    assert "Tiled mode routes" in text and "- bf16@t1: " in text and "tiles of" in text


def test_without_a_writable_store_the_route_is_timed_and_says_it_is_not_kept(fresh_routes, monkeypatch):
    blocked = fresh_routes / "blocked"
    blocked.write_text("a file where the store's folder would be")
    monkeypatch.setenv("KVFID_CACHE", str(blocked / "below"))
    chosen = mode_route.route(BF16, torch.device("cpu"))
    record = mode_route.routes()[f"bf16@t{torch.get_num_threads()}"]
    assert chosen in mode_route.candidates(BF16, _floors(record))
    assert "NOT kept" in record["source"]
