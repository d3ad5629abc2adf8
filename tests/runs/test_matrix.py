"""Matrix runs on cases/smoke.toml: rows land, resume and shards lose and duplicate nothing,
audit passes on an unchanged run and names what a tampered fingerprint changed."""

import sqlite3
from pathlib import Path

import pytest
import torch

from kvfid.runs import matrix
from kvfid.runs.case import CaseError, load_case, parse_case
from kvfid.ledger.store import Ledger, LedgerError
from kvfid.runs.audit import audit_run
from kvfid.runs.matrix import plan_units, run_case
from kvfid.runs.shards import Shard, parse_shard
from kvfid.inputs.models import load_model

CASES = Path(__file__).resolve().parents[2] / "cases"
SMOKE = load_case(CASES / "smoke.toml")


@pytest.fixture(scope="module")
def model():
    return load_model(SMOKE.model)


@pytest.fixture
def full(smoke_run):
    """The session's unsharded, uninterrupted smoke run (read only): (db path, run id)."""
    return smoke_run


def stored(db, run_id):
    """{(item, stack): {(kind, label): fingerprints}} and the row count of a run."""
    with Ledger(db) as ledger:
        prints = ledger.stored_fingerprints(ledger.run(run_id).id)
        (rows,) = ledger.db.execute("SELECT COUNT(*) FROM rows WHERE run_id = ?",
                                    (run_id,)).fetchone()
    return prints, rows


def test_smoke_run_lands_every_unit_and_its_rows(full):
    db, run_id = full
    with Ledger(db) as ledger:
        run = ledger.run(run_id)
        units = ledger.units(run_id)
    assert run.status == "finished" and run.finished and run.case_text == SMOKE.text
    assert run.environment["versions"]["torch"] == torch.__version__
    assert run.environment_key.startswith("cpu")
    assert {(u.item_index, u.stack) for u in units if not u.is_crossing} == {
        (i, s) for i in range(3) for s in ("sdpa/bf16@t1", "eager/bf16@t1")}
    assert sorted(u.item_index for u in units if u.is_crossing) == [0, 1, 2]
    item = next(u for u in units if u.stack == "sdpa/bf16@t1" and u.status == "ok").record
    assert {"live", "prefill", "incremental", "batched:2"} <= set(item.arms)
    prints, rows = stored(db, run_id)
    assert rows >= 9 and all(prints.values())


def test_units_run_stack_by_stack_then_the_crossing():
    units = plan_units(SMOKE)
    assert [(u.item_index, u.stack) for u in units[:4]] == [
        (0, "sdpa/bf16@t1"), (1, "sdpa/bf16@t1"), (2, "sdpa/bf16@t1"), (0, "eager/bf16@t1")]
    assert units[-1].is_crossing and units[-1] == matrix.Unit.crossing(2)
    assert [u.item_index for u in plan_units(SMOKE, Shard(1, 2))] == [1, 1, 1]


def test_units_of_a_stack_with_an_item_limit_stop_there():
    """A stack limited to its first item (`items = 1`, for an expensive stack) runs there only; the
    others on every item. The CPU default case runs every stack, its headline too, on all 8."""
    text = ('model = "tiny-llama"\nB = 2\nS = 2\nconstructions = ["live", "prefill"]\n'
            '[items]\nset = "arith"\nn = 3\n[[stacks]]\nbackends = ["triton"]\ndtypes = ["bf16"]\n'
            'batch_invariant = [true]\nthreads = 1\nitems = 1\n[[stacks]]\nbackends = ["sdpa"]\n'
            'dtypes = ["bf16", "fp32"]\nthreads = 1\n')
    case = parse_case(text)
    units = [(u.item_index, u.stack) for u in plan_units(case) if not u.is_crossing]
    assert [u for u in units if u[1] == "triton/bf16+bi@t1"] == [(0, "triton/bf16+bi@t1")]
    assert len(units) == 1 + 2 * 3 == case.design()["units"] - case.design()["crossing_items"]
    cpu = load_case(CASES / "smollm2-cpu.toml")
    units = [(u.item_index, u.stack) for u in plan_units(cpu) if not u.is_crossing]
    assert len(units) == len(cpu.stacks) * cpu.items.n and cpu.items.n >= 8
    assert {i for i, stack in units if stack == "native/bf16+bi@t1"} == set(range(cpu.items.n))


