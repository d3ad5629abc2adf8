"""Tensor parallel as part of a stack (kvfid.stacks.tp) on two gloo ranks of this machine: stock TP=2
against TP=1 (the state differs, blame names a parallel product), the TP-invariant `+bi` stack
bit-exact across TP sizes and constructions in bf16 and fp32, a TP case through the ledger, and
the refusals before compute. One spawn of two ranks serves the whole file (`ranked`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfid.kernels.invariant import parallel

pytestmark = pytest.mark.xdist_group("tp_ranks")

PROMPT = "What is 12 plus 30?"
FAITHFUL_ARMS = ("live", "prefill", "incremental", "prefill@tp1", "incremental@tp1", "chunked:4",
                 "batched:2", "cobatched:3", "batched:2@tp1")


def _comparisons(record) -> dict:
    return {c.b: (c.bit_exact, c.cache.first_bad_layer if c.cache else "no cache",
                  c.logits.equal if c.logits else None, c.suffix.identical)
            for c in record.comparisons}


def _on_each_rank(db: str) -> dict:
    """What every test here reads, measured by both ranks (rank 0's results come back)."""
    from kvfid.diagnoses.blame_command import blame_item
    from kvfid.inputs.items import Item
    from kvfid.inputs.models import load_model
    from kvfid.protocol.protocol import ItemPlan, run_item
    from kvfid.stacks.stack import parse_stack
    from kvfid.tasks import launch

    model, item = load_model("tiny-llama"), Item(id="x", prompt=PROMPT, answer=None)
    out = {}
    stock = parse_stack("sdpa/bf16@t1@tp2")
    out["stock"] = _comparisons(run_item(model, stock, item, ItemPlan(
        6, 4, ("live", "prefill@tp1", "incremental@tp1"))))
    result, first = blame_item(model, stock, model.codec.prompt_ids(PROMPT), 6, "prefill@tp1")
    out["blame"] = (first, [(op.module, op.op) for op in result.culprits])
    for dtype in ("bf16", "fp32"):
        out[dtype] = _comparisons(run_item(model, parse_stack(f"native/{dtype}+bi@t1@tp2"), item,
                                           ItemPlan(6, 4, FAITHFUL_ARMS)))
    out["run"] = launch._tp_rank("tp-tiny", None, db, None, None, False, True)
    return out


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    from kvfid.stacks.ranks import on_ranks

    db = str(tmp_path_factory.mktemp("tp") / "ledger.sqlite")
    return on_ranks(2, _on_each_rank, db), db


def test_stock_tp2_state_differs_from_the_tp1_rebuild(ranked):
    """The control: stock sdpa at TP=2 against its own TP=1 rebuild differs (each row-parallel
    product adds two partial sums rounded to bf16), and blame names a parallel product."""
    found, _ = ranked
    for arm in ("prefill@tp1", "incremental@tp1"):
        exact, first_bad_layer, _, _ = found["stock"][arm]
        assert not exact and first_bad_layer is not None, (arm, found["stock"][arm])
    first, culprits = found["blame"]
    assert first is not None and culprits, found["blame"]
    module, op = culprits[0]
    assert module.endswith(("_proj", "lm_head")) and ("parallel product" in op or
                                                      op.startswith("all_reduce")), culprits[0]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_faithful_tp2_is_one_set_of_bits_across_tp_sizes_and_constructions(ranked, dtype):
    found, _ = ranked
    assert set(found[dtype]) == set(FAITHFUL_ARMS[1:])
    for arm, (exact, first_bad_layer, logits_equal, suffix_identical) in found[dtype].items():
        assert exact and logits_equal and suffix_identical, (dtype, arm, first_bad_layer)


def test_a_tp_case_lands_in_the_ledger_with_each_sides_tp_size(ranked):
    """cases/tp-tiny.toml through `kvfid run`'s ranks: rank 0 wrote every unit, and each
    comparison row says the TP size of each side."""
    from kvfid.ledger.store import Ledger

    found, db = ranked
    assert found["run"].lines[0].endswith("4 units measured, 0 already stored"), found["run"].lines
    with Ledger(db, readonly=True) as ledger:
        (run, count), = ledger.runs()
        stored = ledger.stored_rows(run.id)
    assert count == 4
    measured = {unit: rows for unit, rows in stored.items() if ("arm", "live~prefill") in rows}
    assert {stack for _, stack in measured} == {"sdpa/bf16@t1@tp2", "native/bf16+bi@t1@tp2"}
    for (_, stack), rows in measured.items():   # units whose live run reached B (not `short`)
        metrics = {label: m for (kind, label), (m, _) in rows.items() if kind == "arm"}
        assert (metrics["live~prefill@tp1"]["tp_a"], metrics["live~prefill@tp1"]["tp_b"]) == (2, 1)
        assert (metrics["live~prefill"]["tp_a"], metrics["live~prefill"]["tp_b"]) == (2, 2)
        exact = metrics["live~prefill@tp1"]["cache_bit_exact"]
        assert exact == stack.startswith("native/bf16+bi"), (stack, metrics["live~prefill@tp1"])


def test_heads_that_do_not_divide_are_refused_in_one_line_before_compute():
    from click.testing import CliRunner

    from kvfid.cli import main

    for tp, reason in ((3, "4 attention heads do not divide by 3"),
                       (4, "2 KV heads do not divide by 4")):
        done = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--prompt", PROMPT,
                                         "-B", "2", "-S", "2", "--tp", str(tp)])
        assert done.exit_code == 3, done.output
        assert reason in done.output and len(done.output.strip().splitlines()) == 1, done.output


