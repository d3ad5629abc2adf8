"""`compare` over runs with the serving engines' constructions (`cached:K`, `spec:k`) and a
`+compile` stack: a row per construction on every stack, a run against itself clean, and a
flipped bit-exact verdict of one serving construction named as a regression."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfid.compare.runs import compare, render_markdown
from kvfid.ledger.store import Ledger
from test_compare import clone

SERVING = ("cached:prompt", "spec:2", "spec:2+none")
STACKS = ("eager/bf16+bi@t1", "eager/bf16+bi+compile@t1")    # conftest.SERVING_CASE's


def flip(record, arm: str):
    """`arm`'s cache verdict against live turned over: a held one broken from layer 2 (V) on,
    a broken one made bit-exact."""
    found = next(c for c in record.comparisons if c.b == arm and c.a == "live")
    if found.cache.bit_exact:
        cache = replace(found.cache, bit_exact=False, first_bad_layer=2, first_bad_kv="v",
                        bad_layers=(2, 3), n_diff=5, max_ulp=1, d_rel=1e-4)
    else:
        cache = replace(found.cache, bit_exact=True, first_bad_layer=None, first_bad_kv=None,
                        bad_layers=(), n_diff=0, max_ulp=0, d_rel=0.0)
    return replace(record, comparisons=tuple(replace(c, cache=cache) if c is found else c
                                             for c in record.comparisons))


def flip_two(unit):
    """In B: spec:2+none on the eager stack's first item, cached:prompt on the compiled stack."""
    if unit.stack == STACKS[0] and unit.item_index == 0:
        return flip(unit.record, "spec:2+none")
    if unit.stack == STACKS[1]:
        return flip(unit.record, "cached:prompt")
    return unit.record


@pytest.mark.slow
def test_a_serving_run_against_itself_has_a_row_per_construction_and_no_difference(serving_run):
    db, run_id = serving_run
    result = compare(db, run_id, run_id)
    assert not result["regressed"] and set(result["stacks"]) == set(STACKS)
    for label in STACKS:
        entry = result["stacks"][label]
        cache_rows = {v["construction"] for v in entry["verdicts"] if v["check"] == "cache bit-exact"}
        assert {f"{c} vs live" for c in SERVING} <= cache_rows, (label, cache_rows)
        assert {v["status"] for v in entry["verdicts"]} == {"same"}
        assert SERVING[0] in {r["construction"].split(" vs ")[0] for r in entry["rates"]}
    text = render_markdown(result)
    assert "spec:2+none vs live" in text and "eager/bf16+bi+compile@t1" in text


@pytest.mark.slow
def test_a_flipped_serving_verdict_is_named_on_each_stack(serving_run, tmp_path):
    """The eager stack's spec:2+none is bit-exact on any machine (test_prefix_reuse): broken in B,
    it is a regression naming stack, construction and item. Whether the compiled stack is
    bit-exact is a finding per machine: its cached:prompt verdict, turned over, is the one row
    that changes there, in the direction it was turned."""
    db, run_id = serving_run
    copy = tmp_path / "l.sqlite"
    copy.write_bytes(db.read_bytes())
    with Ledger(copy) as ledger:
        compiled_held = next(u.record.against_live("cached:prompt").cache.bit_exact
                             for u in ledger.units(run_id) if u.stack == STACKS[1])
    tampered = clone(copy, run_id, "20990101-000000-5eed", flip_two)
    result = compare(copy, run_id, tampered)
    assert result["regressed"]
    reasons = [r for r in result["regressions"] if "bit-exact" in r]
    eager = [r for r in reasons if r.startswith(f"{STACKS[0]}: ")]
    assert len(eager) == 1 and eager[0].startswith(
        f"{STACKS[0]}: cache bit-exact of spec:2+none vs live")
    assert "arith-0000" in eager[0] and "first bad layer 2 V" in eager[0]
    (changed,) = [v for v in result["stacks"][STACKS[1]]["verdicts"] if v["status"] != "same"]
    assert changed["construction"] == "cached:prompt vs live"
    assert changed["status"] == ("regression" if compiled_held else "better")
    assert any(r.startswith(f"{STACKS[1]}: cache bit-exact of cached:prompt") for r in reasons) \
        == compiled_held
    assert "cached:prompt vs live" in render_markdown(result)
