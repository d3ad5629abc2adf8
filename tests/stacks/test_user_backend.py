"""`--backend module:function` and transformers-registered implementations as stacks."""

from __future__ import annotations

import importlib.util

import pytest

from kvfid.stacks.backends import attention_backend
from kvfid.stacks.stack import Stack
from kvfid.inputs.models import load_model
from kvfid.protocol.protocol import ItemPlan, run_item
from protocol_fixtures import PROMPT

USER_MODULE = '''
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CALLS = []

def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    CALLS.append(tuple(query.shape))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)
'''


def test_a_user_attention_function_runs_through_the_protocol(tmp_path, monkeypatch):
    (tmp_path / "kvfid_user_attention.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = ItemPlan(4, 4, arms=("live", "prefill"))
    model = load_model("tiny-llama")
    user = run_item(model, Stack("kvfid_user_attention:attention", "fp32", threads=1), PROMPT, plan)
    calls = __import__("kvfid_user_attention").CALLS
    assert calls and calls[0][2] > 1 and any(shape[2] == 1 for shape in calls)   # prefill and steps
    stock = run_item(model, Stack("sdpa", "fp32", threads=1), PROMPT, plan)
    # It delegates to SDPA, so every fingerprint is SDPA's.
    for a, b in zip(user.arms.values(), stock.arms.values()):
        assert (a.cache_sha, a.suffix_sha) == (b.cache_sha, b.suffix_sha)
    assert user.stack_label == "kvfid_user_attention:attention/fp32@t1"


@pytest.mark.parametrize("name,message", [("no_such_module_xyz:attention", "cannot load"),
                                          ("kvfid.states.cache:no_such_function", "cannot load"),
                                          ("kvfid.states.surgery:Selection", None),
                                          ("flash", "unknown backend 'flash'; valid: sdpa")])
def test_bad_backend_names_are_refused_before_compute(name, message):
    if message is None:   # a class is callable: accepted here, judged by transformers when it runs
        assert attention_backend(name).name == name
        return
    with pytest.raises(ValueError, match=message):
        Stack(name, "fp32")


def test_a_transformers_implementation_that_is_not_installed_is_an_environment_error():
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here; the refusal needs a machine without it")
    stack = Stack("flash_attention_2", "fp32")   # registered by transformers: a valid name
    with pytest.raises(EnvironmentError, match="not available here"):
        with stack.activate(load_model("tiny-llama")):
            pass


def gemma2_config(**overrides):
    """A tiny Gemma2 config built in code (no hub): attention-logit softcapping, sliding layers."""
    from transformers import Gemma2Config

    return Gemma2Config(**{**dict(vocab_size=300, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, sliding_window=64,
                                  max_position_embeddings=256), **overrides})


@pytest.mark.parametrize("backend", ["sdpa", "twin"])
def test_softcapping_is_refused_before_compute_where_the_backend_cannot_apply_it(backend):
    from kvfid.stacks.stack import StackUnavailable, check_supports

    config = gemma2_config(attn_logit_softcapping=50.0)
    with pytest.raises(StackUnavailable, match="softcapping"):
        check_supports(Stack(backend, "fp32"), config, length=32)
    check_supports(Stack("eager", "fp32"), config, length=32)     # eager applies it
    check_supports(Stack("triton", "fp32"), config, length=32)    # so do our kernels
    check_supports(Stack("native", "fp32"), config, length=32)


def test_a_window_shorter_than_the_run_is_refused_where_a_kernel_does_not_serve_windows(monkeypatch):
    """The triton kernel serves windows (kvfid.kernels.hf.SERVES); without `sliding_window` in that set a
    window shorter than the run is refused, and one covering every key needs no window support."""
    from kvfid import kernels
    import kvfid.kernels.hf
    from kvfid.stacks.stack import StackUnavailable, check_supports

    check_supports(Stack("triton", "fp32"), gemma2_config(attn_logit_softcapping=None), length=200)
    monkeypatch.setattr(kvfid.kernels.hf, "SERVES", kvfid.kernels.hf.SERVES - {"sliding_window"})
    config = gemma2_config(attn_logit_softcapping=None)
    check_supports(Stack("triton", "fp32"), config, length=64)    # the window covers every key
    with pytest.raises(StackUnavailable, match="sliding-window attention"):
        check_supports(Stack("triton", "fp32"), config, length=65)
    with pytest.raises(StackUnavailable, match="window 64 < 256"):
        check_supports(Stack("triton", "fp32"), config)           # default: the whole context
    from transformers import MistralConfig   # Gemma2's class refuses sdpa in transformers

    mistral = MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            sliding_window=64, max_position_embeddings=256)
    check_supports(Stack("sdpa", "fp32"), mistral, length=200)    # sdpa masks the window
    with pytest.raises(StackUnavailable, match="window 64 < 200"):
        check_supports(Stack("triton", "fp32"), mistral, length=200)
    check_supports(Stack("triton", "fp32"), load_model("tiny-mistral"))  # no window: served


