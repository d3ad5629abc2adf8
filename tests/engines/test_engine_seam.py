"""The engine seam without a real engine: a stand-in engine (pure Python, a few lines of arithmetic
over token ids) registered in kvfid.engines.registry and run by `kvfid engine-check` like any
other; its one deliberate batch effect is found and nothing else is. Bad input through the seam
(an engine that is not there, an option the engine cannot serve, a door it does not offer) is
one line and exit 2, nothing stored; the environment's switch restores what it found."""

from __future__ import annotations

import contextlib
import os

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.engines import check as engine_check
from kvfid.engines.registry import engine_for, register_engine, unregister_engine
from kvfid.engines.seam import KV, PREFIX_CACHE, Engine, Generation, Rescored, variables
from kvfid.records.engine import EngineCheckRecord
from kvfid.records.read import from_json

NUDGE = 2.0 ** -20      # what a batch of more than one request adds to each logprob


def _next(seq) -> int:
    return (sum(seq) * 31 + 7) % 200


def _logprob(seq) -> float:
    """The stand-in's logprob of the token after `seq`: an exact binary fraction."""
    return -((len(seq) % 7) + 1) / 8


class StandInRunning:
    """A running stand-in engine: greedy by `_next`, logprobs by `_logprob`, one K/V layer of the
    token ids themselves; a batch of several requests nudges every logprob (a batch effect)."""

    block_size = 4

    def __init__(self, prefix_caching: bool):
        self.prefix_caching, self.held, self.count = prefix_caching, {}, 0

    def _request(self, seq) -> str:
        self.count += 1
        self.held[f"r{self.count}"] = list(seq)
        return f"r{self.count}"

    def generate(self, prompts, tokens, temperature=0.0, seed=None, stop_ids=(), ignore_eos=False):
        nudge = NUDGE if len(prompts) > 1 else 0.0
        made = []
        for prompt in prompts:
            seq, ids, lps = list(prompt), [], []
            for _ in range(tokens):
                ids.append(_next(seq))
                lps.append(_logprob(seq) + nudge)
                seq.append(ids[-1])
            made.append(Generation(ids, lps, self._request(seq[:-1])))
        return made

    def rescore(self, sequences, starts, read_cache=False):
        made = []
        for seq, start in zip(sequences, starts):
            served = start + 1 if read_cache and self.prefix_caching else 0   # the cache's logits: none
            made.append(Rescored([None if i - 1 < served else _logprob(seq[:i])
                                  for i in range(start, len(seq))], served, self._request(seq)))
        return made

    def read_states(self, requests, sequences):
        import torch

        from kvfid.states.cache import BoundaryState

        states = []
        for request, seq in zip(requests, sequences):
            kv = torch.tensor(self.held[request][:len(seq)], dtype=torch.float32).view(1, 1, -1, 1)
            states.append(BoundaryState(seq, keys=[kv], values=[-kv]))
        return states


@contextlib.contextmanager
def _start(config):
    yield StandInRunning(config.prefix_caching)


def _refusal(config):
    return f"--attention {config.attention}: the stand-in has one attention" if config.attention else None


STAND_IN = Engine(name="stand-in", description="a test's engine: arithmetic on token ids",
                  require=lambda: None, version=lambda: "stand-in 1", start=_start,
                  refusal=_refusal, offers=frozenset({PREFIX_CACHE, KV}),
                  constructions={PREFIX_CACHE: "block reuse"})


@pytest.fixture
def stand_in():
    register_engine(STAND_IN)
    yield STAND_IN
    unregister_engine(STAND_IN.name)


def test_engine_check_runs_a_registered_stand_in_through_the_registry(stand_in, tmp_path):
    db = tmp_path / "ledger.sqlite"
    shown = CliRunner().invoke(main, ["engine-check", "--engine", "stand-in", "--model", "tiny-llama",
                                      "-n", "2", "--tokens", "5", "--kv", "--format", "json",
                                      "--db", str(db)])
    assert shown.exit_code == 0, shown.output
    record = from_json(shown.stdout)
    assert isinstance(record, EngineCheckRecord) and record.engine == "stand-in 1"
    rows = {r.construction: r for r in record.rows}
    assert list(rows) == ["decode vs prefill re-scoring", "decode alone vs batched",
                          "prefill alone vs batched", "block reuse cold vs warm"]
    assert rows["decode vs prefill re-scoring"].exact and rows["decode vs prefill re-scoring"].tokens == 10
    batched = rows["decode alone vs batched"]            # the stand-in's one batch effect, found
    assert batched.differ == batched.tokens == 10 and batched.max_abs == NUDGE and batched.kv.exact
    warm = rows["block reuse cold vs warm"]
    assert warm.served_tokens > 0 and warm.differ == 0 and warm.tokens == 6   # 2 of 5 served
    assert all(r.kv.items == 2 and r.kv.exact for r in record.rows)
    assert not record.exact and db.is_file()
    with pytest.raises(Exception):      # the record is frozen
        record.model = "other"


