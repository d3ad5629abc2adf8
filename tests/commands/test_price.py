"""`kvfid price`: the interleaving order and the rounds (a fake clock), the budget's estimate and
skip, the table's shape and arithmetic on tiny-llama, its JSON round trip and files, the engine
rows read from engine-bench's JSON (a stand-in venv), the command through CliRunner."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from dataclasses import replace

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.records.price import (FAITHFUL, SPANS, TP_PRODUCTS, STOCK, ArmTimes, Floor, PriceRow, PriceTable,
                                 from_json, to_json)
from kvfid.tasks import price, price_engine, price_work

# tiny-llama, every kind of row once, no engine: seconds.
TINY = price.PricePlan(models=("tiny-llama",), prefill=(8,), sequences=(1, 3), context=16,
                       keys=(8,), engine=False, budget_s=120.0)


class FakeClock:
    """A wall clock each call of an arm advances by that arm's duration (a CPU clock by half)."""

    def __init__(self, durations: dict[str, float]):
        self.now, self.durations, self.calls = 0.0, durations, []

    def arm(self, name: str) -> price_work.Arm:
        @contextlib.contextmanager
        def session():
            def call():
                self.calls.append(name)
                self.now += self.durations[name]
            yield call
        return price_work.Arm(name, f"{name}-label", session)

    def clocks(self) -> price_work.Clocks:
        return price_work.Clocks(wall=lambda: self.now, cpu=lambda: self.now / 2)


def test_arms_are_interleaved_in_rotated_order_after_a_warm_up_and_rounds_follow_the_first():
    clock = FakeClock({"a": 0.5, "b": 1.5, "c": 1.0})
    asked = []

    def rounds(first_s):
        asked.append(first_s)
        return 4

    times, count = price_work.interleaved([clock.arm(n) for n in "abc"], rounds, clock.clocks())
    assert clock.calls == list("abc" "abc" "bca" "cab" "abc")     # warm-up, then 4 rotated rounds
    assert asked == [3.0] and count == 4                           # the first timed round's seconds
    assert [(t.name, t.stack, t.wall_s) for t in times] == [
        ("a", "a-label", (0.5,) * 4), ("b", "b-label", (1.5,) * 4), ("c", "c-label", (1.0,) * 4)]
    assert times[1].cpu_s == (0.75,) * 4
    # the control: without rotation the same calls would read "abc" five times
    assert clock.calls != list("abc" * 5)


def test_rounds_follow_the_round_length_and_the_budget():
    assert price_work.rounds_for(6.0, 1e6) == 1
    assert price_work.rounds_for(2.0, 1e6) == price_work.FEW_ROUNDS
    assert price_work.rounds_for(1e-4, 1e6) == price_work.MAX_ROUNDS
    assert price_work.rounds_for(0.5, 1e6) == price_work.MIN_ROUNDS + 3     # 4 s / 0.5 s
    assert price_work.rounds_for(0.5, 1.6) == 3                              # what the budget holds
    assert price_work.rounds_for(2.0, 0.1) == 1                              # never none


def test_the_estimate_scales_the_nearest_measured_row_by_weights_and_rows():
    measured = [{"model": "m", "work": "prefill 64 tokens", "phase": "prefill", "weights": 100,
                 "rows": 64, "round_s": 2.0},
                {"model": "m", "work": "prefill 8 tokens", "phase": "prefill", "weights": 100,
                 "rows": 8, "round_s": 1.0}]
    seconds, why = price._estimate("m", ("prefill", 512, 1), 100, measured)
    assert seconds == pytest.approx(2 * 2.0 * 512 / 64) and "prefill 64 tokens" in why
    seconds, _ = price._estimate("n", ("prefill", 32, 1), 300, measured)     # another model: x3
    assert seconds == pytest.approx(2 * 1.0 * 300 * 32 / (100 * 8))
    assert price._estimate("m", ("decode", 1, 1), 100, measured) is None      # no decode row yet


@pytest.fixture
def few_rounds(monkeypatch):
    """Two timed rounds a row at most: the tests check the table, not the timings."""
    monkeypatch.setattr(price_work, "MAX_ROUNDS", 2)
    monkeypatch.setattr(price_work, "MIN_ROUNDS", 2)


@pytest.fixture(scope="module")
def tiny_table(tmp_path_factory):
    reports = tmp_path_factory.mktemp("reports")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(price_work, "MAX_ROUNDS", 2)
        patch.setattr(price_work, "MIN_ROUNDS", 2)
        table, path = price.price(TINY, reports)
    return table, path, reports


