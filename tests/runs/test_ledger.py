"""The ledger: one transaction per unit, no duplicates, run lookup, merge, rows of a record."""

import dataclasses
import json
import sqlite3
from pathlib import Path

import pytest

from kvfid.records import record as rec
from kvfid.ledger import store as ledger_module
from kvfid.runs.case import load_case
from kvfid.ledger.store import Ledger, LedgerError, fingerprints, record_rows

CASE = load_case(Path(__file__).resolve().parents[2] / "cases" / "smoke.toml")
ENV = {"git": {"revision": "abc", "dirty": True}, "gpus": []}


def item_record(suffix=(1, 2, 3), cache="c0") -> rec.ItemRecord:
    """A minimal `run_item` record with one arm pair, a replica and a transplant."""
    arm = lambda label, c: rec.ArmRecord(label, tuple(suffix), (1.0,) * len(suffix),
                                         suffix_sha=f"s-{suffix}", cache_sha=c, logits_sha="l",
                                         wall_s=0.1, forward_calls=3)
    same = rec.SuffixDiff(identical=True)
    return rec.ItemRecord(
        rec.ItemRef("i0", "p"), "tiny", {"label": "sdpa/bf16"}, 2, 3, "ok", prompt_length=1,
        prefix=(5, 6, 7), prefix_sha="p-sha",
        arms={"live": arm("live", cache), "prefill": arm("prefill", "c1")},
        comparisons=(rec.Comparison("live", "prefill", "arm", same),),
        replicas=(rec.Replica("prefill", rec.Fingerprints(cache_sha="c1"),
                              rec.Comparison("prefill", "prefill", "replica", same)),),
        transplants=(rec.TransplantRecord("live<-prefill:all", "live", "prefill", "all", True,
                                          "recipient", suffix_sha="t"),))