def test_the_check_finds_a_kv_difference_the_stand_in_makes(stand_in, monkeypatch):
    """The negative control of the KV rows: a warm read that changes one position's key."""
    real = StandInRunning.read_states

    def changed(self, requests, sequences):
        states = real(self, requests, sequences)
        if self.prefix_caching and self.count > 2:     # the warm re-scorings
            states[0].keys[0][0, 0, 1, 0] += 1
        return states
    monkeypatch.setattr(StandInRunning, "read_states", changed)
    record = engine_check.engine_check("tiny-llama", "bf16", 2, 3, 32, kv=True, engine="stand-in")
    warm = record.rows[-1]
    assert warm.kv.n_diff == 2 and warm.kv.first_position == 1 and not warm.exact
    assert "block reuse cold vs warm" in engine_check.render(record)


@pytest.mark.parametrize("args, said", [
    (["--engine", "nope"], "--engine 'nope': one of vllm"),
    (["--engine", "stand-in", "--tp", "2"], "--engine stand-in: --tp is not offered by this engine"),
    (["--engine", "stand-in", "--attention", "paged|flex"], "the stand-in has one attention"),
    (["--engine", "stand-in", "--dtype", "fp8"], "--dtype 'fp8': one of bf16")])
def test_what_an_engine_cannot_serve_is_one_line_and_exit_2(stand_in, args, said, tmp_path):
    db = tmp_path / "never.sqlite"
    shown = CliRunner().invoke(main, ["engine-check", "--model", "tiny-llama", "-n", "1",
                                      "--tokens", "2", "--db", str(db), *args])
    assert shown.exit_code == 2 and said in shown.output, shown.output
    assert len(shown.output.strip().splitlines()) == 1 and not db.exists()


def test_a_door_the_engine_does_not_offer_is_refused(stand_in, tmp_path):
    db = tmp_path / "never.sqlite"
    load = CliRunner().invoke(main, ["engine-load", "--engine", "stand-in", "--db", str(db)])
    assert load.exit_code == 2 and "engine-load is not offered" in load.output, load.output
    bench = CliRunner().invoke(main, ["engine-bench", "--engine", "stand-in"])
    assert bench.exit_code == 2 and "engine-bench is not offered" in bench.output, bench.output
    assert not db.exists()


def test_rollouts_sample_through_the_registry(stand_in, tmp_path):
    out = tmp_path / "r.jsonl"
    shown = CliRunner().invoke(main, ["rollouts", "--engine", "stand-in", "--model", "tiny-llama",
                                      "-n", "2", "--tokens", "3", "--out", str(out)])
    assert shown.exit_code == 0, shown.output
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["stack"] for r in rows] == ["stand-in 1/bf16"] * 2
    assert all(len(r["tokens"]) == len(r["logprobs"]) == 3 for r in rows)


def test_the_registry_names_each_engine_once_and_refuses_the_rest():
    assert engine_for("vllm").name == "vllm"          # its module imported, vLLM itself not
    with pytest.raises(Exception, match="one of vllm"):
        engine_for("sglang")


def test_variables_restore_what_they_found(monkeypatch):
    monkeypatch.setenv("KVFID_SEAM_A", "before")
    monkeypatch.delenv("KVFID_SEAM_B", raising=False)
    with variables(KVFID_SEAM_A="inside", KVFID_SEAM_B="set"):
        assert os.environ["KVFID_SEAM_A"] == "inside" and os.environ["KVFID_SEAM_B"] == "set"
    assert os.environ["KVFID_SEAM_A"] == "before" and "KVFID_SEAM_B" not in os.environ
    with pytest.raises(RuntimeError), variables(KVFID_SEAM_A=None):
        assert "KVFID_SEAM_A" not in os.environ
        raise RuntimeError("an engine that fails to start")
    assert os.environ["KVFID_SEAM_A"] == "before"