@pytest.mark.parametrize("command", [
    ["repro", "--prompt", "hi", "-B", "2", "-S", "2"],
    ["blame", "--prompt", "hi", "-B", "2"],
    ["replay", "TRAJECTORIES"],
])
def test_a_softcapped_model_on_the_twin_exits_3_in_one_line(tmp_path, command):
    import transformers
    from click.testing import CliRunner

    from kvfid.cli import main

    folder = tmp_path / "gemma2"
    transformers.Gemma2ForCausalLM(gemma2_config(attn_logit_softcapping=50.0)).save_pretrained(folder)
    trajectories = tmp_path / "t.jsonl"
    trajectories.write_text('{"prompt_ids": [1, 2], "tokens": [3, 4]}\n')
    command = [str(trajectories) if arg == "TRAJECTORIES" else arg for arg in command]
    result = CliRunner().invoke(main, command + ["--model", f"hf:{folder}", "--backend", "twin"])
    assert result.exit_code == 3, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "softcapping (50.0)" in errors[0]    # transformers' bar aside
    assert "Traceback" not in result.output


def test_a_case_with_a_stack_the_model_cannot_serve_is_refused_before_compute(tmp_path):
    import transformers
    from click.testing import CliRunner

    from kvfid.cli import main

    folder = tmp_path / "gemma2"
    transformers.Gemma2ForCausalLM(gemma2_config(attn_logit_softcapping=50.0)).save_pretrained(folder)
    case = tmp_path / "case.toml"
    case.write_text(f'name = "gemma2"\nmodel = "hf:{folder}"\nB = 2\nS = 2\n'
                    'constructions = ["live", "prefill"]\n[items]\nset = "arith"\nn = 1\n'
                    '[stacks]\nbackends = ["eager", "twin"]\ndtypes = ["fp32"]\n'
                    'device = "cpu"\nthreads = 1\n')
    db = tmp_path / "l.sqlite"
    result = CliRunner().invoke(main, ["run", str(case), "--db", str(db), "--quiet"])
    assert result.exit_code == 3, result.output
    assert "softcapping (50.0)" in result.output and "twin" in result.output
    assert not db.exists()          # refused before the ledger file is created


def test_a_backend_says_what_it_refuses_and_the_checks_ask_it_not_its_name(monkeypatch):
    """A registered backend's own refusals (a mechanism, a model class, +compile) are what
    check_supports and the serving table apply; no check looks at the backend's name."""
    from kvfid.stacks import backends, serving
    from kvfid.stacks.backends import AttentionBackend
    from kvfid.stacks.stack import StackUnavailable, check_supports

    probe = AttentionBackend("probe", "eager that says it applies no softcap", lambda: "eager",
                             unserved=lambda: {"softcap": "the probe applies no softcapping",
                                               "sliding_window": "no window {window} < {length}"},
                             model_refusal=lambda cls: f"the probe refuses {cls.__name__}",
                             compile_refusal=lambda: "the probe cannot be compiled")
    monkeypatch.setitem(backends._BACKENDS, "probe", probe)
    with pytest.raises(StackUnavailable, match=r"softcap: the probe applies no softcapping \(50.0\)"):
        check_supports(Stack("probe", "fp32"), gemma2_config(attn_logit_softcapping=50.0), length=32)
    config = gemma2_config(attn_logit_softcapping=None)
    with pytest.raises(StackUnavailable, match="no window 64 < 65"):
        check_supports(Stack("probe", "fp32"), config, length=65)
    with pytest.raises(StackUnavailable, match="the probe refuses Gemma2ForCausalLM"):
        check_supports(Stack("probe", "fp32"), config, length=64)   # the window covers every key
    with pytest.raises(StackUnavailable, match="the probe cannot be compiled"):
        check_supports(Stack("probe", "fp32", compiled=True), config, length=64)
    assert serving.model_reason(backends.attention_backend("eager"), type(None)) is None
