"""kvfid.diagnoses.replay: supplied trajectories, per-token logprob mismatch, sampling, and `kvfid replay`."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvfid.diagnoses import replay
from kvfid.stacks.stack import Stack
from kvfid.cli import main
from protocol_fixtures import tiny



@pytest.fixture(scope="module")
def trajectories():
    model = tiny()
    prompts = [(f"p{i}", model.codec.prompt_ids(text)) for i, text in enumerate(("What is 2+3?", "Hi"))]
    rows = replay.sample_trajectories(model, Stack("sdpa", "fp32", threads=1), prompts, 6, 1.0, 0)
    return [replay.Trajectory(r["id"], tuple(r["prompt_ids"]), tuple(r["tokens"])) for r in rows]


def test_sampling_is_seeded(trajectories):
    model = tiny()
    prompts = [(t.id, list(t.prompt_ids)) for t in trajectories]
    again = replay.sample_trajectories(model, Stack("sdpa", "fp32", threads=1), prompts, 6, 1.0, 0)
    assert [tuple(r["tokens"]) for r in again] == [t.tokens for t in trajectories]
    other = replay.sample_trajectories(model, Stack("sdpa", "fp32", threads=1), prompts, 6, 1.0, 1)
    assert [tuple(r["tokens"]) for r in other] != [t.tokens for t in trajectories]


def test_the_faithful_stack_rescores_every_token_with_the_generators_bits(trajectories):
    result = replay.replay(tiny(), Stack("native", "fp32", True, threads=1), trajectories,
                           ("prefill", "chunked:3", "batched:2"))
    for construction, agg in result["aggregate"].items():
        assert agg["tokens"] == sum(len(t.tokens) for t in trajectories)
        assert agg["differ"] == 0 and agg["max_abs"] == 0 and agg["kl_mean"] == 0, construction
    assert "exactly zero" in replay.render(result)


def test_control_the_variant_twin_is_caught(trajectories):
    """The same measurement on the deliberately shape-variant attention (with the mode): the
    trainer's re-scoring differs from generation on any CPU."""
    result = replay.replay(tiny(), Stack("twin", "fp32", True, threads=1), trajectories, ("prefill",))
    agg = result["aggregate"]["prefill"]
    assert agg["differ"] > 0 and agg["max_abs"] > 0 and agg["items_exact"] < len(trajectories)
    assert "exactly zero" not in replay.render(result)


def test_mismatch_counts_bits_and_kl():
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(5, 11, generator=gen)
    tokens = [1, 2, 3, 4, 5]
    same = replay.mismatch(reference, reference.clone(), tokens)
    assert same.differ == 0 and same.first_position is None and same.kl_mean == 0
    other = reference.clone()
    other[3, 4] += 1e-3   # moves token 3's and the other tokens' of row 3 logprobs
    m = replay.mismatch(reference, other, tokens)
    assert m.differ == 1 and m.first_position == 3 and m.max_abs > 0 and m.kl_max > 0


@pytest.mark.parametrize("line,message", [
    ("{not json", ":1: not JSON"),
    ('{"prompt_ids": [1, 2]}', "tokens must be a non-empty list"),
    ('{"prompt_ids": [], "tokens": [1]}', "prompt_ids must be a non-empty list"),
    ('{"prompt_ids": [1], "tokens": [-4]}', "integers >= 0"),
    ('[1, 2]', "expected an object"),
])
def test_bad_trajectory_files_are_refused_with_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        replay.load_trajectories(path)


def test_ids_outside_the_vocabulary_are_refused_before_compute(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2], "tokens": [10 ** 6]}) + "\n")
    result = CliRunner().invoke(main, ["replay", str(path), "--model", "tiny-llama"])
    assert result.exit_code == 2 and "vocabulary size" in result.output


def test_cli_rollouts_then_replay(tmp_path):
    out = tmp_path / "r.jsonl"
    made = CliRunner().invoke(main, ["rollouts", "--model", "tiny-llama", "-n", "2", "--tokens", "4",
                                     "--out", str(out)])
    assert made.exit_code == 0, made.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["prompt_ids"] and r["tokens"] for r in rows)
    shown = CliRunner().invoke(main, ["replay", str(out), "--model", "tiny-llama", "--backend", "twin",
                                      "--dtype", "fp32", "--batch-invariant", "--threads", "1",
                                      "--expect-exact", "--format", "json"])
    assert shown.exit_code == 1, shown.output   # the twin is not exact: the verdict fails
    assert json.loads(shown.stdout)["aggregate"]["prefill"]["differ"] > 0
