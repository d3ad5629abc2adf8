"""Aggregates from hand-made records give known numbers; the report files are self-contained."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from kvfid.runs import stats
from kvfid.runs.summary import Rate
from kvfid.runs.case import load_case
from kvfid.ledger.store import Ledger, StoredUnit
from kvfid.records import record as rec
from kvfid.reports.report import aggregate, crossing_repro_command, d_rel_blocks, headline, \
    markdown, repro_command, svg_bars, svg_lines, write_report

CASE = load_case(Path(__file__).resolve().parents[2] / "cases" / "smoke.toml")
STACK = "sdpa/bf16@t1"  # smoke.toml sets threads = 1
MARGINS = [1.0, 1.0, 0.5, 2.0, 2.0, 0.25, 3.0, 3.0]   # the live suffix's margin at each step


def comparison(a, b, kind, first=None, bad_layer=None, d_k=(0.0, 0.0), d_v=(0.0, 0.0)):
    layers = tuple(rec.LayerDiff(i, rec.TensorDiff(d_rel=d_k[i]), rec.TensorDiff(d_rel=d_v[i]))
                   for i in range(2))
    return rec.Comparison(
        a, b, kind, rec.SuffixDiff(identical=first is None, first_divergence=first,
                                   margin_a_at_divergence=None if first is None
                                   else MARGINS[first]),
        cache=rec.CacheDiff(bit_exact=bad_layer is None, first_bad_layer=bad_layer,
                            d_rel=max(d_k + d_v), layers=layers),
        logits=rec.LogitsDiff(equal=bad_layer is None, argmax_agree=True))


def record(index, live_right, prefill_right, first, bad_layer, d_k, d_v, replica_first,
           transplant):
    arm = lambda label, right: rec.ArmRecord(label, (0,) * 8, tuple(MARGINS), correct=right,
                                             suffix_sha="s", cache_sha="c", logits_sha="l",
                                             forward_calls=1)
    transplants = () if not transplant else (rec.TransplantRecord(
        "live<-prefill:all", "live", "prefill", "all", first is None, transplant),)
    out = rec.ItemRecord(
        rec.ItemRef(f"i{index}", f"p{index}", "1"), "tiny-llama", {"label": STACK}, 4, 8, "ok",
        prompt_length=1, prefix=(1, 2), prefix_sha="p",
        arms={"live": arm("live", live_right), "prefill": arm("prefill", prefill_right)},
        comparisons=(comparison("live", "prefill", "arm", first, bad_layer, d_k, d_v),),
        replicas=(rec.Replica("prefill", rec.Fingerprints(),
                              comparison("prefill", "prefill", "replica", replica_first)),),
        transplants=transplants)
    return StoredUnit(index, f"i{index}", STACK, "ok", out, "k")


def crossing(index, same: dict, within_fp32_identical: bool):
    cells = tuple(rec.CrossingCell(f"sdpa/{d}", c, rec.Fingerprints(prefix_sha="p",
                                                                    suffix_sha="s"),
                                   same_as_reference_live=same[(d, c)])
                  for d in ("bf16", "fp32") for c in ("incremental", "prefill"))
    suffix = lambda ok: rec.SuffixDiff(identical=ok, first_divergence=None if ok else 1,
                                       margin_a_at_divergence=None if ok else 0.5)
    within = (rec.StackComparison("sdpa/bf16", rec.Comparison(
                  "incremental", "prefill", "crossing", suffix(True),
                  cache=rec.CacheDiff(bit_exact=True))),
              rec.StackComparison("sdpa/fp32", rec.Comparison(
                  "incremental", "prefill", "crossing", suffix(within_fp32_identical),
                  cache=rec.CacheDiff(bit_exact=False))))
    return StoredUnit(index, f"i{index}", rec.CrossingRecord.UNIT, "ok", rec.CrossingRecord(
        rec.ItemRef(f"i{index}"), {"label": "sdpa/bf16"}, 4, 8, "ok", prefix_sha="p",
        reference_suffix=(0,), cells=cells, within=within), "k")


UNITS = [
    record(0, True, True, None, None, (0, 0), (0, 0), None, "recipient"),
    record(1, True, False, None, 1, (0, 0.02), (0, 0.04), None, "recipient"),
    record(2, False, True, 2, 0, (0.01, 0.03), (0.02, 0.05), 4, "donor"),
    record(3, False, False, 5, 1, (0, 0.01), (0, 0.02), None, "third"),
    StoredUnit(4, "i4", STACK, "short", rec.ItemRecord(
        rec.ItemRef("i4", "p4"), "tiny-llama", {"label": STACK}, 4, 8, "short",
        arms={"live": rec.ArmRecord("live", generated=(1,))}), "k"),
    crossing(0, {("bf16", "incremental"): True, ("bf16", "prefill"): True,
                 ("fp32", "incremental"): False, ("fp32", "prefill"): False}, True),
    crossing(1, {("bf16", "incremental"): True, ("bf16", "prefill"): True,
                 ("fp32", "incremental"): True, ("fp32", "prefill"): False}, False),
]
DESIGN = {"control_indices": [1, 4], "units": len(UNITS)}


@pytest.fixture(scope="module")
def summary():
    return aggregate(UNITS, DESIGN)


def test_disagreement_replica_floor_and_cache(summary):
    s = summary.stacks[STACK]
    assert (s.items, s.ok, s.short) == (5, 4, ("i4",))
    prefill = s.constructions["prefill"]
    assert prefill.suffix_disagree == Rate(2, 4, 0.5, stats.wilson_interval(2, 4))
    assert (prefill.replica_floor.k, prefill.replica_floor.n) == (1, 4)
    assert (prefill.cache_bit_exact.k, prefill.cache_bit_exact.n) == (1, 4)
    assert prefill.first_bad_layer == {"exact": 1, "0": 1, "1": 2}
    assert prefill.d_rel_per_layer == {"k": (0.0, pytest.approx(0.015)),
                                       "v": (0.0, pytest.approx(0.03))}



def test_d_rel_per_layer_covers_every_part_of_every_layer_kind():
    """A hybrid model: layer 0 recurrent (no K/V: its recurrent and conv states), layer 1 full
    attention; each part's series names the layers that hold it (None elsewhere, not 0)."""
    recurrent = rec.LayerDiff(0, kind="recurrent", parts={"recurrent": rec.TensorDiff(d_rel=0.2),
                                                         "conv": rec.TensorDiff(d_rel=0.1)})
    full = rec.LayerDiff(1, rec.TensorDiff(d_rel=0.03), rec.TensorDiff(d_rel=0.05), span=(0, 2))
    units = []
    for unit in UNITS[:4]:
        c = unit.record.comparisons[0]
        cache = dataclasses.replace(c.cache, layers=(recurrent, full))
        units.append(dataclasses.replace(unit, record=dataclasses.replace(
            unit.record, comparisons=(dataclasses.replace(c, cache=cache),))))
    prefill = aggregate(units, DESIGN).stacks[STACK].constructions["prefill"]
    assert prefill.d_rel_per_layer == {"k": (None, 0.03), "v": (None, 0.05),
                                       "recurrent": (0.2, None), "conv": (0.1, None)}
    numbers = markdown(d_rel_blocks(STACK, {"prefill": prefill})[-1][2:])   # the figure's table
    assert "| layer | prefill K | prefill V | prefill RECURRENT | prefill CONV |" in numbers
    assert "| 0 | - | - | 0.2 | 0.1 |" in numbers and "| 1 | 0.03 | 0.05 | - | - |" in numbers


