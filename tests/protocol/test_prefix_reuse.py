"""Serving-engine constructions: prefix-cache hits (`cached:K`) and speculative verification
(`spec:k`) through the protocol, with the faithful stack bit-exact and the variant twin not."""

import pytest
import torch
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.protocol import prefix_reuse
from kvfid.stacks.stack import Stack
from kvfid.protocol.protocol import (ItemPlan, ProtocolError, parse_construction,
                                       parse_transplant, run_construction, run_item)
from protocol_fixtures import PROMPT, fp32_live, small

SERVING_ARMS = ("cached:prompt", "cached:0.5", "cached:3", "spec:3", "spec:3+none",
                "spec:2+rate0.5", "spec:3+ngram")


@pytest.mark.parametrize("text", SERVING_ARMS + ("spec:1+all",))
def test_serving_arms_parse_to_their_own_label(text):
    label = parse_construction(text).label
    assert label == ("spec:1" if text == "spec:1+all" else text)
    assert parse_construction(label).label == label


@pytest.mark.parametrize("text", ["spec:0", "cached:0", "cached:1.5", "cached:1.0",
                                  "spec:3+rate1.5", "spec:3+some", "cached:", "cached:system"])
def test_bad_serving_arms_are_refused(text):
    with pytest.raises(ProtocolError):
        parse_construction(text)


def test_a_serving_arm_can_donate_to_a_transplant():
    spec = parse_transplant("live<-spec:3+ngram:keys")
    assert (spec.recipient, spec.donor, spec.selection.label) == ("live", "spec:3+ngram", "keys")
    assert parse_transplant("prefill<-cached:0.5").donor == "cached:0.5"


def test_a_prefix_cache_hit_beyond_the_prefix_is_refused_before_compute():
    ItemPlan(6, 4, arms=("live", "cached:15")).check_fits(10, 2048)   # |P| = 10 + 6 = 16
    with pytest.raises(ProtocolError, match="K=16"):
        ItemPlan(6, 4, arms=("live", "cached:16")).check_fits(10, 2048)
    with pytest.raises(ProtocolError, match="below the boundary prefix"):
        ItemPlan(6, 4, arms=("live", "cached:40")).check_fits(10, 2048)


def test_spec_k_zero_exits_2_in_one_line_before_compute():
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--prompt", "hi",
                                       "--arms", "live,spec:0"])
    assert result.exit_code == 2, result.output
    assert "spec:k takes k >= 1" in result.output


def test_prompt_lookup_drafts_what_followed_the_last_bigram():
    assert prefix_reuse._lookup([5, 6, 7, 8, 9, 5, 6], 3) == [7, 8, 9]
    assert prefix_reuse._lookup([5, 6, 7, 5, 6], 3) == [7, 5, 6]
    assert prefix_reuse._lookup([1, 2, 3, 4], 3) == []      # no earlier occurrence: no drafts


def test_serving_arms_cover_p_and_count_their_forward_calls_in_fp32():
    with fp32_live("tiny-llama", B=9, S=2) as (model, module, prompt, live, prefix, full):
        arms = {c: run_construction(module, parse_construction(c), len(prompt), prefix, 2,
                                    model.codec.eos_ids) for c in SERVING_ARMS}
    for label, arm in arms.items():
        assert arm.state.length == len(prefix), label
        # Positions, crops and masks are right iff the boundary logits equal a full forward.
        torch.testing.assert_close(arm.state.logits.float(), full, rtol=1e-5, atol=1e-5)
    suffix_calls = 1                                    # S = 2: one fed token
    assert arms["cached:prompt"].forward_calls == 2 + suffix_calls
    # 9 tokens after the prompt: two steps of 1 + 3, then the last token alone (no drafts left).
    assert arms["spec:3"].acceptance == (3, 3, 0) and arms["spec:3"].forward_calls == 1 + 3 + 1
    assert arms["spec:3+none"].acceptance == (0,) * 9
    assert arms["spec:3+none"].forward_calls == 1 + 9 + suffix_calls
    for label in ("spec:2+rate0.5", "spec:3+ngram"):
        acceptance = arms[label].acceptance
        assert sum(acceptance) + len(acceptance) == 9, (label, acceptance)


