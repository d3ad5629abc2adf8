"""An engine check in the ledger, without vLLM: the record's round trip, storing it under the
environment key with the engine's version, reading it back (and from ledgers older than schema 3,
which hold none), its checksum, the report through the document engine, and the commands
(`engine-check --db/--report` on a measured result put in place of vLLM, `engine-report`).
The measurement itself is tested in tests/engines/with_vllm (`make test-vllm`)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import sqlite3
import sys

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.engines import check as engine_check
from kvfid.records.engine import EngineCheckRecord, EngineKV, from_result
from kvfid.records.read import from_json
from kvfid.reports import engine_report
from kvfid.ledger import engine_checks as engine_ledger
from kvfid.ledger.store import Ledger
from kvfid.ledger.opening import LedgerRefused
from kvfid.tasks.engine_store import store_result

KV = {"items": 2, "items_exact": 1, "first_bad_layer": 3, "first_position": 17, "n_diff": 40,
      "max_abs": 0.0078125, "max_ulp": 2, "d_rel": 1.25e-3, "positions": 90,
      "d_rel_per_layer": [0.0, 0.0, 0.0, 1e-3, 1.25e-3], "d_rel_aggregation": "the worst item"}
EXACT_KV = {**KV, "items_exact": 2, "first_bad_layer": None, "first_position": None, "n_diff": 0,
            "max_abs": 0.0, "max_ulp": 0, "d_rel": 0.0, "d_rel_per_layer": [0.0] * 5}
RESULT = {"model": "smollm2-135m", "folder": "/models/smollm2", "dtype": "bf16",
          "engine": "vllm 0.32.0", "prompts": 2, "tokens": 8, "chunk": 32, "item_set": "arith",
          "batch_invariant": False, "batch_invariant_note": None, "faithful": False, "kv": True,
          "wall_s": 3.25, "threads": 1, "block_size": 128,
          "rows": [{"construction": "decode vs prefill re-scoring", "tokens": 16, "differ": 5,
                    "max_abs": 0.02, "items_exact": 0, "items": 2, "kv": KV},
                   {"construction": "decode alone vs batched", "tokens": 13, "differ": 0,
                    "max_abs": 0.0, "items_exact": 2, "items": 2, "diverged": 1, "kv": EXACT_KV},
                   {"construction": "prefix cache cold vs warm", "tokens": 16, "differ": 0,
                    "max_abs": 0.0, "items_exact": 2, "items": 2, "served_tokens": 32,
                    "kv": EXACT_KV}]}
ENVIRONMENT = {"versions": {"torch": "2.13.0+cpu", "triton": "3.9.0"},
               "cpu": {"model": "Test CPU", "capability": "AVX512"},
               "git": {"revision": "abc123", "dirty": True}}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_record_round_trips_and_gives_back_engine_checks_result():
    record = from_result(RESULT)
    assert record.rows[0].kv == EngineKV(**{**KV, "d_rel_per_layer": tuple(KV["d_rel_per_layer"])})
    assert from_json(record.to_json()) == record
    assert json.loads(record.to_json())["rows"][1]["diverged"] == 1
    assert "decode alone vs batched" in engine_check.render(record)
    assert not record.exact and record.label == "vllm 0.32.0/bf16"
    faithful = from_result({**RESULT, "faithful": True,
                            "rows": [r for r in RESULT["rows"] if r["differ"] == 0]})
    assert faithful.exact and faithful.label == "vllm 0.32.0/bf16+faithful"
    with pytest.raises(ValueError, match="no field"):
        from_result({**RESULT, "surprise": 1})
    before_blocks = {k: v for k, v in RESULT.items() if k != "block_size"}   # checks stored before
    assert from_result(before_blocks).block_size == 32                        # ran at kvfid's 32
    no_kv = from_result({**RESULT, "kv": False, "rows": [{k: v for k, v in r.items() if k != "kv"}
                                                         for r in RESULT["rows"]]})
    assert no_kv.rows[0].kv is None and from_json(no_kv.to_json()) == no_kv


def test_stored_under_the_environment_key_with_the_engine_and_read_back(tmp_path):
    db = tmp_path / "ledger.sqlite"
    stored = store_result(db, RESULT, ENVIRONMENT)
    assert stored.id.startswith("engine-") and stored.engine == "vllm 0.32.0"
    assert stored.environment_key == "cpu-Test-CPU-avx512/none/none/2.13.0+cpu/3.9.0"
    assert stored.git_revision == "abc123+dirty" and stored.environment["engine"] == "vllm 0.32.0"
    second = store_result(db, {**RESULT, "faithful": True}, ENVIRONMENT)
    before = _sha(db)
    with Ledger(db, readonly=True) as ledger:
        assert [s.id for s in engine_ledger.checks(ledger)] == [stored.id, second.id]
        assert engine_ledger.check(ledger, "latest") == second
        assert engine_ledger.check(ledger, stored.id).record == from_result(RESULT)
        assert ledger.runs() == []                         # an engine check is not a run
    assert _sha(db) == before
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        row = conn.execute("SELECT environment_key, engine FROM engine_checks WHERE id = ?",
                           (stored.id,)).fetchone()
        assert row == (stored.environment_key, "vllm 0.32.0")
        conn.execute("UPDATE engine_checks SET record = replace(record, '\"differ\":5', "
                     "'\"differ\":0') WHERE id = ?", (stored.id,))
    with Ledger(db, readonly=True) as ledger, pytest.raises(LedgerRefused, match="SHA-256"):
        engine_ledger.check(ledger, stored.id)


def test_a_schema_2_ledger_holds_none_and_a_write_migrates_it(tmp_path):
    db = tmp_path / "ledger.sqlite"
    Ledger(db).close()
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.executescript("DROP TABLE engine_checks; PRAGMA user_version=2;")
    before = _sha(db)
    with Ledger(db, readonly=True) as ledger:
        assert ledger.version == 2 and engine_ledger.checks(ledger) == []
    assert _sha(db) == before
    store_result(db, RESULT, ENVIRONMENT)
    with Ledger(db, readonly=True) as ledger:
        assert ledger.version == 3 and len(engine_ledger.checks(ledger)) == 1


def test_the_report_holds_both_tables_and_colours_the_verdicts(tmp_path):
    stored = store_result(tmp_path / "ledger.sqlite", RESULT, ENVIRONMENT)
    files = engine_report.write_report(stored, tmp_path / "reports")
    assert files["markdown"].parent == tmp_path / "reports" / stored.environment_key / stored.id
    text = files["markdown"].read_text()
    assert "**Differs** in 1 of 3 rows: decode vs prefill re-scoring." in text
    assert "| decode vs prefill re-scoring | 5/16 | 0.02 | 0/2 |  |" in text
    assert "| decode vs prefill re-scoring | 1/2 | 3 | 17 | 40 | 0.00781 | 2 | 0.00125 |" in text
    assert "| prefix cache cold vs warm | 2/2 | - | - | 0 | 0 | 0 | 0 |" in text
    assert "32 positions served by the prefix cache" in text and "1 items' greedy" in text
    assert "| 3 | 0.001 | 0 | 0 |" in text                         # d_rel per layer, numbers
    assert "kvfid engine-check --engine vllm --model smollm2-135m --dtype bf16 -n 2 --item-set arith " \
           "--tokens 8 --chunk 32 --kv" in text
    page = files["html"].read_text()
    assert 'class="v-diverges">5/16' in page and 'class="v-bit-exact">0/13' in page
    assert 'class="v-cache-differs">1/2' in page and "<svg" in page and "<svg" not in text
    assert from_json(files["record"].read_text()) == stored.record
    exact = store_result(tmp_path / "ledger.sqlite", {**RESULT, "rows": [
        {**r, "differ": 0, "items_exact": 2, "kv": EXACT_KV} for r in RESULT["rows"]]},
        ENVIRONMENT)
    text = engine_report.write_report(exact, tmp_path / "reports")["markdown"].read_text()
    assert "**Bit-exact**: every construction gave the same logprob bits and the same K and V" \
           in text and "0 at every layer, in every row" in text


def test_an_fp8_cache_check_is_stored_and_reported_in_both_formats(tmp_path):
    """An engine check of an fp8 cache: its format in the record, the label and the command to
    measure again; the report holds the stored-format table and the dequantized one, and a row
    whose stored bytes agree but whose dequantized values would not is not exact."""
    fp8_kv = {**KV, "max_abs": 0.25, "max_ulp": 3}
    values = {**KV, "max_abs": 0.25, "max_ulp": 8388608}
    rows = [{**r, "kv_dequantized": values if r["kv"] is KV else EXACT_KV,
             "kv": fp8_kv if r["kv"] is KV else EXACT_KV} for r in RESULT["rows"]]
    stored = store_result(tmp_path / "ledger.sqlite", {**RESULT, "rows": rows,
                                                       "kv_cache_dtype": "fp8_e4m3"}, ENVIRONMENT)
    record = stored.record
    assert record.kv_cache_dtype == "fp8_e4m3" and record.label.endswith("+kv:fp8_e4m3")
    assert record.rows[0].kv_dequantized.max_ulp == 8388608
    text = engine_report.write_report(stored, tmp_path / "reports")["markdown"].read_text()
    assert "stored format (fp8_e4m3 bytes and scales)" in text
    assert "The same engine states dequantized (fp32(stored) * scale)" in text
    assert "| decode vs prefill re-scoring | 1/2 | 3 | 17 | 40 | 0.25 | 3 | 0.00125 |" in text
    assert "| decode vs prefill re-scoring | 1/2 | 3 | 17 | 40 | 0.25 | 8388608 | 0.00125 |" in text
    assert "--kv-cache-dtype fp8_e4m3" in text and "fp8_e4m3 bytes, a scale per layer" in text
    rendered = engine_check.render(record)
    assert "in its stored format (fp8_e4m3 bytes and their scales)" in rendered
    assert "dequantized (fp32(stored) * scale)" in rendered
    odd = from_result({**RESULT, "kv_cache_dtype": "fp8_e4m3", "rows": [
        {**RESULT["rows"][1], "kv": EXACT_KV, "kv_dequantized": KV}]})
    assert not odd.exact                      # the dequantized verdict counts in the record's


@pytest.fixture
def measured(monkeypatch):
    """engine_check.engine_check answering RESULT (what vLLM would have measured)."""
    calls = []

    def fake(**options):
        calls.append(options)
        return from_result(copy.deepcopy(RESULT))
    monkeypatch.setattr(engine_check, "engine_check", fake)
    return calls


def test_engine_check_stores_and_reports_and_engine_report_reads_it_back(measured, tmp_path):
    db, out = tmp_path / "ledger.sqlite", tmp_path / "reports"
    shown = CliRunner().invoke(main, ["engine-check", "--kv", "-n", "2", "--tokens", "8",
                                      "--db", str(db), "--report", "--out", str(out)])
    assert shown.exit_code == 0, shown.output
    assert measured[0]["kv"] and measured[0]["count"] == 2
    assert "decode vs prefill re-scoring" in shown.output and f"ledger: {db}" in shown.output
    with Ledger(db, readonly=True) as ledger:
        (stored,) = engine_ledger.checks(ledger)
    assert (out / stored.environment_key / stored.id / "report.html").is_file()
    listed = CliRunner().invoke(main, ["engine-report", "--db", str(db), "--format", "json"])
    assert listed.exit_code == 0 and json.loads(listed.output)[0]["id"] == stored.id
    again = CliRunner().invoke(main, ["engine-report", stored.id[:20], "--db", str(db), "--out",
                                      str(tmp_path / "again")])
    assert again.exit_code == 0, again.output
    assert f"engine check {stored.id}" in again.output
    assert engine_check.render(from_result(RESULT)) in again.output
    assert (tmp_path / "again" / stored.environment_key / stored.id / "report.md").is_file()
    missing = CliRunner().invoke(main, ["engine-report", "nope", "--db", str(db)])
    assert missing.exit_code == 2 and "no engine check 'nope'" in missing.output


def test_engine_check_without_a_ledger_option_stores_nothing(measured, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(main, ["engine-check"])
    assert shown.exit_code == 0 and not (tmp_path / "reports").exists(), shown.output


def test_without_vllm_no_ledger_is_made(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)
    db = tmp_path / "ledger.sqlite"
    shown = CliRunner().invoke(main, ["engine-check", "--db", str(db), "--report", "--out",
                                      str(tmp_path / "reports")])
    assert shown.exit_code == 3 and "make install-vllm" in shown.output
    assert not db.exists() and not (tmp_path / "reports").exists()


def test_a_ledger_that_is_not_one_is_refused_before_compute(measured, tmp_path):
    db = tmp_path / "ledger.sqlite"
    db.write_text("not a ledger")
    shown = CliRunner().invoke(main, ["engine-check", "--db", str(db)])
    assert shown.exit_code == 3 and not measured and db.read_text() == "not a ledger"


def test_a_record_of_another_kind_in_the_table_is_refused(tmp_path):
    db = tmp_path / "ledger.sqlite"
    stored = store_result(db, RESULT, ENVIRONMENT)
    other = json.dumps({"schema": 3, "kind": "engine-check", "model": "m"})
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE engine_checks SET record = ?, record_sha = ? WHERE id = ?",
                     (other, hashlib.sha256(other.encode()).hexdigest(), stored.id))
    with Ledger(db, readonly=True) as ledger, pytest.raises(LedgerRefused, match=stored.id):
        engine_ledger.checks(ledger)
    assert isinstance(from_result(RESULT), EngineCheckRecord)
