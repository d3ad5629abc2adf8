"""`--backend module:function` and transformers-registered implementations as stacks."""

from __future__ import annotations

import importlib.util

import pytest

from harness.protocol.backends import Stack, attention_backend
from harness.protocol.models import load_model
from harness.protocol.protocol import ItemPlan, run_item
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
                                          ("harness.protocol.cache:no_such_function", "cannot load"),
                                          ("harness.protocol.cache:Selection", None),
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
