"""Replay re-scoring the engine's way: `cached:K` (a prefix-cache hit) and `spec:k` (speculative
verification) through kvfid.protocol.prefix_reuse, bit-identical to the step-by-step reference
on the faithful stacks, caught on the variant twin, refused in one line where K passes the
prompt, and run from a case file into the ledger."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.stacks.stack import Stack
from kvfid.records.replay_record import ReplayRecord
from kvfid.diagnoses import replay
from kvfid.ledger.store import Ledger
from protocol_fixtures import tiny

ENGINE = ("cached:prompt", "cached:2", "cached:0.2", "spec:3", "spec:3+none", "spec:2+rate0.5",
          "spec:3+ngram")


def kvfid(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def trajectories():
    """A sampled trajectory, and one that repeats its prompt's bigrams so the n-gram drafter
    proposes drafts and some are accepted."""
    model = tiny()
    prompt = model.codec.prompt_ids("What is 2+3?")
    sampled = replay.sample_trajectories(model, Stack("sdpa", "fp32", threads=1),
                                         [("sampled", prompt)], 8, 1.0, 3)[0]
    loop = [40, 41, 42, 43, 44]
    repeating = replay.Trajectory("repeating", tuple(prompt + loop), tuple(loop * 2 + [7, 8]))
    return [replay.Trajectory("sampled", tuple(sampled["prompt_ids"]), tuple(sampled["tokens"])),
            repeating]


@pytest.fixture(scope="module")
def rescored():
    """Each stack's replay result over every engine construction, computed once."""
    found = {}

    def run(stack, trajectories):
        if stack.label not in found:
            found[stack.label] = replay.replay(tiny(), stack, trajectories, ("prefill",) + ENGINE)
        return found[stack.label]
    return run


@pytest.mark.parametrize("backend", ["native", "eager"])
def test_engine_rescoring_is_bit_identical_to_generation_on_the_faithful_stacks(
        trajectories, rescored, backend):
    result = rescored(Stack(backend, "bf16", True, threads=1), trajectories)
    for c in ENGINE:
        agg = result["aggregate"][c]
        assert agg["tokens"] == sum(len(t.tokens) for t in trajectories), c
        assert agg["differ"] == 0 and agg["max_abs"] == 0 and agg["kl_mean"] == 0, (c, agg)


def test_the_acceptance_pattern_is_kept_and_covers_the_fed_continuation(trajectories, rescored):
    result = rescored(Stack("native", "bf16", True, threads=1), trajectories)
    for item, t in zip(result["items"], trajectories):
        for c, m in item["constructions"].items():
            if not c.startswith("spec:"):
                assert m["acceptance"] is None, c
                continue
            fed = len(t.tokens) - 1        # the last token is never fed (no logits after it)
            assert sum(m["acceptance"]) + len(m["acceptance"]) == fed, (c, m["acceptance"])
        assert item["constructions"]["spec:3+none"]["acceptance"] == [0] * (len(t.tokens) - 1)
    repeating = result["items"][1]["constructions"]
    assert repeating["spec:3"]["acceptance"][0] == 3
    assert max(repeating["spec:3+ngram"]["acceptance"]) > 0   # the drafter found the loop


def test_control_the_variant_twin_differs_under_every_engine_construction(trajectories, rescored):
    """The same re-scoring on the deliberately shape-variant attention: a verification pass of
    several tokens, or the rest of a prompt in one call, differs from one token at a time."""
    result = rescored(Stack("twin", "bf16", True, threads=1), trajectories)
    for c in ENGINE:
        assert result["aggregate"][c]["differ"] > 0, c
    assert "exactly zero" not in replay.render(result).split("\n", 1)[1]


def test_a_prefix_cache_hit_beyond_the_prompt_exits_2_in_one_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt_ids": [1, 2, 3, 4], "tokens": [5, 6, 7]}) + "\n")
    ok = kvfid("replay", path, "--model", "tiny-llama", "--constructions", "cached:3,spec:1",
               "--threads", "1", "--format", "json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["items"][0]["constructions"]["spec:1"]["acceptance"] == [1]
    for bad, k in (("cached:4", 4), ("cached:0.9", 6)):
        refused = kvfid("replay", path, "--model", "tiny-llama", "--constructions", bad)
        assert refused.exit_code == 2, refused.output
        assert len(refused.output.strip().splitlines()) == 1, refused.output
        assert f"K={k} must be at least 1 and at most 3" in refused.output
    assert kvfid("replay", path, "--model", "tiny-llama", "--constructions", "spec:0").exit_code == 2


def test_engine_rescoring_on_a_recurrent_model_is_refused_before_compute(tmp_path):
    from families import build

    folder = build("qwen3-next", tmp_path / "qwen3-next")
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2, 3, 4], "tokens": [5, 6]}) + "\n")
    result = kvfid("replay", path, "--model", f"hf:{folder}", "--backend", "eager",
                   "--constructions", "prefill,cached:prompt")
    assert result.exit_code == 3 and "recurrent state" in result.output, result.output


CASE = """
model = "tiny-llama"

[replay]
trajectories = "{path}"
constructions = ["cached:prompt", "spec:2+none", "spec:3+ngram"]

[[stacks]]
backends = ["native", "twin"]
dtypes = ["bf16"]
batch_invariant = [true]
threads = 1
"""


def test_a_replay_case_with_engine_constructions_lands_in_the_ledger(tmp_path, trajectories):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": t.id, "prompt_ids": list(t.prompt_ids),
                                        "tokens": list(t.tokens)}) + "\n" for t in trajectories))
    case = tmp_path / "serving-replay.toml"
    case.write_text(CASE.format(path=path))
    db = tmp_path / "l.sqlite"
    result = kvfid("run", case, "--db", db, "--quiet")
    assert result.exit_code == 0, result.output
    with Ledger(db) as ledger:
        run_id = ledger.db.execute("SELECT MAX(id) FROM runs").fetchone()[0]
        units = ledger.units(run_id)
        labels = {r[0] for r in ledger.db.execute(
            "SELECT label FROM rows WHERE run_id = ? AND kind = 'replay'", (run_id,))}
    assert len(units) == 4 and all(isinstance(u.record, ReplayRecord) for u in units)
    assert labels == {"cached:prompt", "spec:2+none", "spec:3+ngram"}
    for u in units:
        found = u.record.constructions
        assert found["spec:2+none"].acceptance and found["cached:prompt"].acceptance is None
        exact = all(m.differ == 0 for m in found.values())
        assert exact == u.record.stack_label.startswith("native"), u.record.stack_label
    beyond = tmp_path / "beyond.toml"
    beyond.write_text(CASE.format(path=path).replace('"cached:prompt"', '"cached:40"'))
    refused = kvfid("run", beyond, "--db", tmp_path / "b.sqlite", "--quiet")
    assert refused.exit_code == 2 and "[replay] constructions: cached:40" in refused.output
