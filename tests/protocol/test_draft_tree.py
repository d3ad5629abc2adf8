"""Tree verification (`spec:tree`, harness/protocol/draft_tree.py): the spellings and their
refusals, the ancestor mask, the accepted path gathered out of a tree's slots, P rebuilt with
the boundary logits of a full forward, the faithful stack bit-exact live~spec:tree beside the
twin as the control, and replay re-scoring by a tree."""

from __future__ import annotations

import random

import pytest
import torch
from click.testing import CliRunner

from kvfid.protocol.constructions import split_arms
from kvfid.cli import main
from kvfid.protocol import draft_tree
from kvfid.stacks.stack import Stack
from kvfid.protocol.constructions import ProtocolError, parse_construction, parse_transplant
from kvfid.protocol.protocol import ItemPlan, run_construction, run_item
from kvfid.diagnoses import replay
from protocol_fixtures import PROMPT, fp32_live, small, tiny

TREES = ("spec:tree:2x2", "spec:tree:0,0,1,1", "spec:tree:0,0,1,1+rate0.5")


def test_a_tree_is_spelled_by_width_and_depth_or_by_parents():
    assert parse_construction("spec:tree:2x2").tree == (0, 0, 1, 1, 2, 2)
    assert parse_construction("spec:tree:3x1").tree == (0, 0, 0)
    assert parse_construction("spec:tree:0,0,1,1+rate0.5").label == "spec:tree:0,0,1,1+rate0.5"
    assert parse_transplant("live<-spec:tree:2x2:keys").donor == "spec:tree:2x2"
    assert split_arms("live,spec:tree:0,0,1,1,prefill,spec:tree:0,1+rate0.5") == (
        "live", "spec:tree:0,0,1,1", "prefill", "spec:tree:0,1+rate0.5")
    assert draft_tree.depths((0, 0, 1, 1)) == [0, 1, 1, 2, 2]


@pytest.mark.parametrize("text, message", [
    ("spec:tree:0,2", "node 2's parent 2 is not an earlier node"),
    ("spec:tree:0x2", "width W >= 1 and depth D >= 1"),
    ("spec:tree:4x4", "more than 64 draft nodes"),
    ("spec:tree:2x2+rate1.5", "bad arm"),
])
def test_bad_trees_exit_2_in_one_line_before_compute(text, message):
    with pytest.raises(ProtocolError):
        parse_construction(text)
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--prompt", "x",
                                       "--arms", f"live,{text}"])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_the_ancestor_mask_shows_each_node_its_ancestors_only():
    sees = draft_tree.ancestor_mask((0, 0, 1, 1), 2, torch.float32)[0, 0] == 0
    assert sees.tolist() == [[True, True, True, False, False, False, False],
                             [True, True, True, True, False, False, False],
                             [True, True, True, False, True, False, False],
                             [True, True, True, True, False, True, False],
                             [True, True, True, True, False, False, True]]


def test_the_accepted_path_is_gathered_after_the_root_in_order():
    from transformers import DynamicCache

    from kvfid.protocol.decode import Cached

    cache = DynamicCache()
    keys = torch.arange(7.0).view(1, 1, 7, 1)      # slot s holds s
    cache.update(keys, keys + 100, 0)
    kept = draft_tree.keep_path(Cached(cache, 7), 2, [1, 4])   # root at slot 2, path nodes 1 and 4
    assert kept.cache is cache and kept.positions == 5
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2, 3, 6]
    assert cache.layers[0].values.flatten().tolist() == [100, 101, 102, 103, 106]
    drafts, path = draft_tree._drafts((0, 0, 1, 1), [10, 11], None, random.Random(0), 50)
    assert [drafts[j - 1] for j in path] == [10, 11][:len(path)] and path


def test_a_tree_rebuilds_p_with_the_boundary_logits_of_a_full_forward_in_fp32():
    with fp32_live("tiny-llama", B=9, S=2) as (model, module, prompt, live, prefix, full):
        arms = {c: run_construction(module, parse_construction(c), len(prompt), prefix, 2,
                                    model.codec.eos_ids) for c in TREES}
    for label, arm in arms.items():
        assert arm.state.length == len(prefix), label
        torch.testing.assert_close(arm.state.logits.float(), full, rtol=1e-5, atol=1e-5)
        assert sum(arm.acceptance) + len(arm.acceptance) == 9, (label, arm.acceptance)
    assert arms["spec:tree:2x2"].acceptance == (2, 2, 2)   # 9 tokens: three steps of 1 + 2
    assert set(arms["spec:tree:0,0,1,1+rate0.5"].acceptance) != {2}   # the rate rejects some


