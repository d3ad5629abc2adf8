"""Stage programs in case files (harness/runs/case_program.py, program_matrix.py): a `[program]`
case read and refused in one line before compute, `kvfid run` storing ProgramRecords that read
back, their aggregates, and the report's picture of the stages with the first bad segment."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.records.program import ProgramRecord, picture
from kvfid.records.read import from_json
from kvfid.reports.report import aggregate, document
from kvfid.reports.document import markdown
from kvfid.runs.case import CaseError, parse_case
from kvfid.ledger.store import Ledger
from kvfid.runs.matrix import run_case
from protocol_fixtures import tiny

CASE = """model = "tiny-llama"
S = 3
constructions = ["live", "prefill", "chunked:5"]

[items]
set = "arith-easy"
n = 1

[program]
layout = "packed"
branches = 2
branch_tokens = 3
merge_tokens = 2
positions = "parallel"
{sees}
[[stacks]]
backends = ["native", "twin"]
dtypes = ["fp32"]
batch_invariant = [true]
device = "cpu"
threads = 1

[replicas]
arms = ["prefill"]

[transplants]
pairs = ["live<-prefill", "prefill<-live"]
selections = ["all", "segment=branch2"]
"""


def test_a_program_case_reads_its_program_arms_and_transplants():
    case = parse_case(CASE.format(sees=""), "p.toml")
    (program,) = case.program.programs
    assert program.label == "packed:2x3+2:parallel" and program.sees == ()
    assert case.B == 0 and case.transplants is None
    assert case.program.transplants == ("live<-prefill:all", "live<-prefill:segment=branch2",
                                        "prefill<-live:all", "prefill<-live:segment=branch2")
    chained = parse_case(CASE.format(sees='sees = {branch2 = ["branch1"]}'), "p.toml")
    (program,) = chained.program.programs
    assert program.sees == ((0,), (0, 1), (0, 1, 2), (0, 1, 2, 3))
    assert program.visibility()[2].tolist() == [True, True, True, False]
    both = parse_case(CASE.format(sees="").replace('layout = "packed"',
                                                   'layout = ["packed", "batched"]'), "p.toml")
    assert [p.label for p in both.program.programs] == ["packed:2x3+2:parallel",
                                                        "batched:2x3+2:parallel"]


@pytest.mark.parametrize("edit, message", [
    (("branches = 2", "branches = 0"), "an empty stage"),
    (("merge_tokens = 2", "merge_tokens = 0"), "an empty stage"),
    (("{sees}", 'sees = {branch1 = ["branch2"]}'), "branch1 sees branch2, a later stage"),
    (("{sees}", 'sees = {branch3 = ["prompt"]}'), "stage 'branch3'"),
    (('layout = "packed"', 'layout = "batched"'), "batched branches are rows"),
    (("S = 3", "S = 3\nB = 4"), "key 'B' does not apply to a program case"),
    (("\"chunked:5\"]", "\"batched:2\"]"), "constructions: batched:2: a stage program is rebuilt"),
    (("[\"live\", ", "["), "include it"),
    (("segment=branch2", "segment=branch7"), "segment=NAME with NAME one of prompt, branch1"),
    (("branch_tokens = 3", "branch_tokens = 500"), "exceed the model's context"),
])
def test_bad_program_cases_exit_2_in_one_line_before_compute(tmp_path, edit, message):
    text = CASE.replace("{sees}", "").replace(*edit) if edit[0] != "{sees}" else \
        CASE.replace(*edit)
    if "batched" in edit[1]:    # batched with continuing positions
        text = text.replace('positions = "parallel"', 'positions = "continuing"')
    path, db = tmp_path / "bad.toml", tmp_path / "l.sqlite"
    path.write_text(text)
    result = CliRunner().invoke(main, ["run", str(path), "--db", str(db), "--quiet"])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not db.exists()   # refused before the ledger, before compute


def test_kvfid_run_stores_program_records_and_the_report_shows_the_program(tmp_path):
    """Both layouts in one case: each unit a record with a run per layout, read back as
    stored; the faithful stack bit-exact in both, the variant twin caught with its first bad
    segment; the report's picture and its stack x layout x arm rows."""
    case = parse_case(CASE.format(sees="").replace('layout = "packed"',
                                                   'layout = ["packed", "batched"]'), "p.toml")
    result = run_case(case, tmp_path / "l.sqlite", model=tiny(), progress=False)
    with Ledger(tmp_path / "l.sqlite") as ledger:
        units, run = ledger.units(result.run_id), ledger.run(result.run_id)
        stored = ledger.db.execute("SELECT record FROM units").fetchall()
    assert [u.stack for u in units] == ["native/fp32+bi@t1", "twin/fp32+bi@t1"]
    for unit, (text,) in zip(units, stored):
        assert isinstance(unit.record, ProgramRecord) and from_json(text) == unit.record
    faithful, twin = (u.record for u in units)
    packed, batched = faithful.runs
    assert (packed.layout, batched.layout) == ("packed", "batched")
    assert packed.prefix_sha == batched.prefix_sha   # the same tokens, built by rows
    assert packed.arms["live"].cache_sha == batched.arms["live"].cache_sha
    assert [s.segment for s in packed.segments] == ["prompt", "branch 1", "branch 2", "merge"]
    assert packed.segments[2].sees == ("prompt", "branch 2")
    for layout in faithful.runs:
        assert all(c.bit_exact and c.suffix.identical for c in layout.comparisons)
        assert all(r.bit_exact for r in layout.replicas)
    assert [t.spelled for t in packed.transplants] == list(case.program.transplants)
    control = twin.run("packed").against_live("prefill")
    assert not control.bit_exact and control.first_bad_segment is not None
    summary = aggregate(units, run.design)
    arms = summary.program["twin/fp32+bi@t1"]["packed"].arms
    assert arms["prefill"].cache_bit_exact.k == 0
    assert arms["prefill"].first_bad_segment == {control.first_bad_segment: 1}
    assert summary.program["native/fp32+bi@t1"]["batched"].arms["chunked:5"].first_bad_segment \
        == {"exact": 1}
    text = markdown(document(run, case, summary, units))
    assert "## Stage program" in text and "\n".join(picture(packed.segments)) in text
    assert "| twin/fp32+bi@t1 | packed | prefill | 0/1 |" in text
    assert "| native/fp32+bi@t1 | batched | prefill | 1/1 |" in text
    assert "live<-prefill:segment=branch2" in text and "--program batched:2x3+2:parallel" in text
    from kvfid.reports.index import grid_stacks    # the index grid: a column per stack x layout

    columns = grid_stacks(summary.to_plain())   # the index reads summary.json's plain form
    assert list(columns) == [f"{s} {layout}" for s in ("native/fp32+bi@t1", "twin/fp32+bi@t1")
                             for layout in ("packed", "batched")]
    assert columns["twin/fp32+bi@t1 packed"]["constructions"]["prefill"]["cache_bit_exact"]["k"] == 0


