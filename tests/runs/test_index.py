"""`reports/index.md`: one row per environment key per case, the newest run of each winning, GPU,
driver, CUDA, torch and triton as columns, built from summary.json alone; ledgers add runs that
have no report yet; each run links its report (report.html from the HTML page, which is
self-contained otherwise and shows no Markdown marks)."""

import re
import sqlite3
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import pytest

from fake_nvml import H200, FakeNVML  # tests/ is on sys.path (pytest's rootdir-less import mode)
from kvfid.environment import envinfo
from kvfid.runs.case import load_case
from kvfid.reports.document import Table, markdown
from kvfid.reports.index import update_index
from kvfid.reports.index_page import index_document
from kvfid.ledger.store import Ledger
from kvfid.reports.report import write_report

SMOKE = load_case(Path(__file__).resolve().parents[2] / "cases" / "smoke.toml")


def copy_run(db, source: str, new_id: str, environment: dict, tamper=None) -> str:
    """Run `source` stored again as `new_id`, measured (says its record) in `environment`."""
    key = envinfo.environment_key(environment)
    with Ledger(db) as ledger:
        ledger.create_run(new_id, SMOKE, environment, key)
        for unit in ledger.units(source):
            record = tamper(unit) if tamper else unit.record
            ledger.write_unit(new_id, unit.item_index, unit.item_id, unit.stack, record, key)
        ledger.finish(new_id)
    return new_id


def break_prefill(unit):
    """sdpa/bf16@t1's prefill state differs from live on every item."""
    record = unit.record
    if unit.stack != "sdpa/bf16@t1" or record.status != "ok":
        return record
    broken = lambda c: replace(c, cache=replace(c.cache, bit_exact=False)) \
        if (c.b, c.kind) == ("prefill", "arm") else c
    return replace(record, comparisons=tuple(broken(c) for c in record.comparisons))


@pytest.fixture(scope="module")
def reports(tmp_path_factory, smoke_run):
    """A reports folder with four run reports on three environment keys (CPU; H200 on driver
    570, twice; H200 on 575), and a ledger with a fourth key's run that has no report."""
    folder = tmp_path_factory.mktemp("index")
    db, root = folder / "ledger.sqlite", folder / "reports"
    with closing(sqlite3.connect(smoke_run[0])) as source, closing(sqlite3.connect(db)) as target:
        source.backup(target)      # the session's smoke run (harness tests/conftest.py)
    cpu = smoke_run[1]
    gpu = lambda driver: envinfo.collect(FakeNVML([H200], driver_version=driver))
    ids = {"cpu": cpu,
           "570-old": copy_run(db, cpu, "20260101-000000-0001", gpu("570.86.15")),
           "570": copy_run(db, cpu, "20260102-000000-0002", gpu("570.86.15"), break_prefill),
           "575": copy_run(db, cpu, "20260103-000000-0003", gpu("575.51.03"))}
    with Ledger(db) as ledger:
        for run_id in ids.values():
            write_report(ledger, run_id, root)
    ids["580"] = copy_run(db, cpu, "20260104-000000-0004", gpu("580.65.06"))
    return root, db, ids