def test_resume_after_an_interruption_neither_loses_nor_duplicates(full, model, tmp_path,
                                                                   monkeypatch):
    db = tmp_path / "ledger.sqlite"
    real, calls = matrix.Matrix.measure, []

    def measure_then_interrupt(self, unit):
        calls.append(unit)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, unit)

    monkeypatch.setattr(matrix.Matrix, "measure", measure_then_interrupt)
    with pytest.raises(matrix.RunInterrupted) as stop:
        run_case(SMOKE, db, model=model, progress=False)
    with Ledger(db) as ledger:
        (run, count), = ledger.runs()
    assert run.status == "interrupted" and count == 3 and stop.value.run_id == run.id
    monkeypatch.setattr(matrix.Matrix, "measure", real)
    result = run_case(SMOKE, db, resume=run.id, model=model, progress=False)
    assert (result.status, result.measured, result.skipped) == ("finished", 6, 3)
    assert stored(db, run.id) == stored(*full)


def test_two_shards_into_one_run_equal_the_unsharded_run(full, model, tmp_path):
    db = tmp_path / "ledger.sqlite"
    first = run_case(SMOKE, db, run_id="sharded", shard=Shard(0, 2), model=model,
                     progress=False)
    assert first.status == "partial" and first.planned == 6
    second = run_case(SMOKE, db, run_id="sharded", shard=Shard(1, 2), model=model,
                      progress=False)
    assert second.status == "finished" and second.planned == 3
    assert stored(db, "sharded") == stored(*full)


def test_resume_refuses_another_case(smoke_copy, model):
    db, run_id = smoke_copy
    with pytest.raises(CaseError, match="cannot continue it"):
        run_case(SMOKE, db, items=2, resume=run_id, model=model, progress=False)
    changed = SMOKE.__class__(**{**SMOKE.__dict__, "B": 5, "sha": "another"})
    with pytest.raises(CaseError, match="cannot continue it"):
        run_case(changed, db, run_id=run_id, model=model, progress=False)
    with pytest.raises(LedgerError, match="no run"):
        run_case(SMOKE, db, resume="no-such-run", model=model, progress=False)


def test_audit_passes_unchanged_and_names_a_tampered_fingerprint(full, model, tmp_path):
    db, run_id = full
    result = audit_run(db, run_id, model=model, progress=False)
    assert result.passed and result.same_environment and result.units == 9
    assert "PASS" in result.text()

    copy = tmp_path / "tampered.sqlite"
    with sqlite3.connect(db) as source, sqlite3.connect(copy) as target:
        source.backup(target)
    with sqlite3.connect(copy) as conn:
        conn.execute("UPDATE rows SET fingerprints = json_set(fingerprints, '$.cache_sha', "
                     "'tampered') WHERE run_id = ? AND item_index = 1 AND stack = 'eager/bf16@t1' "
                     "AND kind = 'boundary' AND label = 'prefill'", (run_id,))
    result = audit_run(copy, run_id, items=2, model=model, progress=False)
    assert not result.passed and result.units == 6
    (difference,) = result.differences
    assert (difference.item_id, difference.stack, difference.label, difference.field) == (
        "arith-0001", "eager/bf16@t1", "prefill", "cache_sha")
    assert "FAIL" in result.text() and "item arith-0001 (#1) stack eager/bf16@t1 boundary " \
                                       "prefill cache_sha: stored 'tampered'" in result.text()


def test_audit_on_another_environment_reports_a_regression(full, model, monkeypatch):
    db, run_id = full
    monkeypatch.setattr(matrix.envinfo, "environment_key", lambda record: "other/gpu")
    result = audit_run(db, run_id, items=1, model=model, progress=False)
    assert result.passed and not result.same_environment
    assert "another environment" in result.text()


