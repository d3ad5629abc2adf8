"""The mode's out= forms (what compiled code calls: inductor's extern kernels write into buffers)
give the bits of the mode's own kernels, and are installed and removed with the mode."""

import pytest
import torch

from kvfid.kernels.invariant.mode import OUT_OPS, set_batch_invariant_mode
from helpers import randn


def _dumps():
    return {op: torch._C._dispatch_dump(f"aten::{op}") for op in OUT_OPS}


def test_out_forms_are_installed_with_the_mode_and_removed_after_it():
    before = _dumps()
    with set_batch_invariant_mode(True, impl="rowwise"):
        inside = _dumps()
    assert all(inside[op] != before[op] for op in OUT_OPS)
    assert _dumps() == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_out_forms_give_the_functional_override_bits_row_by_row(dtype):
    a, b, bias = randn(9, 48, dtype=dtype, seed=1), randn(48, 40, dtype=dtype, seed=2), randn(40, dtype=dtype, seed=3)
    a3, b3 = randn(3, 7, 48, dtype=dtype, seed=4), randn(3, 48, 40, dtype=dtype, seed=5)
    with set_batch_invariant_mode(True, impl="rowwise"):
        cases = [(torch.mm, (a, b), lambda i: torch.mm(a[i:i + 1], b), 9),
                 (torch.addmm, (bias, a, b), lambda i: torch.addmm(bias, a[i:i + 1], b), 9)]
        for fn, args, alone, rows in cases:
            out = torch.empty(0, dtype=dtype)
            fn(*args, out=out)
            assert torch.equal(out, fn(*args)), fn.__name__
            for i in range(rows):   # a row's bits do not depend on the rows beside it
                assert torch.equal(out[i:i + 1], alone(i)), (fn.__name__, i)
        out = torch.empty(0, dtype=dtype)
        torch.bmm(a3, b3, out=out)
        assert torch.equal(out, torch.bmm(a3, b3))
        assert torch.equal(out[1, 2:3], torch.bmm(a3[1:2, 2:3], b3[1:2])[0])
