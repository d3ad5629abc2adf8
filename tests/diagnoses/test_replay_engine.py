"""The engine's logprobs as a reference: the file's `logprobs` checked line by line, the three gaps
(engine vs step-by-step, step-by-step vs re-scoring, engine vs re-scoring) with K3 and importance
ratios, `kvfid rollouts` writing logprobs, and records without the new fields still readable."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.records import record, read as record_read
from kvfid.diagnoses import replay
from kvfid.stacks.stack import Stack
from kvfid.diagnoses.replay_gaps import STEP, gap
from kvfid.records.replay_record import ReplayRecord
from protocol_fixtures import tiny


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """Two rollouts of tiny-llama sampled on sdpa/fp32 with one thread, logprobs included."""
    out = tmp_path_factory.mktemp("rollouts") / "r.jsonl"
    made = CliRunner().invoke(main, ["rollouts", "--model", "tiny-llama", "-n", "2", "--tokens",
                                     "5", "--temperature", "1.5", "--out", str(out)])
    assert made.exit_code == 0, made.output
    return out


def test_rollouts_write_one_finite_logprob_per_token(rollouts):
    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    assert rows and all(len(r["logprobs"]) == len(r["tokens"]) for r in rows)
    assert all(math.isfinite(v) and v <= 0 for r in rows for v in r["logprobs"])
    loaded = replay.load_trajectories(rollouts)
    assert loaded[0].logprobs == tuple(rows[0]["logprobs"])


def test_on_the_sampling_stack_the_engine_gap_is_exactly_zero(rollouts):
    """The sampler is the step-by-step generator on sdpa/fp32@t1: its logprobs are the
    reference's bits, so engine~step-by-step is zero and engine~C is step-by-step~C."""
    result = replay.replay(tiny(), Stack("sdpa", "fp32", threads=1),
                           replay.load_trajectories(rollouts), ("prefill",))
    engine = result["engine_aggregate"]
    assert engine[STEP]["differ"] == 0 and engine[STEP]["max_abs"] == 0
    assert engine[STEP]["ratio_min"] == engine[STEP]["ratio_max"] == 1.0
    assert engine["prefill"]["differ"] == result["aggregate"]["prefill"]["differ"]
    assert engine["prefill"]["abs_delta_decades"] == result["aggregate"]["prefill"]["abs_delta_decades"]
    text = replay.render(result)
    assert "engine~step-by-step" in text and "train_rollout_logprob_abs_diff" in text


def test_engine_vs_prefill_matches_an_independent_computation(rollouts):
    """On bf16 the engine (fp32 sampler) gap is not zero; kvfid's engine~prefill mean |delta|
    equals one computed here from a plain forward and log_softmax, within 1e-9."""
    model, trajectories = tiny(), replay.load_trajectories(rollouts)
    result = replay.replay(model, Stack("sdpa", "bf16", threads=1), trajectories, ("prefill",))
    engine = result["engine_aggregate"]
    assert engine[STEP]["differ"] > 0 and engine["prefill"]["max_abs"] > 0
    deltas, ratios = [], []
    with Stack("sdpa", "bf16", threads=1).activate(model) as module:
        for t in trajectories:
            ids = torch.tensor([list(t.prompt_ids + t.tokens)])
            logits = module(input_ids=ids, use_cache=False).logits[0].float()
            start = len(t.prompt_ids) - 1
            picked = torch.log_softmax(logits, -1)[start:start + len(t.tokens)]
            for row, token, sampled in zip(picked, t.tokens, t.logprobs):
                deltas.append(float(row[token]) - sampled)
                ratios.append(math.exp(deltas[-1]))
    mean_abs = sum(abs(d) for d in deltas) / len(deltas)
    assert abs(engine["prefill"]["mean_abs"] - mean_abs) < 1e-9
    assert abs(engine["prefill"]["ratio_max"] - max(ratios)) < 1e-9
    k3 = sum(r - 1 - math.log(r) for r in ratios) / len(ratios)
    assert abs(engine["prefill"]["k3_mean"] - k3) < 1e-9


def test_gap_k3_and_ratios_by_hand():
    sampler = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    trainer = torch.tensor([-1.0, -1.5, -0.75])
    g = gap(sampler, trainer)
    assert g.differ == 2 and g.first_position == 1 and g.max_abs == 0.5
    assert g.mean_abs == pytest.approx(0.25, abs=1e-12)
    assert g.ratio_max == pytest.approx(math.exp(0.5)) and g.ratio_min == pytest.approx(math.exp(-0.25))
    k3 = (math.exp(0.5) - 1 - 0.5 + math.exp(-0.25) - 1 + 0.25) / 3
    assert g.k3_mean == pytest.approx(k3, rel=1e-12)


@pytest.mark.parametrize("logprobs,message", [
    ([-0.5], ":2: 1 logprobs for 2 tokens"),
    ([-0.5, float("nan")], r":2: logprobs\[1\] = nan is not a finite number"),
    ([-0.5, "x"], r":2: logprobs\[1\] = 'x' is not a finite number"),
    ("-0.5", ":2: logprobs must be a list"),
])
def test_bad_logprobs_are_refused_with_the_line(tmp_path, logprobs, message):
    path = tmp_path / "t.jsonl"
    good = {"prompt_ids": [1, 2], "tokens": [3, 4], "logprobs": [-1.0, -2.0]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "logprobs": logprobs}) + "\n")
    with pytest.raises(ValueError, match=message):
        replay.load_trajectories(path)
    shown = CliRunner().invoke(main, ["replay", str(path), "--model", "tiny-llama"])
    assert shown.exit_code == 2 and "t.jsonl:2" in shown.output


def test_logprobs_on_some_lines_only_are_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1], "tokens": [3], "logprobs": [-1.0]}) + "\n"
                    + json.dumps({"prompt_ids": [1], "tokens": [3]}) + "\n")
    with pytest.raises(ValueError, match=":2: logprobs on some lines and not on others"):
        replay.load_trajectories(path)


def test_a_replay_record_without_the_engine_fields_reads_back(rollouts):
    trajectory = replay.load_trajectories(rollouts)[0]
    unit = replay.replay_unit(tiny(), Stack("sdpa", "fp32", threads=1), trajectory, ("prefill",))
    assert unit.engine is not None and unit.engine.exact and "prefill" in unit.engine_constructions
    data = json.loads(unit.to_json())
    data.pop("engine"), data.pop("engine_constructions")
    for m in data["constructions"].values():      # a record written before K3 and ratios
        for key in ("k3_mean", "ratio_min", "ratio_mean", "ratio_max"):
            m.pop(key)
    old = record_read.from_json(json.dumps(data))
    assert isinstance(old, ReplayRecord) and old.engine is None and old.engine_constructions == {}
    assert old.constructions["prefill"].k3_mean is None
    assert replay.aggregate([data["constructions"]["prefill"]])["tokens"] == unit.tokens
