"""kvfid.diagnoses.blame: the op that first gives the boundary position other bits, and its controls.

On tiny-llama at 2 layers and one KV head (`protocol_fixtures.small`, built once): the Triton
stack's kernel runs in the interpreter, and every op of the model is recorded and compared."""

from __future__ import annotations

import pytest
import torch

from kvfid import kernels
from kvfid.diagnoses import blame as blame_lib
from kvfid.stacks.stack import Stack
from protocol_fixtures import small

needs_interpreter = pytest.mark.skipif(not kernels.interpreting(), reason="needs TRITON_INTERPRET=1")
PLANTED = "model.layers.1.mlp.down_proj"


def prefix_of(model, length=6):
    prompt = model.codec.prompt_ids("What is 12 + 30?")
    return prompt, prompt + [(17 * i + 5) % 200 for i in range(length)]


def blame_on(stack: Stack, against="prefill", plant=False):
    model = small("tiny-llama")
    prompt, prefix = prefix_of(model)
    with stack.activate(model) as module:
        if plant:  # one batch-variant op: a scale that only calls with more than one row get
            target = module.get_submodule(PLANTED)
            forward = target.forward
            target.forward = lambda x: forward(x) * (1.0 + 2.0 ** -10 * (x.shape[-2] > 1))
        try:
            return blame_lib.blame(module, prefix, len(prompt), against)
        finally:
            if plant:
                del target.forward


@needs_interpreter
@pytest.mark.parametrize("against", ["prefill", "chunked:4"])
def test_triton_with_the_mode_has_no_culprit(against):
    result = blame_on(Stack("triton", "bf16", True, threads=1), against)
    assert result.ops and all(op.kind == "equal" for op in result.ops), \
        [(op.module, op.op, op.kind) for op in result.ops if op.kind != "equal"][:5]
    assert result.culprits == [] and result.to_json()["first_culprit"] is None
    assert "no culprit: every op" in blame_lib.render(result, "triton/bf16+bi")


@needs_interpreter
def test_control_a_planted_batch_variant_op_is_blamed_at_its_module():
    result = blame_on(Stack("triton", "fp32", True, threads=1), plant=True)
    first = result.culprits[0]
    assert (first.module, first.op) == (PLANTED, "mul"), blame_lib.render(result, "planted")
    assert first.shapes_a[0][-2] == 1 and first.shapes_b[0][-2] > 1   # M=1 vs M=|P|
    assert first.n_diff > 0 and first.max_abs > 0
    # Everything downstream of it only inherits the difference.
    assert all(op.kind in ("equal", "inherited", "unverified") for op in result.ops[first.index + 1:])
    assert f"first culprit: mul in {PLANTED}" in blame_lib.render(result, "planted")


def test_control_the_variant_attention_twin_is_located_in_attention():
    """Under the mode, only the twin attention varies: the first op whose boundary slice differs
    is inside layer 0's attention, on any CPU."""
    result = blame_on(Stack("twin", "fp32", True, threads=1))
    first = next(op for op in result.ops if op.kind in blame_lib.align.DIFFER)  # not equal, compared
    assert first.module == "model.layers.0.self_attn" and first.kind in ("culprit", "unverified"), first


def test_slices_of_query_and_key_dimensions_and_input_verdicts():
    # Position 2: side a's call is a decode step [2, 3); side b's a prefill [0, 3).
    spans = blame_lib.Spans((2, 3), (0, 3), 2)
    a, b = torch.arange(4.0).reshape(1, 4), torch.arange(12.0).reshape(3, 4)   # query dim: 1 vs 3
    sa, sb = blame_lib._boundary(a, b, spans)
    assert torch.equal(sa, a[0:1]) and torch.equal(sb, b[2:3])
    keys_a, keys_b = torch.arange(6.0).reshape(3, 2), torch.arange(6.0).reshape(3, 2)
    assert blame_lib._compare([keys_a], [keys_b], spans) == "equal"   # key dim: same length here
    # Position 1 inside a 2-token prompt: side a [0, 2) of a 2-long cache, side b [0, 3).
    inner = blame_lib.Spans((0, 2), (0, 3), 1)
    sa, sb = blame_lib._boundary(torch.arange(2.0), torch.arange(3.0), inner)
    assert sa.tolist() == [1.0] and sb.tolist() == [1.0]
    assert blame_lib._boundary(torch.zeros(2, 3), torch.zeros(4, 5), spans) is None
    assert blame_lib._compare([b[2:3]], [b], spans) == "equal"
    assert blame_lib._compare([b[1:2]], [b], spans) == "differ"
    assert blame_lib._compare([torch.zeros(2, 7)], [torch.zeros(4, 5)], spans) == "unknown"
    signed = torch.tensor([[-0.0]]), torch.tensor([[0.0]])
    assert blame_lib._compare([signed[0]], [signed[1]], spans) == "differ"   # bits, not values


@needs_interpreter
def test_first_differing_position_is_none_when_exact_and_found_for_the_twin():
    model = small("tiny-llama")
    prompt, prefix = prefix_of(model)
    with Stack("triton", "fp32", True, threads=1).activate(model) as module:
        assert blame_lib.first_differing_position(module, prefix, len(prompt)) is None
    with Stack("twin", "fp32", True, threads=1).activate(model) as module:
        varying = blame_lib.first_differing_position(module, prefix, len(prompt))
        assert varying is not None and 0 < varying < len(prefix)
        located = blame_lib.blame(module, prefix, len(prompt), position=varying)
    first = next(op for op in located.ops if op.kind in blame_lib.align.DIFFER)
    assert located.position == varying and first.module == "model.layers.0.self_attn", first


def test_blame_refuses_other_constructions_and_short_prefixes():
    model = small("tiny-llama")
    prompt, prefix = prefix_of(model)
    with Stack("sdpa", "fp32").activate(model) as module:
        with pytest.raises(ValueError, match="prefill"):
            blame_lib.blame(module, prefix, len(prompt), "batched:2")
        with pytest.raises(ValueError, match="at least 2"):
            blame_lib.blame(module, prefix[:1], 1)
        with pytest.raises(ValueError, match="outside P"):
            blame_lib.blame(module, prefix, len(prompt), position=len(prefix))


@pytest.mark.parametrize("position", ["decode step", "inside the prompt"])
def test_lm_head_is_compared_at_the_blamed_position_not_the_last(position):
    """On a bit-exact stack, blaming a position before P's last compares lm_head's row at that
    position on both sides (every op equal), not the last row each call happens to end with."""
    model = small("tiny-llama")
    prompt, prefix = prefix_of(model)
    p = len(prefix) - 3 if position == "decode step" else len(prompt) - 2
    with Stack("native", "fp32", True, threads=1).activate(model) as module:
        result = blame_lib.blame(module, prefix, len(prompt), position=p)
    head = [op for op in result.ops if op.module == "lm_head"]
    assert head and all(op.kind == "equal" for op in head), head
    # Each side's lm_head sees every row of its call (a: the decode step or the prompt, b: all of P)
    rows_a = 1 if position == "decode step" else len(prompt)
    assert (head[0].shapes_a[0][-2], head[0].shapes_b[0][-2]) == (rows_a, len(prefix))