def test_the_table_on_tiny_llama_has_every_row_and_its_arithmetic(tiny_table):
    table, _, _ = tiny_table
    assert table.status == "finished" and table.threads == 1 and table.environment_key
    assert table.environment["versions"]["torch"]
    assert [(r.phase, r.tokens, r.sequences) for r in table.rows] == [
        ("decode", 8, 1), ("decode", 16, 1), ("decode", 16, 3), ("prefill", 8, 1)]
    for row in table.rows:
        assert row.skipped is None and row.order == "interleaved" and row.rounds >= 1
        assert [a.name for a in row.arms] == [STOCK, FAITHFUL, TP_PRODUCTS]
        assert [a.stack for a in row.arms] == ["sdpa/bf16@t1", "native/bf16+bi@t1", "native/bf16+bi@t1@tp1"]
        assert all(len(a.wall_s) == len(a.cpu_s) == row.rounds for a in row.arms)
        stock, faithful = row.arm(STOCK), row.arm(FAITHFUL)
        assert stock.median_s == statistics.median(stock.wall_s)
        assert row.ratio == faithful.median_s / stock.median_s
        assert row.cpu_ratio == statistics.median(faithful.cpu_s) / statistics.median(stock.cpu_s)
        assert (row.floor is None) == (row.phase == "prefill")
    floors = {r.sequences: r.floor for r in table.rows if r.floor}
    for rows, floor in floors.items():
        if floor.route == SPANS:        # a whole-call route: each product by its own key's span
            padded = rows
        else:
            tile = int(floor.route.split(":")[-1])
            padded = max(rows, tile) if "whole:" in floor.route else math.ceil(rows / tile) * tile
        assert floor.rows == rows and floor.padded_rows == padded
        assert floor.products == 4 * 7 + 1        # tiny-llama: 4 layers of q, k, v, o, gate, up, down; the head
        assert floor.ratio == floor.padded.median_s / floor.own.median_s
    one = [r.floor for r in table.rows if r.sequences == 1]
    assert one[0] is one[1]                               # measured once per row count


def test_the_stored_table_is_the_returned_one_and_reads_back(tiny_table):
    table, path, _ = tiny_table
    assert path.parent.name == "price" and table.environment_key in str(path)
    assert from_json(path.read_text()) == table
    assert from_json(to_json(table)) == table
    text = path.with_suffix(".md").read_text()
    assert text.count("| tiny-llama |") == 4 and "sdpa/bf16@t1" in text
    with pytest.raises(ValueError, match="schema"):
        from_json(json.dumps({**json.loads(to_json(table)), "schema": 99}))


def test_kvfid_times_lists_a_stored_price_table(tiny_table):
    from kvfid.reports.times import collect_times

    table, path, reports = tiny_table
    rows = [r for r in collect_times(reports) if r.what.startswith("price table")]
    assert len(rows) == 1 and rows[0].source.endswith(path.name)
    low = min(r.ratio for r in table.rows)
    assert f"{low:.2f}x" in rows[0].figures and "4 rows" in rows[0].figures


def test_a_row_over_the_budget_is_shown_skipped_with_its_estimate(tmp_path, monkeypatch, few_rounds):
    """After the first row the budget is spent, or a millisecond is left: the next rows are shown
    skipped (none dropped), each saying why: the budget spent, or the estimate from the row
    measured that passes what is left."""
    real_left = price.PriceRun.left
    plan = replace(TINY, sequences=(1,), keys=(), prefill=(8, 16), tp_products=False)
    monkeypatch.setattr(price.PriceRun, "left", lambda run: real_left(run) if not run.table.rows else 0.0)
    table, _ = price.price(plan, tmp_path)
    assert [(r.phase, r.tokens, r.skipped) for r in table.rows] == [
        ("decode", 16, None), ("prefill", 8, "the 120 s budget is spent"),
        ("prefill", 16, "the 120 s budget is spent")]

    monkeypatch.setattr(price.PriceRun, "left", lambda run: real_left(run) if not run.table.rows else 0.001)
    table, path = price.price(replace(plan, sequences=()), tmp_path)
    first, second = table.rows
    assert first.skipped is None and second.skipped.startswith("about ")
    assert "from tiny-llama prefill 8 tokens" in second.skipped
    assert second.skipped.endswith("over the 0 s left of the 120 s budget")
    assert f"skipped: {second.skipped}" in path.with_suffix(".md").read_text()


ENGINE = {"model": "smollm2-135m", "dtype": "bf16", "engine": "vllm 0.32.0", "prompts": 4,
          "tokens": 16, "repeats": 3, "tp": 1,
          "engines": {"stock": {"prefill_wall_s": [1.0, 3.0, 2.0], "full_wall_s": [4.0, 6.0, 5.0],
                                "prompt_tokens": 230, "threads": 1},
                      "faithful": {"prefill_wall_s": [4.0, 4.5, 5.0], "full_wall_s": [20.0, 14.0, 17.0],
                                   "prompt_tokens": 230, "threads": 1}},
          "slowdown": {"prefill": 4.5 / 2.0, "decode": (17.0 - 4.5) / (5.0 - 2.0)}}
