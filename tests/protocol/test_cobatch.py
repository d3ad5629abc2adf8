"""`cobatched:N` and `cobatched:N+decode`: the co-batch chosen, padded as transformers pads, the
item's row compared with live; names accepted by case files and `kvfid repro`."""

import pytest
import torch
from click.testing import CliRunner

from kvfid.protocol import cobatch
from kvfid.stacks.stack import Stack
from kvfid.runs.case import CaseError, parse_case
from kvfid.cli import main
from kvfid.inputs.items import arith_items
from kvfid.protocol.protocol import (ItemPlan, Neighbours, parse_construction, parse_transplant,
                              run_cobatched, run_item)
from protocol_fixtures import PROMPT, fp32_live, tiny

POOL = arith_items(8)
COBATCHED = ("cobatched:4", "cobatched:4+decode")


def pool_ids(model):
    return tuple((i.id, model.codec.prompt_ids(i.prompt)) for i in POOL)


def test_choose_gives_distinct_lengths_one_longer_row_and_is_seeded():
    prefix, pool = list(range(40)), [(f"x{i}", list(range(1, 10 + i))) for i in range(5)]
    batch = cobatch.choose(prefix, "x0", pool, 6, max_length=70)
    assert batch == cobatch.choose(prefix, "x0", pool, 6, max_length=70)  # seeded
    lengths = [len(r) for r in batch.rows]
    assert batch.rows[batch.row] == tuple(prefix) and len(batch.rows) == 6
    others = lengths[:batch.row] + lengths[batch.row + 1:]
    assert len(set(others)) == 5 and 40 not in others and max(others) > 40
    assert max(lengths) <= 70 and "x0" not in batch.neighbours
    assert batch.pads[batch.row] == max(lengths) - 40 > 0
    with pytest.raises(ValueError, match="other items"):
        cobatch.choose(prefix, "x0", pool[:1], 2, max_length=70)


def test_padding_mask_and_positions_are_transformers_left_padding():
    batch = cobatch.CoBatch(rows=((5, 6, 7), (8,), (9, 10)), row=0, neighbours=("a", "b"))
    ids, mask, positions = cobatch.padded(batch)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 1]]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_cobatched_state_covers_p_and_matches_a_no_cache_forward_in_fp32(name):
    """Positions and masks are right iff the item's row gives the logits of a plain forward."""
    with fp32_live(name) as (model, module, prompt, live, prefix, full):
        neighbours = Neighbours(PROMPT.id, pool_ids(model), model.context_length - 4)
        for label in COBATCHED:
            arm = run_cobatched(module, parse_construction(label), prefix, 4,
                                model.codec.eos_ids, neighbours)
            assert arm.state.length == len(prefix) and arm.cobatch["pads"][arm.cobatch["row"]] > 0
            torch.testing.assert_close(arm.state.logits.float(), full, rtol=1e-5, atol=1e-5)
            assert len(arm.suffix.tokens) == 4 or arm.suffix.eos, label


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cobatched_is_bit_exact_with_live_on_the_faithful_stack(dtype):
    """The item among neighbours of other lengths, padded, prefilled and decoded in the batch:
    cache, boundary logits and suffix as live's (padding-aware kernel + batch-invariant mode; the
    native kernel: the protocol's co-batches are tested here, the Triton kernel's padding at model
    level in test_ragged)."""
    plan = ItemPlan(8, 4, arms=("live",) + COBATCHED,
                    transplants=(parse_transplant("live<-cobatched:4"),))
    record = run_item(tiny("tiny-qwen2"), Stack("native", dtype, True, threads=1), PROMPT, plan,
                      neighbours=POOL)
    assert [c.b for c in record.comparisons] == list(COBATCHED)
    for c in record.comparisons:
        assert c.cache.bit_exact and c.logits.equal, (c.b, c.cache.layers)
        assert c.suffix.identical, c.b
    assert record.arms["cobatched:4+decode"].forward_calls == 1 + (4 - 1)
    assert record.transplants[0].outcome == "recipient"


def test_case_files_and_repro_take_the_cobatched_names():
    text = ('model = "tiny-llama"\nB = 4\nS = 3\nconstructions = ["live", "cobatched:3", '
            '"cobatched:2+decode"]\n[items]\nset = "arith"\nn = 2\n[stacks]\nbackends = ["sdpa"]\n'
            'dtypes = ["fp32"]\n[transplants]\npairs = ["live<-cobatched:2+decode"]\n')
    case = parse_case(text)
    assert case.constructions == ("live", "cobatched:3", "cobatched:2+decode")
    assert case.transplants.specs[0].donor == "cobatched:2+decode"
    crossing = text + '[crossing]\nreference = "sdpa/fp32"\ndtypes = ["fp32"]\nconstructions = ["prefill", "cobatched:2"]\n'
    with pytest.raises(CaseError, match="other than live and cobatched"):
        parse_case(crossing)
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--prompt", "What is 2+2?",
                                       "--dtype", "fp32", "-B", "4", "-S", "3",
                                       "--arms", "live,cobatched:3+decode"])
    assert result.exit_code == 0, result.output
    assert "live ~ cobatched:3+decode" in result.output
