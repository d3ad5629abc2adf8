"""Replay through a case file: [replay] units on tiny-llama land in the ledger as ReplayRecords,
the twin backend (a negative control) shows differing bits, the native faithful stack (the
Triton kernel's contract at CPU speed) with the batch-invariant mode shows none, the report says "exactly zero" only there, audit re-runs the units, bad keys exit 2."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.records import record, read as record_read
from kvfid.stacks.stack import Stack
from kvfid.diagnoses.replay import sample_trajectories
from kvfid.records.replay_record import LogprobMismatch, ReplayRecord
from kvfid.reports.report import document, headline
from kvfid.reports.document import markdown, to_html
from kvfid.reports.replay_report import EXACT
from kvfid.runs.audit import audit_run
from kvfid.runs.case import load_case
from kvfid.ledger.store import Ledger
from kvfid.runs.matrix import run_case
from protocol_fixtures import tiny


CASE = """
model = "tiny-llama"

[replay]
trajectories = "{path}"
constructions = ["prefill", "chunked:2"]

[[stacks]]
backends = ["native"]
dtypes = ["bf16"]
batch_invariant = [true]
threads = 1
items = 1

[[stacks]]
backends = ["sdpa", "twin"]
dtypes = ["bf16"]
threads = 1
"""


def kvfid(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def case_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replay")
    model = tiny()
    prompts = [(f"p{i}", model.codec.prompt_ids(text))
               for i, text in enumerate(("What is 2+3?", "Hi", "Count to three."))]
    rows = sample_trajectories(model, Stack("sdpa", "fp32", threads=1), prompts, 5, 1.0, 0)
    path = folder / "trajectories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    case = folder / "replay.toml"
    case.write_text(CASE.format(path=path))
    return case


@pytest.fixture(scope="module")
def replay_run(case_file, tmp_path_factory):
    db = tmp_path_factory.mktemp("ledger") / "l.sqlite"
    result = run_case(load_case(case_file), db, model=tiny(), progress=False)
    return db, result


def test_record_round_trip():
    m = LogprobMismatch(3, 1, 1 / 3, 0.5, 0.2, 1e-3, 2e-3, 2, (0.0, 0.0, 0.5), "ab")
    r = ReplayRecord(record.ItemRef("t"), "tiny-llama", {"label": "sdpa/bf16"}, 4, 3,
                     reference_sha="cd", constructions={"prefill": m, "chunked:2": m})
    back = record_read.from_json(r.to_json())
    assert back == r and isinstance(back.constructions["prefill"], LogprobMismatch)
    assert json.loads(r.to_json())["kind"] == "replay"


def test_replay_case_runs_through_the_matrix_into_the_ledger(replay_run):
    db, result = replay_run
    assert result.status == "finished" and result.measured == 1 + 3 + 3
    with Ledger(db) as ledger:
        units = ledger.units(result.run_id)
        rows = ledger.db.execute("SELECT kind, label, fingerprints FROM rows WHERE run_id = ? "
                                 "AND stack = 'sdpa/bf16@t1' AND item_index = 0",
                                 (result.run_id,)).fetchall()
    assert all(isinstance(u.record, ReplayRecord) for u in units)
    assert {u.item_id for u in units} == {"p0", "p1", "p2"}
    assert {(k, label) for k, label, _ in rows} == {("reference", "incremental"),
                                                    ("replay", "prefill"), ("replay", "chunked:2")}
    assert all(json.loads(prints)["logprobs_sha"] for _, _, prints in rows)


def test_twin_differs_the_faithful_stack_is_exactly_zero(replay_run, case_file):
    db, result = replay_run
    with Ledger(db) as ledger:
        run, units = ledger.run(result.run_id), ledger.units(result.run_id)
    from kvfid.runs.aggregate import aggregate

    summary = aggregate(units, run.design)
    replay = summary.replay
    for c in ("prefill", "chunked:2"):
        assert replay["twin/bf16@t1"][c]["differ"] > 0, c                 # the negative control
        exact = replay["native/bf16+bi@t1"][c]
        assert exact["differ"] == 0 and exact["max_abs"] == 0 and exact["tokens"] > 0, c
        assert dict(exact["abs_delta_decades"])["0"] == exact["tokens"]
    doc = document(run, load_case(case_file), summary, units)
    text, page = markdown(doc), to_html(doc)
    assert "## Replay" in text and "<svg" in page and "|Δ logprob| by decade" in text
    verdicts = [line.removeprefix("- ") for line in text.splitlines() if line.startswith("- ")]
    exact_lines = [line for line in text.splitlines() if EXACT in line]
    assert exact_lines and all(line.startswith("- native/bf16+bi@t1") for line in exact_lines)
    assert {v.partition(": ")[0] for v in verdicts if EXACT in v} == {
        "native/bf16+bi@t1 prefill", "native/bf16+bi@t1 chunked:2"}
    assert any(v.startswith("twin/bf16@t1 prefill: ") and "tokens differ" in v for v in verdicts)
    assert "kvfid replay" in text and "twin/bf16@t1" in headline(summary)
    # The trajectories carry their fp32 sampler's logprobs: on the faithful stack the re-scoring
    # gap is exactly zero and the engine gap (fp32 sampler vs bf16) is all that remains.
    engine = summary.replay_engine["native/bf16+bi@t1"]
    for c in ("prefill", "chunked:2"):
        assert engine[f"step-by-step~{c}"]["differ"] == 0
        assert engine[f"engine~{c}"]["differ"] == engine["engine~step-by-step"]["differ"] > 0
        assert engine[f"engine~{c}"]["abs_delta_decades"] == engine["engine~step-by-step"]["abs_delta_decades"]
    assert "three gaps" in text and "train_rollout_logprob_abs_diff" in text


def test_audit_reruns_replay_units_and_catches_a_tampered_logprob_sha(replay_run, tmp_path):
    db, result = replay_run
    passed = audit_run(db, result.run_id, model=tiny(), progress=False)
    assert passed.passed and passed.units == 7 and passed.fingerprints >= 21, passed.text()
    tampered = tmp_path / "t.sqlite"
    with sqlite3.connect(db) as source, sqlite3.connect(tampered) as target:
        source.backup(target)
    with sqlite3.connect(tampered) as conn:
        conn.execute("UPDATE rows SET fingerprints = json_set(fingerprints, '$.logprobs_sha', 'x')"
                     " WHERE item_index = 1 AND stack = 'sdpa/bf16@t1' AND label = 'prefill'")
    failed = audit_run(tampered, result.run_id, model=tiny(), progress=False, items=2)
    assert not failed.passed and any(d.field == "logprobs_sha" for d in failed.differences)


@pytest.mark.parametrize("edit,named", [
    (('constructions = ["prefill", "chunked:2"]', 'constructions = ["incremental"]'),
     "[replay] constructions = 'incremental'"),
    (('constructions = ["prefill", "chunked:2"]', 'constructions = ["live"]'),
     "[replay] constructions = 'live'"),
    (("[replay]", "[replay]\nwindow = 3"), "unknown key [replay] 'window'"),
    (('model = "tiny-llama"', 'model = "tiny-llama"\nB = 4'), "key 'B' does not apply"),
    (('trajectories = "{path}"', 'trajectories = "/no/such.jsonl"'),
     "[replay] trajectories = '/no/such.jsonl'"),
])
def test_bad_replay_keys_exit_2_naming_the_key(tmp_path, edit, named):
    case = tmp_path / "bad.toml"
    case.write_text(CASE.replace(*edit).format(path=tmp_path / "t.jsonl"))
    (tmp_path / "t.jsonl").write_text('{"prompt_ids": [1, 2], "tokens": [3]}\n')
    result = kvfid("run", case, "--db", tmp_path / "l.sqlite", "--quiet")
    assert result.exit_code == 2, result.output
    assert named in result.output and not (tmp_path / "l.sqlite").exists()


def test_a_bad_trajectory_line_is_refused_before_compute(tmp_path):
    case = tmp_path / "bad.toml"
    case.write_text(CASE.format(path=tmp_path / "t.jsonl"))
    (tmp_path / "t.jsonl").write_text('{"prompt_ids": [1, 2], "tokens": [99999999]}\n')
    result = kvfid("run", case, "--db", tmp_path / "l.sqlite", "--quiet")
    assert result.exit_code == 2 and "vocabulary" in result.output, result.output


def test_shipped_replay_case_counts_its_trajectories(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])   # its path is read from the root
    case = load_case("cases/replay-smollm2.toml")
    assert case.replay.constructions == ("prefill", "chunked:8") and case.items.n == 8
    assert case.design()["units"] == 2 + 4 * 8     # triton/bf16+bi on the first 2


def test_two_replay_runs_compare(replay_run, case_file):
    """`kvfid compare` on two runs of one replay case: the same units, nothing worse."""
    from kvfid.compare.runs import compare

    db, first = replay_run
    second = run_case(load_case(case_file), db, model=tiny(), progress=False)
    result = compare(db, first.run_id, second.run_id)
    stacks = result["stacks"]
    assert stacks and all(not s["items"]["not_comparable"] and s["items"]["compared"]
                          for s in stacks.values())
    verdicts = [v for s in stacks.values() for v in s["verdicts"]]
    assert verdicts and not [v for v in verdicts if v["status"] == "regression"]