def test_first_divergence_and_margins(summary):
    prefill = summary.stacks[STACK].constructions["prefill"]
    fd = prefill.first_divergence
    assert (fd.n, fd.median, fd.q1, fd.q3) == (2, 3.5, 2.75, 4.25)
    assert [count for _, _, count in fd.histogram] == [0, 0, 1, 0, 0, 1, 0, 0]
    assert prefill.margin_at_divergence.median == pytest.approx(0.375)
    assert prefill.margin_elsewhere.n == 2 + 5 + 8 + 8


def test_correctness_flips_and_mcnemar(summary):
    s = summary.stacks[STACK]
    assert (s.correctness["live"].k, s.correctness["live"].n) == (2, 4)
    paired = s.constructions["prefill"].correctness
    assert (paired.a_right_b_wrong, paired.a_wrong_b_right) == (1, 1)
    assert paired.difference == 0.0 and paired.mcnemar_p == 1.0


def test_transplant_rows_by_role(summary):
    t = summary.stacks[STACK].transplants["live<-prefill:all"]
    assert t["divergent"].n == 2
    assert t["divergent"].outcomes["donor"].k == 1
    assert t["divergent"].outcomes["third"].k == 1
    assert (t["control"].n, t["control"].outcomes["recipient"].k) == (1, 1)
    assert (t["unsampled"].n, t["unsampled"].outcomes["recipient"].k) == (1, 1)
    assert t["control"].outcomes["recipient"].ci == stats.wilson_interval(1, 1)


def test_the_crossing_two_by_two(summary):
    x = summary.crossing
    assert x.reference == "sdpa/bf16" and x.ok == 2
    cell = lambda d, c: (x.cells[f"sdpa/{d}"][c].k, x.cells[f"sdpa/{d}"][c].n)
    assert [cell("bf16", "incremental"), cell("bf16", "prefill"), cell("fp32", "incremental"),
            cell("fp32", "prefill")] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    assert x.within["sdpa/fp32"].suffix_disagree.k == 1
    assert x.within["sdpa/bf16"].cache_bit_exact == 2


def test_headline_has_one_row_per_construction_then_the_crossing(summary):
    table, crossing = headline(summary).split("\n\n")
    lines = table.splitlines()
    assert lines[0].startswith("stack") and len(lines) == 3
    assert "2/4 (50.0%)" in lines[2] and "1/4" in lines[2]
    assert crossing.startswith("precision crossing, P frozen from sdpa/bf16 live (2 items")
    assert crossing.splitlines()[-1].startswith("sdpa/fp32  1/2 (50.0%)")


