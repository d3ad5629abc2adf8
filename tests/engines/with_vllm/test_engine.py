"""vLLM as the generator: `kvfid rollouts --engine vllm` keeps the engine's sampling logprobs,
`kvfid replay` measures the three gaps against them (engine~prefill checked against a plain
transformers computation), and `kvfid engine-check` measures vLLM's own constructions bitwise."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("vllm", reason="vLLM is not installed here; `make install-vllm`, then `make test-vllm`")

from kvfid.cli import main  # noqa: E402
from kvfid.diagnoses import replay  # noqa: E402
from kvfid.stacks.stack import Stack  # noqa: E402
from kvfid.engines.check import engine_check, render  # noqa: E402
from kvfid.records.engine import EngineCheckRecord  # noqa: E402
from kvfid.records.read import from_json  # noqa: E402
from kvfid.inputs.models import load_model  # noqa: E402
from kvfid.diagnoses.replay_gaps import STEP  # noqa: E402


@pytest.fixture(scope="module")
def engine_rollouts(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-rollouts") / "r.jsonl"
    made = CliRunner().invoke(main, ["rollouts", "--engine", "vllm", "--model", f"hf:{tiny_folder}",
                                     "-n", "3", "--tokens", "12", "--temperature", "1.0",
                                     "--out", str(out)])
    assert made.exit_code == 0, made.output
    return out


def test_engine_rollouts_carry_one_logprob_per_token(engine_rollouts):
    rows = [json.loads(line) for line in engine_rollouts.read_text().splitlines()]
    assert len(rows) == 3 and all(r["stack"].startswith("vllm ") for r in rows)
    assert all(len(r["logprobs"]) == len(r["tokens"]) > 0 for r in rows)
    assert all(math.isfinite(v) and v <= 0 for r in rows for v in r["logprobs"])


def test_replay_shows_the_three_gaps_and_engine_vs_prefill_is_independently_right(
        engine_rollouts, tiny_folder):
    model, trajectories = load_model(f"hf:{tiny_folder}"), replay.load_trajectories(engine_rollouts)
    result = replay.replay(model, Stack("sdpa", "bf16"), trajectories, ("prefill",))
    engine = result["engine_aggregate"]
    assert set(engine) == {STEP, "prefill"} and engine["prefill"]["tokens"] == sum(
        len(t.tokens) for t in trajectories)
    deltas = []
    with Stack("sdpa", "bf16").activate(model) as module:
        for t in trajectories:
            logits = module(input_ids=torch.tensor([list(t.prompt_ids + t.tokens)]),
                            use_cache=False).logits[0].float()
            first = len(t.prompt_ids) - 1
            picked = torch.log_softmax(logits, -1)[first:first + len(t.tokens)]
            deltas += [abs(float(row[token]) - lp) for row, token, lp in zip(picked, t.tokens, t.logprobs)]
    assert abs(engine["prefill"]["mean_abs"] - sum(deltas) / len(deltas)) < 1e-6
    assert abs(engine["prefill"]["max_abs"] - max(deltas)) < 1e-6
    text = replay.render(result)
    assert "engine~step-by-step" in text and "engine~prefill" in text and "step-by-step~prefill" in text


def test_engine_check_measures_every_construction_and_stock_kv_differs(tiny_folder, tmp_path):
    """`kvfid engine-check --kv` in its own process (vLLM-CPU's threads as a user's run gets
    them: in the test process, one thread, stock decode and prefill agree on this tiny model,
    measured). The control for the faithful engine: stock decode-built KV is not prefill-built.
    With --db and --report, the ledger holds what was printed and the report shows it."""
    import os
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: vLLM-CPU's attention does not split, decode and prefill may agree")
    shown = subprocess.run([sys.executable, "-m", "kvfid.cli", "engine-check", "--kv", "--model",
                            f"hf:{tiny_folder}", "--dtype", "fp32", "-n", "2", "--tokens", "8",
                            "--format", "json", "--db", str(tmp_path / "ledger.sqlite"), "--report",
                            "--out", str(tmp_path / "reports")], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert shown.returncode == 0, shown.stderr[-2000:]
    result = from_json(shown.stdout)              # the record, as --format json prints it
    names = [r.construction for r in result.rows]
    assert names == ["decode vs prefill re-scoring", "decode alone vs batched",
                     "prefill alone vs batched", "chunked prefill off vs on (32)",
                     "prefix cache cold vs warm"]
    assert all(r.tokens > 0 and 0 <= r.differ <= r.tokens for r in result.rows)
    assert result.rows[-1].served_tokens >= 32   # the warm run really read the cache
    assert "prefix cache cold vs warm" in render(result) and "engine state" in render(result)
    decode = result.rows[0].kv
    assert decode.items_exact < decode.items and decode.n_diff > 0
    assert decode.first_bad_layer is not None and decode.first_position is not None
    assert decode.max_ulp > 0 and decode.d_rel > 0
    _stored_as_printed(tmp_path, result)


def _stored_as_printed(tmp_path, result):
    from dataclasses import replace

    from kvfid.ledger.engine_checks import check
    from kvfid.ledger.store import Ledger

    with Ledger(tmp_path / "ledger.sqlite", readonly=True) as ledger:
        stored = check(ledger, "latest")
    assert replace(stored.record, wall_s=result.wall_s) == result and stored.engine == result.engine
    report = (tmp_path / "reports" / stored.environment_key / stored.id / "report.md").read_text()
    decode = result.rows[0].kv
    assert f"| decode vs prefill re-scoring | {decode.items_exact}/2 | " \
           f"{decode.first_bad_layer} | {decode.first_position} | {decode.n_diff} |" in report


def test_a_preset_vllm_cannot_load_is_refused():
    shown = CliRunner().invoke(main, ["engine-check", "--model", "tiny-llama"])
    assert shown.exit_code == 2 and "model folder" in shown.output


def test_batch_invariance_is_said_plainly_where_vllm_does_not_apply_it():
    """A probe of the platform vLLM runs on: on CPU, VLLM_BATCH_INVARIANT=1 changes no kernel
    (vLLM installs its batch-invariant overrides from the GPU worker), and the table says so."""
    from vllm.platforms import current_platform

    from kvfid.engines import vllm_llm

    note = vllm_llm.batch_invariant_refusal()
    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        assert note is None
    else:
        assert "not applied" in note
        shown = render(EngineCheckRecord("m", "bf16", "vllm", 1, 1, 32, batch_invariant=True,
                                         batch_invariant_note=note))
        assert f"note: {note}" in shown and "batch-invariant switch on" in shown