def test_faithful_stack_is_bit_exact_live_spec_tree_and_the_twin_is_not():
    """The claim: on native/bf16+bi every tree arm's cache, boundary logits and suffix equal
    live's bit for bit. The control: the twin's split count follows the forward's row count, so a
    tree's verification pass must change the bits. (Stock sdpa/bf16 is a per-machine finding,
    docs/protocol.md, not a test.)"""
    plan = ItemPlan(10, 3, arms=("live", *TREES), ignore_eos=True)
    model = small("tiny-llama")
    exact = run_item(model, Stack("native", "bf16", True, threads=1), PROMPT, plan)
    for c in exact.comparisons:
        assert c.cache.bit_exact and c.logits.equal and c.suffix.identical, (c.b, c.cache.layers)
    twin = run_item(model, Stack("twin", "bf16", True, threads=1), PROMPT, plan)
    assert not twin.against_live("spec:tree:2x2").cache.bit_exact


def test_the_triton_kernel_is_bit_exact_live_spec_tree():
    """The Triton kernel (in the interpreter here) serves each verify call's ancestor mask by its
    visibility path: every tree arm's cache, boundary logits and suffix equal live's."""
    plan = ItemPlan(6, 1, arms=("live", "spec:tree:2x2"), ignore_eos=True)
    done = run_item(small("tiny-llama"), Stack("triton", "fp32", True, threads=1), PROMPT, plan)
    for c in done.comparisons:
        assert c.cache.bit_exact and c.logits.equal and c.suffix.identical, (c.b, c.cache.layers)


def test_replay_rescores_by_a_tree_bit_identically_on_the_faithful_stack():
    model = tiny()
    prompt = model.codec.prompt_ids("What is 2+3?")
    t = replay.Trajectory("t", tuple(prompt), tuple([40, 41, 42, 43, 44, 40, 41, 7]))
    result = replay.replay(model, Stack("native", "bf16", True, threads=1), [t],
                           ("spec:tree:2x2",))
    agg = result["aggregate"]["spec:tree:2x2"]
    assert agg["tokens"] == len(t.tokens) and agg["differ"] == 0, agg
    acceptance = result["items"][0]["constructions"]["spec:tree:2x2"]["acceptance"]
    assert sum(acceptance) + len(acceptance) == len(t.tokens) - 1


def test_a_tree_on_a_model_with_window_layers_is_refused_before_compute():
    from kvfid.protocol.constructions import RollbackError, _check_tree
    from kvfid.stacks.serving import LayerInfo

    layers = [LayerInfo(0, "full_attention", "DynamicLayer", "full", ()),
              LayerInfo(1, "sliding_attention", "DynamicSlidingWindowLayer", "window",
                        ("sliding_window",), 4096)]
    with pytest.raises(RollbackError, match="spec:tree:2x2: layer 1 is sliding_window"):
        _check_tree(layers, ["spec:tree:2x2"])
    _check_tree(layers[:1], ["spec:tree:2x2"])
    _check_tree(layers, [])   # no tree arm: nothing to refuse


def test_kvfid_run_measures_a_tree_arm_into_the_ledger(tmp_path):
    from kvfid.runs.case import parse_case
    from kvfid.ledger.store import Ledger
    from kvfid.runs.matrix import run_case

    case = parse_case('model = "tiny-llama"\nB = 6\nS = 2\nignore_eos = true\n'
                      'constructions = ["live", "spec:tree:2x2", "spec:tree:0,0,1,1+rate0.5"]\n'
                      '[items]\nset = "arith"\n'
                      'n = 1\n[stacks]\nbackends = ["native"]\ndtypes = ["bf16"]\n'
                      'batch_invariant = [true]\nthreads = 1\n', "tree.toml")
    result = run_case(case, tmp_path / "l.sqlite", model=tiny(), progress=False)
    with Ledger(tmp_path / "l.sqlite") as ledger:
        (unit,) = ledger.units(result.run_id)
    record = unit.record
    assert record.arms["spec:tree:2x2"].acceptance and record.against_live("spec:tree:2x2").bit_exact
    assert sum(record.arms["spec:tree:0,0,1,1+rate0.5"].acceptance) + len(
        record.arms["spec:tree:0,0,1,1+rate0.5"].acceptance) == 6
