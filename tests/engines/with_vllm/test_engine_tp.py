"""vLLM-CPU at TP=2 (two worker processes, one core each): the faithful engine's logprobs and paged
K/V equal its TP=1 ones bit for bit, and its rollouts replay on kvfid's native batch-invariant
stack at TP=1 (`native/fp32+bi@tp1`: a TP stack at size 1) with three gaps of exactly 0; stock vLLM at TP=2 against TP=1 is the control. One
TP=2 engine per kind (its start is most of the time)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("vllm", reason="vLLM is not installed here; `make install-vllm`, then `make test-vllm`")

from kvfid.cli import main  # noqa: E402
from kvfid.engines import check  # noqa: E402
from kvfid.engines.seam import EngineConfig, started  # noqa: E402
from kvfid.engines.vllm_engine import ENGINE  # noqa: E402

TOKENS = 8


@pytest.fixture(scope="module")
def tp_folder(tmp_path_factory, tiny_folder):
    """The tiny folder's tokenizer with a model TP=2 can shard: 4 heads, 2 KV heads (head dim 32,
    the smallest vLLM-CPU's attention takes)."""
    import shutil

    import torch
    import transformers

    folder = tmp_path_factory.mktemp("tiny-tp")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_folder / name, folder / name)
    config = transformers.LlamaConfig(
        vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        bos_token_id=256, eos_token_id=257, tie_word_embeddings=False, initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


def _prompts(folder):
    from kvfid.inputs.trajectories import items_and_codec

    chosen, codec = items_and_codec(f"hf:{folder}", "arith", 2)
    return chosen, [codec.prompt_ids(i.prompt) for i in chosen]


def _tp_rows(folder, faithful: bool, rollouts=None):
    """TP=1 then TP=2 on the same requests (the TP=2 engine also samples `rollouts` when asked):
    the two TP rows, each with its engine-state comparison."""
    _, prompts = _prompts(folder)
    longest = max(len(p) for p in prompts) + TOKENS + 1
    config = EngineConfig(f"hf:{folder}", "fp32", longest, faithful=faithful)
    with started(ENGINE, config.with_(tp_invariant=True)) as running:
        one = check.measure_alone(running, prompts, TOKENS, kv=True)
    sequences = [p + g.ids for p, g in zip(prompts, one[0])]
    with started(ENGINE, config.with_(tp=2)) as running:
        two = check.measure_alone(running, prompts, TOKENS, kv=True, sequences=sequences)
        sampled = running.generate(prompts, TOKENS, 1.0, 0, stop_ids=[257]) if rollouts else None
    from kvfid.engines.bits import compare_rows
    from kvfid.records.plain import as_plain

    rows = {row.construction: {**as_plain(row), "kv": as_plain(compare_rows(*states))}
            for row, states in check.tp_rows(one, two, prompts, 2)}
    return rows, sampled


@pytest.fixture(scope="module")
def faithful(tp_folder):
    return _tp_rows(tp_folder, faithful=True, rollouts=True)


def test_faithful_tp2_logprobs_and_paged_kv_equal_tp1(faithful):
    rows, _ = faithful
    assert set(rows) == {"decode TP=1 vs TP=2", "prefill re-scoring TP=1 vs TP=2"}
    for name, row in rows.items():
        assert row["tokens"] > 0 and row["differ"] == 0, (name, row)
        assert row["kv"]["items_exact"] == row["kv"]["items"] == 2 and row["kv"]["n_diff"] == 0, (name, row["kv"])


def test_faithful_tp2_rollouts_replay_at_tp1_with_three_gaps_of_exactly_zero(faithful, tp_folder, tmp_path):
    from kvfid.inputs.trajectories import Trajectory, as_row

    _, sampled = faithful
    chosen, prompts = _prompts(tp_folder)
    rows = [as_row(Trajectory(i.id, tuple(p), tuple(ids), tuple(lp)), model=f"hf:{tp_folder}",
                   stack="vllm/fp32+faithful@tp2", temperature=1.0, seed=0)
            for i, p, (ids, lp) in ((i, p, (g.ids, g.logprobs)) for i, p, g in zip(chosen, prompts, sampled))
            if ids]
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shown = CliRunner().invoke(main, ["replay", str(out), "--model", f"hf:{tp_folder}", "--stack",
                                      "native/fp32+bi@tp1",
                                      "--constructions", "prefill,chunked:8", "--format", "json"])
    assert shown.exit_code == 0, shown.output
    engine = json.loads(shown.stdout)["engine_aggregate"]
    for name, gap in engine.items():                 # engine~step-by-step and engine~C
        assert gap["tokens"] > 0 and gap["differ"] == 0 and gap["max_abs"] == 0, (name, gap)


def test_stock_tp2_differs_from_tp1(tp_folder):
    """The control: stock vLLM sums the row-parallel partials with its all-reduce; its TP=2 state
    and logprobs are not its TP=1 ones."""
    rows, _ = _tp_rows(tp_folder, faithful=False)
    kv = rows["prefill re-scoring TP=1 vs TP=2"]["kv"]
    assert kv["n_diff"] > 0 and kv["first_bad_layer"] is not None, kv
    assert sum(row["differ"] for row in rows.values()) > 0, rows
