"""kvfid.kernels.invariant.mode: which aten ops are replaced, restoring on exit and on error, nesting, fallbacks,
and a whole tiny model made batch-invariant by it."""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import assert_bitwise_equal, device, tiny_model, randn
from torch.utils._python_dispatch import TorchDispatchMode

from kvfid.kernels.invariant import matmul, norm
from kvfid.kernels.invariant.mode import (IMPLS, OVERRIDDEN_OPS, batch_invariant_mode, set_batch_invariant_mode)


def dispatch_state() -> dict[str, str]:
    """The dispatcher's registration table of every overridden op (text, comparable)."""
    return {op: torch._C._dispatch_dump(f"aten::{op}") for op in OVERRIDDEN_OPS}


# ---- the ops a model reaches -------------------------------------------------------------------

class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.name().removeprefix("aten::")] += 1
        return func(*args, **(kwargs or {}))


# aten ops whose result is a reduction (a candidate for batch dependence), as traces name them.
REDUCING = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "dot", "matmul", "linear", "mean.dim",
            "sum.dim_IntList", "var.correction", "_softmax", "_log_softmax", "norm.ScalarOpt_dim",
            "_scaled_dot_product_flash_attention_for_cpu", "_fused_rms_norm", "native_layer_norm"}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_every_reducing_op_of_a_model_forward_is_overridden(kind):
    model = tiny_model(kind).cpu()  # which ops transformers calls: traced on the CPU
    model.set_attn_implementation("eager")  # eager attention: bmm and softmax too
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), OpCounter() as counter:
        logits = model(ids).logits
        torch.log_softmax(logits, dim=-1)
    seen = {op.removesuffix(".default") for op in counter.ops}
    assert seen & REDUCING <= set(OVERRIDDEN_OPS), f"not overridden: {seen & REDUCING - set(OVERRIDDEN_OPS)}"


# ---- install, restore, nest --------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_mode_replaces_ops_and_restores_them(impl):
    before = dispatch_state()
    a, w = randn(7, 96), randn(80, 96, seed=1)
    stock = a @ w.t()
    with set_batch_invariant_mode(impl=impl):
        assert batch_invariant_mode() == impl
        inside = dispatch_state()
        assert all(inside[op] != before[op] for op in OVERRIDDEN_OPS)
        if impl == "triton":
            assert_bitwise_equal(a @ w.t(), matmul.matmul(a, w.t()), "mm under the mode vs the kernel")
    assert batch_invariant_mode() is None
    assert dispatch_state() == before
    assert_bitwise_equal(a @ w.t(), stock, "mm after the mode vs before")


def test_mode_restores_ops_when_the_body_raises():
    before = dispatch_state()
    with pytest.raises(RuntimeError, match="boom"):
        with set_batch_invariant_mode():
            assert batch_invariant_mode() == "triton"
            raise RuntimeError("boom")
    assert batch_invariant_mode() is None
    assert dispatch_state() == before


def test_nested_modes_restore_the_enclosing_state():
    before = dispatch_state()
    with set_batch_invariant_mode():
        outer = dispatch_state()
        with set_batch_invariant_mode(impl="rowwise"):
            assert batch_invariant_mode() == "rowwise"
            with set_batch_invariant_mode(enabled=False):
                assert batch_invariant_mode() is None
                assert dispatch_state() == before
            assert batch_invariant_mode() == "rowwise"
        assert batch_invariant_mode() == "triton"
        with set_batch_invariant_mode():  # re-entering the same state changes nothing
            assert dispatch_state() == outer
        assert dispatch_state() == outer
    assert batch_invariant_mode() is None
    assert dispatch_state() == before


def test_the_same_mode_object_can_be_entered_again_inside_itself():
    before = dispatch_state()
    mode = set_batch_invariant_mode(impl="rowwise")
    with mode:
        with mode:
            assert batch_invariant_mode() == "rowwise"
        assert batch_invariant_mode() == "rowwise"
    with mode:  # and again after it was left
        assert batch_invariant_mode() == "rowwise"
    assert batch_invariant_mode() is None and dispatch_state() == before


def test_unknown_impl_is_refused_and_changes_nothing():
    before = dispatch_state()
    with pytest.raises(ValueError, match="impl"):
        with set_batch_invariant_mode(impl="magic"):
            pass
    assert batch_invariant_mode() is None and dispatch_state() == before


# ---- fallbacks ---------------------------------------------------------------------------------

def test_uncovered_calls_go_to_the_stock_kernel():
    a64, w64 = randn(5, 8, dtype=torch.float64), randn(8, 3, seed=1, dtype=torch.float64)
    bias = randn(3)
    a, w = randn(6, 8), randn(8, 3, seed=1)
    stock = (a64 @ w64, a64.mean(dim=0), torch.addmm(bias, a, w, beta=2.0), torch.softmax(a64, -1))
    with set_batch_invariant_mode():
        inside = (a64 @ w64, a64.mean(dim=0), torch.addmm(bias, a, w, beta=2.0), torch.softmax(a64, -1))
    for s, i, what in zip(stock, inside, ("fp64 mm", "fp64 mean", "addmm beta=2", "fp64 softmax")):
        assert_bitwise_equal(i, s, what)


def test_covered_calls_use_the_kernels():
    x = randn(5, 300)
    with set_batch_invariant_mode():
        mean = x.mean(dim=-1, keepdim=True)
        probs = torch.softmax(x, dim=-1)
    assert_bitwise_equal(mean, norm.mean_last_dim(x, keepdim=True), "mean.dim vs mean_last_dim")
    from kvfid.kernels.invariant.softmax import softmax
    assert_bitwise_equal(probs, softmax(x, -1), "_softmax vs kvfid.kernels.invariant.softmax")


# ---- a whole model -----------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_model_row_alone_equals_row_in_batch_under_the_mode(kind, impl):
    model = tiny_model(kind)
    model.set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(1)
    probe = torch.randint(0, 256, (1, 9), generator=gen).to(device())
    others = torch.randint(0, 256, (2, 9), generator=gen).to(device())
    batch = torch.cat([others, probe])  # the probe is row 2 of 3
    with torch.no_grad():
        stock = model(probe).logits
        with set_batch_invariant_mode(impl=impl):
            alone = model(probe).logits
            in_batch = model(batch).logits[2:3]
    assert_bitwise_equal(in_batch, alone, f"{kind} logits, probe alone vs in a batch of 3")
    torch.testing.assert_close(alone, stock, atol=1e-4, rtol=1e-4)