def test_problems_are_refused_before_any_compute(monkeypatch, tmp_path):
    monkeypatch.setattr(matrix, "load_model", lambda name: pytest.fail("model loaded"))
    if not torch.cuda.is_available():
        with pytest.raises(matrix.EnvironmentUnavailable, match="no CUDA device"):
            run_case(load_case(CASES / "gpu-qwen2.5-shape.toml"), tmp_path / "l.sqlite")
    bad_items = SMOKE.__class__(**{**SMOKE.__dict__,
                                   "items": SMOKE.items.__class__("jsonl:/nowhere.jsonl", 2)})
    with pytest.raises(CaseError, match=r"\[items\] set = 'jsonl:/nowhere.jsonl'"):
        run_case(bad_items, tmp_path / "l.sqlite")
    assert not (tmp_path / "l.sqlite").exists()


@pytest.mark.parametrize("text", ["2/2", "a/b", "1", "-1/2"])
def test_bad_shards_are_refused(text):
    with pytest.raises(ValueError, match="bad shard"):
        parse_shard(text)


def test_resume_keeps_the_item_count_of_the_stored_run(model, tmp_path):
    db = tmp_path / "ledger.sqlite"
    first = run_case(SMOKE, db, items=1, shard=Shard(1, 2), model=model, progress=False)
    assert (first.status, first.planned) == ("partial", 0)
    resumed = run_case(SMOKE, db, resume=first.run_id, model=model, progress=False)
    assert (resumed.status, resumed.measured) == ("finished", 3)


def test_a_crash_marks_the_run_crashed_and_resumable(model, tmp_path, monkeypatch):
    def explode(self, unit):
        raise RuntimeError("kernel fault")

    monkeypatch.setattr(matrix.Matrix, "measure", explode)
    with pytest.raises(RuntimeError):
        run_case(SMOKE, tmp_path / "l.sqlite", items=1, model=model, progress=False)
    with Ledger(tmp_path / "l.sqlite") as ledger:
        (run, count), = ledger.runs()
    assert (run.status, run.error, count) == ("crashed", "RuntimeError: kernel fault", 0)


def test_publish_opens_the_ledger_once_and_aggregates_once(model, tmp_path, monkeypatch):
    """run -> aggregate -> report -> index on one open ledger (a new file: after the checks)."""
    from kvfid.reports import report
    from kvfid.ledger import store as ledger_module
    from kvfid.tasks import publish as publish_module

    opened, aggregated = [], []
    real_init, real_aggregate = ledger_module.Ledger.__init__, report.aggregate
    monkeypatch.setattr(ledger_module.Ledger, "__init__",
                        lambda self, *a, **k: (opened.append(a), real_init(self, *a, **k))[1])
    monkeypatch.setattr(report, "aggregate",
                        lambda *a, **k: (aggregated.append(1), real_aggregate(*a, **k))[1])
    done = publish_module.publish(SMOKE, tmp_path / "l.sqlite", reports=tmp_path / "reports",
                                  items=2, model=model, progress=False)
    assert (len(opened), len(aggregated)) == (1, 1)
    assert done.result.status == "finished" and "sdpa/bf16@t1" in done.headline()
    assert set(done.files) == {"markdown", "html", "summary", "index"}
    assert all(path.is_file() for path in done.files.values())


def test_a_stored_run_is_published_once_more_from_its_result(smoke_copy, tmp_path):
    """What rank 0 of a torchrun launch does with the run the ranks measured."""
    from kvfid.tasks.ledger_views import publish_result

    db, run_id = smoke_copy
    result = matrix.RunResult(run_id, "finished", 0, 9, 9)
    done = publish_result(db, result, report=True, out=tmp_path / "reports")
    assert set(done.summary.stacks) == {"sdpa/bf16@t1", "eager/bf16@t1"}
    assert done.summary.crossing.items == 3
    assert done.files["html"].parent.name == run_id