def test_segments_that_the_tp_size_does_not_divide_are_refused():
    from transformers import LlamaConfig

    from kvfid.stacks import tp

    config = LlamaConfig(hidden_size=192, intermediate_size=384, num_attention_heads=6,
                         num_key_value_heads=6, head_dim=32)
    assert tp.tp_reason(config, 3, invariant=False) is None         # stock TP=3 shards it
    reason = tp.tp_reason(config, 3, invariant=True)                 # 8 segments of 192
    assert reason and "8 fixed segment(s)" in reason and "3 ranks" in reason


def test_stack_and_arm_labels_carry_the_tp_size():
    from kvfid.protocol.constructions import ProtocolError, parse_construction
    from kvfid.stacks.stack import parse_stack

    stack = parse_stack("native/bf16+bi@t1@tp2")
    assert (stack.tp, stack.threads, stack.label) == (2, 1, "native/bf16+bi@t1@tp2")
    assert "tp" not in parse_stack("sdpa/bf16").describe()          # TP=1 records read as before
    assert parse_construction("chunked:4@tp1").label == "chunked:4@tp1"
    with pytest.raises(ProtocolError):
        parse_construction("live@tp1")


def test_row_segments_are_the_same_bits_whichever_rank_holds_them():
    """The reduction's structure, no ranks: the segment products of two halves of the reduction
    axis, concatenated, are the products of the whole axis's segments, so the tree gives one
    result; the stock twin (two half products rounded to bf16, then added) is another sum."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    w = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    whole = parallel.segment_products(x, parallel.cut(w, 8, 1))
    halves = torch.cat([parallel.segment_products(x[:, :128], parallel.cut(w[:, :128], 4, 1)),
                        parallel.segment_products(x[:, 128:], parallel.cut(w[:, 128:], 4, 1))])
    assert torch.equal(whole, halves)
    tp1 = parallel.row_reduce(whole, torch.bfloat16, None)
    assert torch.equal(tp1, parallel.row_reduce(halves, torch.bfloat16, None))
    split = F.linear(x[:, :128], w[:, :128]) + F.linear(x[:, 128:], w[:, 128:])
    assert not torch.equal(F.linear(x, w), split)   # the stock association differs here


def test_tree_sum_adds_in_one_fixed_order():
    """((p0 + p1) + (p2 + p3)) in fp32: 0 here, where adding in sequence gives 1."""
    parts = torch.tensor([1e8, 1.0, -1e8, 1.0], dtype=torch.float32)[:, None]
    assert parallel.tree_sum(parts).item() == 0.0
    assert (((parts[0] + parts[1]) + parts[2]) + parts[3]).item() == 1.0


def test_column_pieces_fall_back_to_each_piece_alone_where_the_probe_fails(monkeypatch):
    """Where one call over the pieces would not give each piece's bits, each piece is computed
    alone and concatenated (the same bits as the pieces at any TP size)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, generator=gen)
    w, b = torch.randn(16, 32, generator=gen), torch.randn(16, generator=gen)
    pieces = parallel.cut(w, 4, 0)
    monkeypatch.setattr(parallel, "pieces_agree", lambda *args: False)
    out = parallel.column_product(x, pieces, w, b)
    alone = torch.cat([F.linear(x, p, c) for p, c in zip(pieces, b.split(4))], -1)
    assert torch.equal(out, alone)


def test_plain_linears_run_a_bi_stack_without_its_tp_products_and_put_them_back(monkeypatch):
    """Inside `plain_linears` no ParallelLinear computes (the control: outside it, in the same
    `+bi` stack at TP=1, every linear layer goes through one); on exit the same ones are back."""
    from kvfid.inputs.models import load_model
    from kvfid.stacks import tp
    from kvfid.stacks.stack import parse_stack

    calls = []
    real = tp.ParallelLinear.forward
    monkeypatch.setattr(tp.ParallelLinear, "forward",
                        lambda self, x: calls.append(self.kind) or real(self, x))
    ids = torch.tensor([[5, 6, 7]])
    with parse_stack("native/fp32+bi@t1").activate(load_model("tiny-llama")) as module:
        wrapped = [m for m in module.modules() if isinstance(m, tp.ParallelLinear)]
        module(input_ids=ids)
        assert len(calls) == len(wrapped) > 0 and {"row", "column", "vocab"} <= set(calls)
        calls.clear()
        with tp.plain_linears(module):
            assert not any(isinstance(m, tp.ParallelLinear) for m in module.modules())
            module(input_ids=ids)
        assert calls == []
        assert [m for m in module.modules() if isinstance(m, tp.ParallelLinear)] == wrapped
