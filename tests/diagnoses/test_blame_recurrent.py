"""`blame` inside recurrent layers, on a tiny random-weight Qwen3-Next (Gated DeltaNet + attention +
MoE): without the faithful form the chunked prefill and the decode step are different computations
and blame names each Gated DeltaNet layer as such; with the mode and the faithful form every
compared op gives the position the same bits; a planted variant op inside the stepped layer is
named as the first culprit (the control: the check can fail inside a recurrent layer)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import mode_models as mm
from kvfid.diagnoses import blame as blame_lib
from kvfid.tracing import align as blame_align
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.recurrence import faithful_recurrence, step_of

PLANTED = "model.layers.1.linear_attn.in_proj_ba"


@pytest.fixture(scope="module")
def model():
    return mm.build("qwen3_next", dtype=torch.float32)


def blame_on(model, *, mode: bool, faithful: bool, plant: bool = False):
    prefix = mm.prompt(6)[0].tolist()
    with contextlib.ExitStack() as stack, torch.no_grad():
        if mode:
            stack.enter_context(set_batch_invariant_mode(impl="rowwise"))
        if faithful:
            stack.enter_context(faithful_recurrence(model))
        if plant:  # variant by construction: a scale only a prefill's steps of layer 1 get
            layer, target = model.get_submodule(PLANTED.rsplit(".", 1)[0]), model.get_submodule(PLANTED)
            forward = target.forward
            target.forward = lambda x: forward(x) * (1.0 + 2.0 ** -10 * (step_of(layer) is not None))
            stack.callback(delattr, target, "forward")
        return blame_lib.blame(model, prefix, 4, "prefill")


def test_chunked_scan_and_step_are_named_as_different_computations(model):
    result = blame_on(model, mode=False, faithful=False)
    named = {d["module"]: d for d in result.to_json()["diverging_modules"]}
    assert set(named) >= {f"model.layers.{i}.linear_attn" for i in range(3)}, sorted(named)
    assert "cumsum" in named["model.layers.0.linear_attn"]["ops_b"]  # the chunked scan runs in b only
    assert "culprit layer: model.layers.0.linear_attn" in blame_lib.render(result, "eager")


def test_mode_and_faithful_form_leave_no_culprit(model):
    result = blame_on(model, mode=True, faithful=True)
    differing = [(o.module, o.op, o.kind) for o in result.ops if o.kind in blame_align.DIFFER]
    assert differing == [] and result.culprits == [], differing[:5]
    assert result.to_json()["diverging_modules"] == []
    stepped_ops = [o for o in result.ops if o.module.startswith("model.layers.0.linear_attn")]
    assert stepped_ops and all(o.shapes_a == o.shapes_b for o in stepped_ops)  # step p against step p
    assert "no culprit: every op" in blame_lib.render(result, "mode+faithful")


def test_control_a_planted_variant_op_inside_the_stepped_layer_is_named(model):
    result = blame_on(model, mode=True, faithful=True, plant=True)
    first = result.culprits[0]
    assert (first.module, first.op) == (PLANTED, "mul"), blame_lib.render(result, "planted")
    assert first.n_diff > 0


def test_tagger_keys_the_blamed_step_and_skips_the_others(model):
    with faithful_recurrence(model):
        tagger = blame_align.Tagger(model, (0, 6), 5)
        assert tagger.key("model.layers.3.self_attn", "mm") == ("model.layers.3.self_attn", 0, "mm", 0)
        assert tagger.key("model.layers.0.linear_attn", "mm") is None  # the wrapper's own ops (no step)
        one_token = blame_align.Tagger(model, (5, 6), 5)  # a decode step: its one call is step p
        assert one_token.key("model.layers.0.linear_attn.in_proj_ba", "mm") == (
            "model.layers.0.linear_attn.in_proj_ba", "p", "mm", 0)
    assert blame_align.Tagger(model, (5, 6), 5).key("model.layers.0.linear_attn", "mm")[1] == 0  # off
