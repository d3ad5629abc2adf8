"""Issue 45: the live arm is what `generate` does. Bamba (a Mamba-2 hybrid, tiny: layer 0
Mamba-2, layer 1 attention) numbers a call's own tokens from 0 when given no `position_ids`, so
a decode step called without them runs at position 0. kvfid passes positions as `generate` does
(kvfid.protocol.decode.Runner): live ~ prefill is bit-exact on the faithful stack, and the live
arm is `generate`'s, bit for bit. The controls: the same step without positions differs from the
prefill far above fp32 rounding, in transformers alone and in kvfid's verdict (functional)."""

from __future__ import annotations

import pytest
import torch

from kvfid.protocol import decode
from kvfid.states import scale
from families import build, model
from generate_check import live_against_generate

B, S = 12, 4


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return build("bamba", tmp_path_factory.mktemp("positions") / "bamba")


def _repro(folder, stack: str):
    from kvfid.diagnoses import repro
    from kvfid.protocol.constructions import parse_constructions
    from kvfid.stacks.stack import parse_stack

    parsed = parse_stack(stack)
    prepared = repro.prepare(f"hf:{folder}", parsed, "Hi there", None, None, B, S,
                             parse_constructions("live,prefill"), ignore_eos=True)
    return repro.measure(prepared)


def test_live_is_prefill_bit_exact_on_the_faithful_stack(bamba):
    comparison = _repro(bamba, "native/bf16+bi").against_live("prefill")
    assert comparison.bit_exact and comparison.logits.equal and comparison.suffix.identical
    assert comparison.difference is None


def test_the_live_arm_is_generate_bit_for_bit(bamba):
    from kvfid.inputs.models import load_model

    loaded = load_model(f"hf:{bamba}")
    for stack in ("native/bf16+bi", "sdpa/fp32"):
        assert live_against_generate(loaded, stack, B, S) == "bit-exact", stack


def _last_logits(module, ids, **step) -> tuple[torch.Tensor, torch.Tensor]:
    """(a prefill over `ids`, a prefill over ids[:-1] then one step with `step`'s keywords)."""
    with torch.no_grad():
        whole = module(input_ids=ids).logits[0, -1]
        cache = decode.new_cache(module).cache
        module(input_ids=ids[:, :-1], use_cache=True, **{decode.cache_keyword(module): cache})
        stepped = module(input_ids=ids[:, -1:], use_cache=True,
                         **{decode.cache_keyword(module): cache}, **step).logits[0, -1]
    return whole.double(), stepped.double()


def test_control_without_positions_the_step_differs_functionally_in_transformers():
    module = model("bamba")   # fp32, sdpa: transformers alone
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    whole, bare = _last_logits(module, ids)
    _, placed = _last_logits(module, ids, position_ids=torch.tensor([[39]]))
    drift = lambda a, b: float((a - b).norm() / a.norm())
    assert scale.kind_of(drift(whole, bare), torch.float32) == scale.FUNCTIONAL, drift(whole, bare)
    placed_drift = drift(whole, placed)
    assert placed_drift == 0 or scale.kind_of(placed_drift, torch.float32) == scale.ROUNDING


def test_control_kvfid_without_positions_reports_a_functional_difference(bamba, monkeypatch):
    """The Runner of before this issue (positions only for a padded batch): the verdict names a
    functional difference, in fp32, on the faithful stack, and never as numerics."""
    inputs = decode.Runner._inputs

    def without_positions(self, ids, cache, attention_mask, position_ids, keep):
        kwargs, after = inputs(self, ids, cache, attention_mask, position_ids, keep)
        if position_ids is None:
            kwargs.pop("position_ids", None)
        return kwargs, after

    monkeypatch.setattr(decode.Runner, "_inputs", without_positions)
    comparison = _repro(bamba, "native/fp32+bi").against_live("prefill")
    assert not comparison.bit_exact
    assert comparison.difference.kind == scale.FUNCTIONAL, comparison.difference
    assert comparison.difference.d_rel > scale.ROUNDING_EPSILONS * scale.epsilon(torch.float32)
