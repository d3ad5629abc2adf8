"""Rounding or functional (kvfid.states.scale): a difference's kind from its scale in fp32,
unsettled below fp32 until the same comparison in fp32 settles it; in the records (read back
from records written before the field), the run's aggregate (a bf16 stack settled by its fp32
twin) and the report, which never presents a functional difference as numerics."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvfid.records import record as rec
from kvfid.records.read import from_json
from kvfid.states import scale
from test_report import CASE, UNITS, record

EPS32 = scale.epsilon(torch.float32)


def test_the_scale_decides_in_fp32_and_not_below():
    assert scale.kind_of(3 * EPS32, torch.float32) == scale.ROUNDING
    assert scale.kind_of(scale.ROUNDING_EPSILONS * EPS32, torch.float32) == scale.ROUNDING
    assert scale.kind_of(2 * scale.ROUNDING_EPSILONS * EPS32, torch.float32) == scale.FUNCTIONAL
    assert scale.kind_of(0.4, torch.float64) == scale.FUNCTIONAL
    for low in (torch.bfloat16, torch.float16):   # at any scale: fp32 settles it
        assert scale.kind_of(1e-3, low) == scale.kind_of(0.5, low) == scale.UNSETTLED


def test_settling_follows_the_fp32_comparison():
    assert scale.settle(scale.UNSETTLED, None) == scale.ROUNDING          # bit-exact in fp32
    assert scale.settle(scale.UNSETTLED, scale.ROUNDING) == scale.ROUNDING
    assert scale.settle(scale.UNSETTLED, scale.FUNCTIONAL) == scale.FUNCTIONAL
    assert scale.settle(scale.FUNCTIONAL, None) == scale.FUNCTIONAL       # fp32's own stands
    assert "not numerics" in scale.describe(scale.FUNCTIONAL)


def test_a_state_computed_in_bf16_is_measured_against_bf16_even_with_an_fp32_part():
    from kvfid.states.cache import BoundaryState
    from kvfid.states.layers import LayerState

    parts = {"recurrent": torch.zeros(2), "conv": torch.zeros(2, dtype=torch.bfloat16)}
    state = BoundaryState((1,), layers=(LayerState("recurrent", parts),),
                          logits=torch.zeros(3, dtype=torch.bfloat16))
    assert scale.state_dtype(state) == torch.bfloat16
    logits = rec.LogitsDiff(equal=False, d_rel=0.2)
    found = scale.difference(rec.CacheDiff(bit_exact=False, d_rel=0.1), logits, torch.bfloat16)
    assert (found.kind, found.d_rel, found.dtype) == (scale.UNSETTLED, 0.2, "bfloat16")
    assert scale.difference(rec.CacheDiff(), rec.LogitsDiff(), torch.float32) is None


def test_a_record_written_before_the_kinds_reads_back_without_one():
    stored = json.loads(UNITS[1].record.to_json())
    for comparison in stored["comparisons"]:
        comparison.pop("difference")
        comparison["logits"].pop("d_rel")
    read = from_json(json.dumps(stored))
    assert read.comparisons[0].difference is None and read.comparisons[0].logits.d_rel == 0.0
    kinded = dataclasses.replace(read, comparisons=(dataclasses.replace(
        read.comparisons[0], difference=rec.Difference(scale.FUNCTIONAL, 0.4, EPS32, "float32")),))
    assert from_json(kinded.to_json()) == kinded


def _with_kind(unit, stack: str, kind: str | None, d_rel: float = 0.4):
    """`unit` as a unit of `stack` whose live ~ prefill difference has `kind`."""
    comparison = unit.record.comparisons[0]
    difference = None if kind is None else rec.Difference(kind, d_rel, 0.0078125, "bfloat16")
    record_ = dataclasses.replace(unit.record, comparisons=(dataclasses.replace(
        comparison, difference=difference),))
    return dataclasses.replace(unit, stack=stack, record=record_)


@pytest.mark.parametrize("fp32_kind,settled", [(None, "rounding"), ("rounding", "rounding"),
                                               ("functional", "functional")])
def test_the_aggregate_settles_a_bf16_stack_by_its_fp32_twin(fp32_kind, settled):
    from kvfid.runs.aggregate import aggregate

    base = record(0, True, True, 1, 0, (0.01, 0.0), (0.0, 0.0), None, None)
    units = [_with_kind(base, "sdpa/bf16@t1", scale.UNSETTLED),
             _with_kind(base, "sdpa/fp32@t1", fp32_kind),
             _with_kind(dataclasses.replace(base, item_index=1), "sdpa/bf16@t1", scale.UNSETTLED)]
    stacks = aggregate(units).stacks
    counts = stacks["sdpa/bf16@t1"].constructions["prefill"].differences
    # item 0 settled by its fp32 twin; item 1 has no twin and stays unsettled
    assert counts == {**{k: 0 for k in scale.DIFFERENCE_KINDS}, settled: 1, scale.UNSETTLED: 1}


def test_the_report_names_a_functional_difference_and_not_as_numerics(tmp_path):
    from kvfid.ledger.store import Ledger
    from kvfid.reports.report import write_report

    units = [_with_kind(UNITS[1], UNITS[1].stack, scale.FUNCTIONAL)] + UNITS[2:4]
    with Ledger(tmp_path / "l.sqlite") as ledger:
        ledger.create_run("r1", CASE, {"gpus": [], "versions": {"torch": "x"}}, "cpu/none/x")
        for unit in units:
            ledger.write_unit("r1", unit.item_index, unit.item_id, unit.stack, unit.record, "k")
        text = write_report(ledger, "r1", tmp_path / "reports")["markdown"].read_text()
    assert "differs by rounding / functionally / unsettled" in text
    assert "| 0 / 1 / 0 |" in text
    assert "prefill: a functional difference from live" in text and "It is not numerics" in text