@pytest.fixture
def db(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        yield ledger


def test_rows_of_a_record_carry_every_fingerprint():
    prints = fingerprints(item_record())
    assert prints[("prefix", "P")] == {"prefix_sha": "p-sha"}
    assert prints[("boundary", "live")] == {"cache_sha": "c0", "logits_sha": "l",
                                            "suffix_sha": "s-(1, 2, 3)"}
    assert prints[("replica", "prefill~prefill'")] == {
        "verdict": "cache n/a, logits n/a, suffix identical", "cache_sha": "c1"}
    assert prints[("transplant", "live<-prefill:all")] == {"suffix_sha": "t",
                                                           "outcome": "recipient"}
    short = rec.ItemRecord(rec.ItemRef("i1"), "tiny", {}, 2, 3, "short", note="EOS",
                           arms={"live": rec.ArmRecord("live", generated=(1, 2))})
    assert [r[:2] for r in record_rows(short)] == [("short", "live")]


def test_a_unit_is_written_once_with_its_rows(db):
    run = db.create_run("r1", CASE, ENV, "cpu/key")
    assert run.status == "running" and run.git_revision == "abc+dirty"
    assert run.design["units"] == 9
    assert db.write_unit("r1", 0, "i0", "sdpa/bf16", item_record(), "cpu/key")
    assert not db.write_unit("r1", 0, "i0", "sdpa/bf16", item_record(cache="other"), "cpu/key")
    (rows,) = db.db.execute("SELECT COUNT(*) FROM rows").fetchone()
    assert rows == len(record_rows(item_record()))
    assert db.stored_units("r1") == {(0, "sdpa/bf16")}
    assert db.units("r1")[0].record == item_record()


def test_a_failing_row_insert_leaves_no_half_unit(db, monkeypatch):
    db.create_run("r1", CASE, ENV, "cpu/key")
    twice = lambda record: [("prefix", "P", {}, {})] * 2   # duplicate primary key
    monkeypatch.setattr(ledger_module, "record_rows", twice)
    with pytest.raises(sqlite3.IntegrityError):
        db.write_unit("r1", 0, "i0", "sdpa/bf16", item_record(), "cpu/key")
    assert db.stored_units("r1") == set()
    assert db.db.execute("SELECT COUNT(*) FROM rows").fetchone() == (0,)


def test_run_lookup_by_id_prefix_and_latest(db):
    db.create_run("20250101-000000-aaaa", CASE, ENV, "k")
    db.create_run("20250101-000000-aabb", CASE, ENV, "k")
    assert db.run("20250101-000000-aabb").id.endswith("aabb")
    assert db.run("20250101-000000-aab").id.endswith("aabb")
    with pytest.raises(LedgerError, match="matches 2 runs"):
        db.run("20250101")
    with pytest.raises(LedgerError, match="no run 'zzz'"):
        db.run("zzz")
    assert db.run("latest").id.endswith("aabb")


def test_status_finished_only_when_complete(db):
    db.create_run("r1", CASE, ENV, "k")
    db.write_unit("r1", 0, "i0", "sdpa/bf16", item_record(), "k")
    assert db.finish("r1") == "partial"
    db.set_status("r1", "interrupted")
    assert db.run("r1").status == "interrupted" and db.run("r1").finished


def test_merge_takes_the_union_and_reports_conflicts(db):
    for run_id in ("a", "b", "c"):
        db.create_run(run_id, CASE, ENV, "k")
    db.write_unit("a", 0, "i0", "sdpa/bf16", item_record(), "k")
    db.write_unit("b", 1, "i1", "sdpa/bf16", item_record(), "k")
    db.write_unit("b", 0, "i0", "sdpa/bf16", item_record(), "k")          # identical: skipped
    merged, copied, conflicts = db.merge(["a", "b"], into="ab")
    assert (merged.id, copied, conflicts) == ("ab", 2, [])
    assert db.stored_units("ab") == {(0, "sdpa/bf16"), (1, "sdpa/bf16")}
    db.write_unit("c", 0, "i0", "sdpa/bf16", item_record(cache="changed"), "k")
    _, copied, conflicts = db.merge(["a", "c"])
    assert copied == 1 and conflicts == [("c", 0, "sdpa/bf16")]


def test_merge_refuses_other_cases_and_environments(db):
    db.create_run("a", CASE, ENV, "k")
    db.create_run("b", CASE.with_item_count(2), ENV, "k")
    db.create_run("c", CASE, ENV, "other-gpu/k")
    with pytest.raises(LedgerError, match="different cases"):
        db.merge(["a", "b"])
    with pytest.raises(LedgerError, match="different environments"):
        db.merge(["a", "c"])


def test_the_ledger_file_is_in_wal_mode(tmp_path):
    with Ledger(tmp_path / "x" / "l.sqlite") as ledger:
        assert ledger.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        ledger.create_run("r", CASE, ENV, "k")
    stored = sqlite3.connect(tmp_path / "x" / "l.sqlite").execute(
        "SELECT case_text, environment FROM runs").fetchone()
    assert stored[0] == CASE.text and json.loads(stored[1]) == ENV


def test_a_record_of_another_schema_is_refused_in_one_line(db):
    db.create_run("r1", CASE, ENV, "k")
    db.write_unit("r1", 0, "i0", "sdpa/bf16", item_record(), "k")
    text = json.dumps({**json.loads(rec.to_json(item_record())), "schema": 2})
    db.db.execute("UPDATE units SET record = ?", (text,))
    with pytest.raises(ledger_module.LedgerRefused,
                       match=r"run r1 item #0 stack sdpa/bf16: record schema 2 is not this"):
        db.units("r1")


def test_a_schema_another_writer_creates_between_two_reads_is_not_refused(tmp_path):
    """Two torchrun ranks opening one new ledger: the other rank's schema committed between
    this open's version read and its tables read would look like tables without a kvfid version
    (refused: seen in a fresh `make test`). Read in one transaction, the other writer's commit
    waits for it, and the open goes on to find that schema."""
    import threading

    from kvfid.ledger import opening

    path = tmp_path / "ranks.sqlite"
    sqlite3.connect(path).close()            # the empty file a rank's connect leaves
    other = threading.Thread(target=lambda: Ledger(path).close())

    class OtherWriterAfterTheVersion:
        def __init__(self, db):
            self.db = db

        def execute(self, sql, *args):
            cursor = self.db.execute(sql, *args)
            if sql.startswith("PRAGMA user_version") and not other.is_alive() \
                    and other.ident is None:
                other.start()
                other.join(timeout=1)            # its commit waits for this read transaction
            return cursor

    db = sqlite3.connect(path, timeout=60, isolation_level=None)
    assert opening._inspect(OtherWriterAfterTheVersion(db), path, write=True) == 0
    assert opening._prepare(db, path, 0) == opening.SCHEMA_VERSION   # the other writer's schema
    db.close()
    other.join()
    with Ledger(path) as ledger:
        assert ledger.version == opening.SCHEMA_VERSION


def test_a_unit_stored_with_a_retired_field_reads_back_and_only_that_field_is_skipped(db):
    """A unit stored while CacheDiff still held its constant `d_rel_aggregation` (what ledgers
    wrote before the comparisons were typed) loads from the ledger with every attribute; the
    retired name is skipped only where its class names it, any other unknown field is refused."""
    from kvfid.records.plain import from_plain

    cache = rec.CacheDiff(bit_exact=False, first_bad_layer=1, first_bad_kv="v", bad_layers=(1,),
                          n_diff=2, max_ulp=3, d_rel=0.5, first_position=4,
                          layers=(rec.LayerDiff(0), rec.LayerDiff(1, v=rec.TensorDiff(
                              equal=False, n_diff=2, max_ulp=3, d_rel=0.5, first_position=4))))
    comparison = rec.Comparison("live", "prefill", "arm", rec.SuffixDiff(identical=True),
                                cache=cache, logits=rec.LogitsDiff())
    item = dataclasses.replace(item_record(), comparisons=(comparison,))
    data = json.loads(item.to_json())
    data["comparisons"][0]["cache"]["d_rel_aggregation"] = "Frobenius norm over every layer"
    db.create_run("r1", CASE, ENV, "k")
    db.write_unit("r1", 0, "i0", "sdpa/bf16", item, "k")
    db.db.execute("UPDATE units SET record = ?", (json.dumps(data),))
    assert "d_rel_aggregation" in db.db.execute("SELECT record FROM units").fetchone()[0]
    (unit,) = db.units("r1")
    read = unit.record.comparisons[0].cache
    assert read == cache and (read.first_bad_layer, read.first_bad_kv, read.max_ulp) == (1, "v", 3)
    assert read.layers[1].v.first_position == 4
    with pytest.raises(ValueError, match="no field"):
        from_plain(rec.LogitsDiff, {"equal": True, "d_rel_aggregation": "x"})
    with pytest.raises(ValueError, match="no field"):
        from_plain(rec.CacheDiff, {"bit_exact": True, "d_rel_aggregate": "x"})