def test_report_files_are_written_and_self_contained(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        ledger.create_run("r1", CASE, {"gpus": [], "versions": {"torch": "x"}}, "cpu/none/x")
        for unit in UNITS:
            ledger.write_unit("r1", unit.item_index, unit.item_id, unit.stack, unit.record, "k")
        paths = write_report(ledger, "r1", tmp_path / "reports")
    assert paths["html"].parent == tmp_path / "reports" / "cpu" / "none" / "x" / "r1"
    page = paths["html"].read_text()
    assert page.count("<svg") == 2      # d_rel per layer, first-divergence histogram
    assert not re.search(r"\b(src|href)\s*=|url\(|@import|<link|<script", page, re.I)
    text = paths["markdown"].read_text()
    assert "## Stack sdpa/bf16" in text and "## Precision crossing" in text
    assert "kvfid repro --model tiny-llama --item-set arith --item 2" in text
    summary = json.loads(paths["summary"].read_text())
    assert summary["run"] == "r1" and summary["environment"]["versions"]["torch"] == "x"
    assert "--item <INDEX>" in summary["repro"]["crossing"]
    assert summary["stacks"][STACK]["constructions"]["prefill"]["suffix_disagree"]["k"] == 2
    # summary.json holds the aggregates' plain form under the keys it always had, and a stored
    # rate reads back as the rate the report rendered
    with Ledger(tmp_path / "l.sqlite") as ledger:
        typed = aggregate(ledger.units("r1"), ledger.run("r1").design)
    assert {k: summary[k] for k in typed.to_plain()} == typed.to_plain()
    assert list(summary)[-7:] == ["stacks", "crossing", "control_indices", "replay",
                                  "replay_engine", "program", "endpoints"]
    prefill = summary["stacks"][STACK]["constructions"]["prefill"]
    assert list(prefill) == [
        "kind", "vs", "suffix_disagree", "replica_floor", "live_replica_floor",
        "cache_comparable", "cache_bit_exact", "logits_bit_exact", "boundary_argmax_differs",
        "first_bad_layer", "d_rel_median", "d_rel_per_layer", "d_rel_aggregation",
        "first_divergence", "margin_at_divergence", "margin_elsewhere", "correctness",
        "differences"]
    assert list(summary["stacks"][STACK]) == ["items", "ok", "B", "S", "short", "constructions",
                                              "replicas", "correctness", "transplants",
                                              "batched_rows_identical"]
    assert list(prefill["replica_floor"]) == ["k", "n", "rate", "ci", "cache_bit_exact"]
    assert list(prefill["first_divergence"]) == ["n", "median", "q1", "q3", "histogram"]
    stored = Rate.from_plain(prefill["suffix_disagree"])
    assert stored == typed.stacks[STACK].constructions["prefill"].suffix_disagree


def test_repro_command_names_the_stack_plan_and_item():
    command = repro_command(CASE, "eager/bf16@t1", 1, "What?")
    assert command.startswith("kvfid repro --model tiny-llama --item-set arith --item 1 "
                              "--stack eager/bf16@t1 --device cpu -B 6 -S 6 ")
    assert "--replicas prefill" in command and "--transplant 'live<-prefill:all'" in command
    assert "--cross bf16,fp32" in crossing_repro_command(CASE, 2, "What?")
    assert "--cross" not in repro_command(CASE, "sdpa/bf16@t1", 2, "What?")
    assert "--replicas" not in repro_command(CASE, "sdpa/bf16@t1", 2, "What?")


def test_figures_draw_zeros_and_empty_series():
    assert svg_lines([("prefill K", [0.0, 0.0])], "layer", "d_rel").startswith("<svg")
    assert "<rect" in svg_bars({"prefill": [(0, 1, 3), (1, 2, 0)]}, "index")
    assert markdown([("table", ["a|b"], [["x"]])]) == "| a\\|b |\n|---|\n| x |\n"


def test_a_stored_summary_reads_back_as_the_run_summary_it_was_written_from(tmp_path):
    """summary.json's reader is `to_plain`'s inverse on every committed run report; its control:
    a stored construction changed by one count reads back as a different summary."""
    import json
    from pathlib import Path

    from kvfid.runs.summary import RunSummary

    root = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
    paths = sorted((root / "reports").glob("**/summary.json"))
    assert paths
    for path in paths:
        data = json.loads(path.read_text())
        summary = RunSummary.from_plain(data)
        plain = summary.to_plain()
        assert {k: v for k, v in plain.items() if k in data} == {k: data[k] for k in plain
                                                                 if k in data}, path
        assert all(plain[k] is None for k in plain if k not in data), path
    stack = next(iter(data["stacks"].values()))
    construction = next(iter(stack["constructions"].values()))
    key = next(k for k, v in construction.items() if isinstance(v, int) and not isinstance(v, bool))
    construction[key] += 1
    assert RunSummary.from_plain(data) != summary
