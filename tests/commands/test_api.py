"""The Python API (kvfid.api, reached as `kvfid.NAME`): docs/api.md runs as written, every public
name stays (or is re-exported) and is documented, and the API gives the CLI's verdicts and
fingerprints for the same model, item and stack."""

from __future__ import annotations

import doctest
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import kvfid
from kvfid.cli import main
from kvfid.errors import BadInput

ROOT = Path(__file__).resolve().parents[2]
API_PAGE = ROOT / "docs" / "api.md"

# Every name that has been public. Removing one from kvfid.__all__ fails here: keep it, or
# re-export it where the house moved it.
PUBLIC_SINCE_0_1 = {"Stack", "Model", "load_model", "repro", "ReproOutcome", "read_state",
                    "compare_states", "CacheDiff", "BoundaryState", "replay", "ReplayResult",
                    "batch_invariant_mode", "set_batch_invariant_mode", "faithful_recurrence",
                    "cache_keyword", "__version__"}


def test_the_api_page_runs_as_written():
    result = doctest.testfile(str(API_PAGE), module_relative=False,
                              optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 25 and result.failed == 0, result


def test_every_public_name_is_kept_resolved_and_documented():
    assert PUBLIC_SINCE_0_1 <= set(kvfid.__all__), PUBLIC_SINCE_0_1 - set(kvfid.__all__)
    documented = set(re.findall(r"^\| `([A-Za-z_]+)` \|", API_PAGE.read_text(), flags=re.M))
    assert set(kvfid.__all__) == documented, set(kvfid.__all__) ^ documented
    for name in kvfid.__all__:
        assert getattr(kvfid, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        kvfid.no_such_name    # noqa: B018  (the control: an unknown name is not invented)


def test_the_mode_under_both_names_and_its_default_per_device():
    from kvfid.kernels import mode as moved
    from kvfid.kernels.invariant.mode import set_batch_invariant_mode

    assert kvfid.set_batch_invariant_mode is set_batch_invariant_mode
    assert moved.set_batch_invariant_mode is set_batch_invariant_mode   # its name before the rooms
    mode = kvfid.batch_invariant_mode()
    assert isinstance(mode, set_batch_invariant_mode)
    assert mode.impl == ("triton" if torch.cuda.is_available() else "tiled")
    assert kvfid.batch_invariant_mode(impl="rowwise").impl == "rowwise"
    assert kvfid.batch_invariant_mode(False).impl is None


def _cli_json(*args: str) -> dict:
    result = CliRunner().invoke(main, [*args, "--format", "json"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


def test_repro_gives_the_cli_verdict_and_fingerprints():
    options = dict(boundary=6, suffix=4, ignore_eos=True)
    outcome = kvfid.repro("tiny-qwen2", "What is 3+4?", stack="sdpa/bf16@t1",
                          constructions=["live", "prefill", "chunked:3"], **options)
    shown = _cli_json("repro", "--model", "tiny-qwen2", "--prompt", "What is 3+4?", "--backend",
                      "sdpa", "--dtype", "bf16", "--threads", "1", "-B", "6", "-S", "4",
                      "--ignore-eos", "--constructions", "live,prefill,chunked:3")
    assert outcome.verdict == shown["verdict"]
    api = {label: (a.cache_sha, a.suffix_sha) for label, a in outcome.record.arms.items()}
    cli = {label: (a["cache_sha"], a["suffix_sha"]) for label, a in shown["arms"].items()}
    assert api == cli and len(api) == 3 and all(cache for cache, _ in api.values())


def test_replay_gives_the_cli_figures(tmp_path):
    model = kvfid.load_model("tiny-llama")
    rows = [{"id": f"t{i}", "prompt_ids": model.codec.prompt_ids(f"{i}+{i}?"),
             "tokens": [50 + i, 32, 61, 40 + i], "logprobs": [-1.0, -0.5, -2.0, -0.25]}
            for i in range(2)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = kvfid.replay(path, model, stack="sdpa/bf16@t1", constructions=["prefill", "chunked:2"])
    shown = _cli_json("replay", str(path), "--model", "tiny-llama", "--backend", "sdpa",
                      "--dtype", "bf16", "--threads", "1", "--constructions", "prefill,chunked:2")
    for c in ("prefill", "chunked:2"):
        api = [(m.differ, m.logprobs_sha) for m in result.mismatch(c)]
        cli = [(i["constructions"][c]["differ"], i["constructions"][c]["logprobs_sha"])
               for i in shown["items"]]
        assert api == cli
        metrics = result.metrics(c)
        assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(
            shown["engine_aggregate"][c]["max_abs"], abs=0)
    # rows in memory give what the file gives
    again = kvfid.replay(rows, model, stack="sdpa/bf16@t1", constructions=["prefill"])
    assert [m.logprobs_sha for m in again.mismatch("prefill")] == \
        [m.logprobs_sha for m in result.mismatch("prefill")]


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(BadInput, match="unknown model 'no-such-model'"):
        kvfid.repro("no-such-model", "hi")
    with pytest.raises(ValueError, match="expected BACKEND/DTYPE"):
        kvfid.Stack.parse("sdpa")
    with pytest.raises(ValueError, match="not a transformers causal LM"):
        kvfid.load_model(torch.nn.Linear(2, 2))
    with pytest.raises(BadInput, match="row 0"):
        kvfid.replay([{"prompt_ids": []}], "tiny-llama")


def test_a_bf16_model_in_memory_keeps_its_weights_bit_for_bit():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    mine = LlamaForCausalLM(config).to(torch.bfloat16)
    copy = kvfid.load_model(mine).cast(torch.bfloat16)
    for (name, a), b in zip(mine.state_dict().items(), copy.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_state_read_inside_a_stack_context_can_be_changed():
    # A stack's context runs under inference mode; read_state's clones are ordinary tensors all
    # the same (the wheel's script changes one element as its control). The control: the cache's
    # own tensors, made inside, refuse the change.
    from transformers import DynamicCache

    model = kvfid.load_model("tiny-llama")
    ids = torch.tensor([model.codec.prompt_ids("Hello")])
    with kvfid.Stack.parse("native/fp32+bi@t1").activate(model) as module:
        cache = DynamicCache(config=module.config)
        module(input_ids=ids, **{kvfid.cache_keyword(module): cache})
        state = kvfid.read_state(cache, module.config)
    state.layers[1].parts["v"][0, 0, 0, 0] += 1.0
    assert not kvfid.compare_states(cache, state, config=module.config).bit_exact
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        cache.layers[1].values[0, 0, 0, 0] += 1.0


def test_repro_takes_constructions_or_its_earlier_name_arms_not_both():
    """`arms=` still works (the command line's `--arms` likewise); both at once is refused before
    any model loads."""
    with pytest.raises(TypeError, match="not both"):
        kvfid.repro("tiny-llama", "hi", constructions=("live", "prefill"), arms=("live",))