def test_a_replica_redraws_the_same_acceptance_pattern():
    with fp32_live("tiny-llama", B=12, S=2) as (model, module, prompt, live, prefix, full):
        runs = [run_construction(module, parse_construction("spec:3+rate0.5"), len(prompt),
                                 prefix, 2, model.codec.eos_ids) for _ in range(2)]
    assert runs[0].acceptance == runs[1].acceptance
    assert set(runs[0].acceptance) != {3}               # the rate pattern rejects some drafts


@pytest.mark.slow
def test_faithful_stack_is_bit_exact_for_serving_arms_and_the_twin_is_not():
    """The claim for serving constructions, with its negative control: the twin's split count
    follows the forward's row count, so a multi-token verification or a longer earlier request
    must change the bits on any CPU. Prompt lookup drafts only where the tokens repeat a bigram,
    so `spec:3+ngram` must differ exactly when it drafted (it does on this model and prompt where
    this was written). The model has 2 layers and one KV head: the kernel runs in the interpreter."""
    arms = ("live", "cached:prompt", "cached:0.5", "spec:3", "spec:3+none", "spec:3+ngram")
    plan = ItemPlan(12, 3, arms=arms, ignore_eos=True)
    model = small("tiny-mistral")
    exact = run_item(model, Stack("triton", "bf16", True, threads=1), PROMPT, plan)
    for c in exact.comparisons:
        assert c.cache.bit_exact and c.logits.equal, (c.b, c.cache.layers)
    assert exact.arms["spec:3"].acceptance == (3, 3, 3)
    twin = run_item(model, Stack("twin", "bf16", True, threads=1), PROMPT, plan)
    for arm in arms[1:-1]:
        assert not twin.against_live(arm).cache.bit_exact, arm
    assert twin.against_live("spec:3+ngram").cache.bit_exact is not lookup_drafted(twin, 3)


def lookup_drafted(record, k: int) -> bool:
    """Whether prompt lookup proposed a draft at any verification step of the record's
    `spec:k+ngram` arm (the steps replayed from its prefix and acceptance)."""
    prefix, i = list(record.prefix), record.prompt_length
    for accepted in record.arms[f"spec:{k}+ngram"].acceptance:
        if prefix_reuse._lookup(prefix[:i + 1], len(prefix[i + 1:i + 1 + k])):
            return True
        i += 1 + accepted
    return False


def test_a_serving_arm_on_a_recurrent_model_is_refused_in_one_line_before_compute(tmp_path):
    from families import build

    folder = build("qwen3-next", tmp_path / "qwen3-next")
    result = CliRunner().invoke(main, ["repro", "--model", f"hf:{folder}", "--prompt", "hi",
                                       "--backend", "eager", "--arms", "live,prefill,spec:2"])
    assert result.exit_code == 3, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "recurrent state" in errors[0], result.output


@pytest.mark.parametrize("family", ["gemma3", "mistral-sw"])
def test_serving_arms_on_window_layers_are_bit_exact_on_eager_with_the_mode(family, tmp_path):
    """A rollback on a sliding-window cache keeps what the window needs: the mode's eager stack,
    bit-exact for prefill on these layers, stays bit-exact for every serving arm (B crosses the
    window of 8)."""
    from families import build
    from kvfid.inputs.models import load_model

    model = load_model(f"hf:{build(family, tmp_path / family)}")
    plan = ItemPlan(14, 3, arms=("live", "prefill", "cached:0.5", "spec:3", "spec:3+none"),
                    ignore_eos=True)
    record = run_item(model, Stack("eager", "bf16", True, threads=1), PROMPT, plan)
    for c in record.comparisons:
        assert c.cache.bit_exact and c.logits.equal, (family, c.b)