def table(text: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """(head, rows) of the first Markdown table under `heading`."""
    section = text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    cells = lambda line: [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    head, *rows = [cells(l) for l in section.splitlines()
                   if l.startswith("|") and not l.startswith("|---")]
    return head, rows


LINK = re.compile(r"\[([^\]]+)\]\(([^)]+)\)")


def link(cell: str) -> tuple[str, str]:
    """(text, target) of a Markdown link cell."""
    found = LINK.fullmatch(cell)
    assert found, cell
    return found[1], found[2]


def test_a_grid_per_case_environments_down_stacks_across(reports):
    root, _, ids = reports
    path = update_index(root)
    assert path == root / "index.md" and (root / "index.html").is_file()
    head, rows = table(path.read_text(), "## Case smoke")
    assert head == ["environment, run", "sdpa/bf16@t1", "eager/bf16@t1"]
    assert len(rows) == 3                       # CPU, 570, 575: the 580 run has no report
    by_driver = {re.search(r"driver (\S+)|^(CPU)", row[0]).group(1) or "cpu": dict(zip(head, row))
                 for row in rows}
    assert set(by_driver) == {"cpu", "570.86.15", "575.51.03"}
    assert by_driver["570.86.15"]["environment, run"].startswith("NVIDIA H200 · driver 570.86.15")
    run = LINK.search(by_driver["570.86.15"]["environment, run"])
    assert run[1] == ids["570"]                                 # the newer of the two 570 runs
    assert run[2].endswith(f"/{ids['570']}/report.md") and (root / run[2]).is_file()
    # The newest 570 run's prefill broke: its cell says so, in words and (HTML) in colour.
    broken = by_driver["570.86.15"]["sdpa/bf16@t1"]
    assert broken.startswith("[cache differs](") and ": cache 0/" in broken
    assert by_driver["575.51.03"]["eager/bf16@t1"].split(")", 1)[1] == \
        by_driver["cpu"]["eager/bf16@t1"].split(")", 1)[1]
    cell = re.fullmatch(r"\[(bit-exact|cache differs|diverges)\]\(([^)]+)\): cache \d+/\d+ "
                        r"bit-exact, suffix ≠ live \d+/\d+ \(.*%\) \[.*%, .*%\]",
                        by_driver["cpu"]["sdpa/bf16@t1"])
    assert cell and cell[2].endswith(f"/{ids['cpu']}/report.md")
    assert 'class="v-cache-differs"' in (root / "index.html").read_text()


def test_ledgers_add_runs_without_a_report(reports):
    root, db, ids = reports
    text = update_index(root, ledgers=[db]).read_text()
    head, rows = table(text, "## Case smoke")
    assert len(rows) == 4 and any("driver 580.65.06" in row[0] for row in rows)
    assert ids["580"] in text and "not written" in text
    # A run with a report is taken from it, not recomputed from the ledger.
    _, shown = table(text, "## Runs shown")
    text, target = link([r for r in shown if r[2] == ids["575"]][0][3])
    assert text == "report" and target.endswith(f"{ids['575']}/report.md")
    assert [r for r in shown if r[2] == ids["580"]][0][3].startswith("not written")


def test_index_html_links_each_report_and_is_otherwise_self_contained(reports):
    root, _, ids = reports
    update_index(root)
    page = (root / "index.html").read_text()
    assert ids["575"] in page and "<table>" in page
    assert not re.search(r"\bsrc\s*=", page) and "<script" not in page \
        and "<link" not in page and "url(" not in page
    targets = re.findall(r'href="([^"]+)"', page)
    for run in ("cpu", "570", "575"):
        assert any(t.endswith(f"/{ids[run]}/report.html") for t in targets), run
    assert all(not t.startswith(("/", "http:", "https:")) and (root / t).is_file()
               for t in targets), targets
    assert "`" not in page and "<code>kvfid compare KEY_A KEY_B</code>" in page


def test_an_empty_reports_folder_gives_an_index_that_says_so(tmp_path):
    text = update_index(tmp_path / "reports").read_text()
    assert "No run reports yet" in text


def _entry(run: str, environment: dict, stacks: dict, repro=None) -> dict:
    return {"run": run, "case": "c", "status": "finished", "environment": environment,
            "environment_key": envinfo.environment_key(environment), "git_revision": None,
            "date": None, "stacks": stacks, "repro": repro or {}, "report": None,
            "report_html": None, "kernels": None, "kernels_html": None}


CONS = {"constructions": {"prefill": {"kind": "arm", "cache_bit_exact": {"k": 2, "n": 2},
                                      "suffix_disagree": {"k": 0, "n": 2, "rate": 0.0,
                                                          "ci": [0.0, 0.66]}}}}


def test_an_old_cpu_key_folds_under_the_key_that_replaced_it_and_old_labels_take_threads():
    versions = {"torch": "2.13.0+cpu", "triton": "3.9.0"}
    old = _entry("r-old", {"cpu": {"model": "Intel Xeon"}, "versions": versions},
                 {"sdpa/bf16": CONS}, {"sdpa/bf16": "kvfid repro --backend sdpa --threads 1"})
    new = _entry("r-new", {"cpu": {"model": "Intel Xeon", "capability": "AVX512"},
                           "versions": versions}, {"sdpa/bf16@t1": CONS})
    alone = _entry("r-amd", {"cpu": {"model": "AMD EPYC"}, "versions": versions},
                   {"sdpa/bf16": CONS}, {"sdpa/bf16": "kvfid repro --threads 2"})
    text = markdown(index_document([old, new, alone]))
    head, rows = table(text, "## Case c")
    assert head[0] == "environment, run" and sorted(head[1:]) == ["sdpa/bf16@t1", "sdpa/bf16@t2"]
    assert len(rows) == 2                       # the old Intel key is a note in the new key's row
    intel = dict(zip(head, next(r for r in rows if "Intel" in r[0])))
    assert "r-new" in intel["environment, run"]
    assert f"earlier key {old['environment_key']}: run r-old" in intel["environment, run"]
    assert intel["sdpa/bf16@t1"].startswith("bit-exact: cache 2/2") and intel["sdpa/bf16@t2"] == "-"
    amd = dict(zip(head, next(r for r in rows if "AMD" in r[0])))   # nothing replaced it: marked
    assert "key from before the CPU instruction set" in amd["environment, run"]
    assert amd["sdpa/bf16@t2"].startswith("bit-exact")


def test_many_stacks_turn_the_grid_and_too_many_both_ways_split_it():
    gpu = lambda d: {"gpus": [{"name": "NVIDIA H200", "driver_version": d}], "versions": {}}
    stacks = {f"sdpa/bf16@t{t}": CONS for t in range(1, 10)}
    few = [_entry(f"r{d}", gpu(d), stacks) for d in ("570", "575")]
    head, rows = table(markdown(index_document(few)), "## Case c")
    assert head[0] == "stack" and len(head) == 3 and len(rows) == 9
    many = [_entry(f"r{d}", gpu(str(d)), stacks) for d in range(500, 510)]
    tables = [b for b in index_document(many) if isinstance(b, Table)][:-1]
    assert [len(t.head) for t in tables] == [7, 4] and all(len(t.rows) == 10 for t in tables)