LOAD = {"model": "smollm2-135m", "engine": "vllm 0.32.0", "requests": 16, "clients": 8,
        "tokens": 32, "kv_blocks": 18, "engines": {"stock": {"repeats": [30.0, 40.0, 35.0], "threads": 1},
                                                   "faithful": {"repeats": [4.0, 5.0, 6.0], "threads": 1}},
        "slowdown": 35.0 / 5.0}


def test_engine_rows_are_engine_benchs_figures(tmp_path):
    """A stand-in venv whose kvfid prints engine-bench's JSON: the rows' ratios are engine-bench's
    own slowdowns; a missing venv leaves the rows skipped, saying why."""
    folder = tmp_path / "venv" / "bin"
    folder.mkdir(parents=True)
    (tmp_path / "bench.json").write_text(json.dumps(ENGINE))
    (tmp_path / "load.json").write_text(json.dumps(LOAD))
    script = folder / "kvfid"
    script.write_text(f"#!/bin/sh\ncase \"$*\" in *--load*) cat {tmp_path}/load.json;; "
                      f"*) cat {tmp_path}/bench.json;; esac\n")
    script.chmod(0o755)
    plan = replace(TINY, vllm_venv=str(tmp_path / "venv"))
    rows = price_engine.engine_rows(plan, lambda: 60.0, lambda _: None)
    assert [r.phase for r in rows] == ["engine prefill", "engine decode", "engine load 8"]
    assert rows[0].ratio == pytest.approx(ENGINE["slowdown"]["prefill"])
    assert rows[1].ratio == pytest.approx(ENGINE["slowdown"]["decode"])
    assert rows[2].ratio == pytest.approx(LOAD["slowdown"])
    assert all(r.order == price_engine.SEQUENTIAL for r in rows)
    assert "--threads 1" in rows[0].note and "--load 8" in rows[2].note
    missing = price_engine.engine_rows(replace(plan, vllm_venv=str(tmp_path / "none")),
                                       lambda: 60.0, lambda _: None)
    assert len(missing) == 3 and all("make install-vllm" in r.skipped for r in missing)


def test_the_command_prints_json_or_markdown_and_refuses_bad_plans(tmp_path, few_rounds):
    args = ["price", "--models", "tiny-llama", "--prefill", "8", "--sequences", "", "--keys", "8",
            "--no-engine", "--no-tp-products", "--reports", str(tmp_path), "--budget", "60"]
    result = CliRunner().invoke(main, args + ["--format", "json"])
    assert result.exit_code == 0, result.output
    table = from_json(result.stdout)
    assert [(r.phase, [a.name for a in r.arms]) for r in table.rows] == [
        ("decode", [STOCK, FAITHFUL]), ("prefill", [STOCK, FAITHFUL])]
    assert "price: " in result.stderr and len(list(tmp_path.rglob("*.json"))) == 1
    for bad in (["--sequences", "0"], ["--stock", "sdpa/bf16@t2"], ["--models", "nope"],
                ["--floor-route", "widen:x"], ["--faithful", "nope"]):
        refused = CliRunner().invoke(main, args + bad)
        assert refused.exit_code == 2, (bad, refused.output)
    assert len(list(tmp_path.rglob("*.json"))) == 1        # refused before any file


def test_render_shows_skipped_rows_and_the_floor():
    from kvfid.reports.price_table import render_markdown

    arms = (ArmTimes(STOCK, "s", (1.0, 3.0)), ArmTimes(FAITHFUL, "f", (4.0,)))
    rows = (PriceRow("m", "prefill", 64, 1, "a call", "interleaved", arms, 2),
            PriceRow("m", "prefill", 2048, 1, "a call", "interleaved", skipped="about 99 s"))
    table = PriceTable({"context": 512, "sequences": [1]}, 1, {}, "key", "t0", "finished", rows)
    text = render_markdown(table)
    assert "| m | prefill 64 tokens | 2 s | 4 s | 2.00x | - |" in text      # no CPU times given
    assert "skipped: about 99 s" in text
    spans = Floor(SPANS, "kept", 1, 1, 29, ArmTimes("own rows", "o", (1.0,)),
                  ArmTimes("route", "r", (1.5,)), 1)
    decode = PriceRow("m", "decode", 64, 1, "a step", "interleaved", arms, 2, floor=spans)
    text = render_markdown(replace(table, rows=(decode,)))
    assert "1.50x: 29 products by the faithful mode's calls (each product's span) 1.5 s" in text