def test_a_stage_seeing_an_earlier_branch_runs_under_its_mask():
    """`sees = {branch2 = ["branch1"]}`: branch 2's queries see branch 1's keys (a chain), and
    the faithful stack still rebuilds the merge boundary bit for bit."""
    case = parse_case(CASE.format(sees='sees = {branch2 = ["branch1"]}').replace(
        'backends = ["native", "twin"]', 'backends = ["native"]'), "p.toml")
    from kvfid.runs import program_matrix

    items = program_matrix.bind(case, tiny())
    (chained,) = program_matrix.measure(tiny(), case.stacks[0], items[0], case, 0).runs
    assert chained.segments[2].sees == ("prompt", "branch 1", "branch 2")
    assert all(c.bit_exact for c in chained.comparisons)
    (plain,) = program_matrix.measure(tiny(), case.stacks[0], items[0],
                                      parse_case(CASE.format(sees=""), "p.toml"), 0).runs
    assert plain.arms["live"].cache_sha != chained.arms["live"].cache_sha  # the mask mattered


def test_the_program_case_files_load():
    from kvfid.names import CASES

    for name in ("merge-smollm2.toml", "paper-merge.toml"):
        path = Path(CASES) / name
        if path.exists():
            assert parse_case(path.read_text(), str(path)).program is not None
        else:
            pytest.fail(f"{path} is missing")


def test_a_program_case_takes_no_crossing():
    with pytest.raises(CaseError, match="key 'crossing' does not apply to a program case"):
        parse_case(CASE.replace("[program]", "[crossing]\nreference = \"sdpa/bf16\"\n"
                                "dtypes = [\"bf16\"]\n[program]").format(sees=""), "p.toml")


def test_two_runs_of_a_program_case_compare_by_verdicts_and_fingerprints(tmp_path):
    from kvfid.compare.runs import compare

    text = CASE.format(sees="").replace('backends = ["native", "twin"]', 'backends = ["native"]')
    case = parse_case(text.split("[transplants]")[0], "p.toml")
    runs = [run_case(case, tmp_path / "l.sqlite", model=tiny(), progress=False).run_id
            for _ in range(2)]
    with Ledger(tmp_path / "l.sqlite") as ledger:
        result = compare(ledger, *runs)
    entry = result["stacks"]["native/fp32+bi@t1"]
    assert not result["regressed"] and entry["items"]["compared"] and entry["fingerprints"] == []
    checks = {(v["check"], v["construction"]) for v in entry["verdicts"]}
    assert ("cache bit-exact", "packed prefill vs live") in checks
    assert ("replica bit-exact", "packed prefill") in checks
