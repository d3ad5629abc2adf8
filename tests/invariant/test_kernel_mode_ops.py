"""Every op the batch-invariant mode covers, fully: mean over any dims, (log-)softmax over any dim
with contiguous output and `half_to_float`, 0-d input. Each is checked bitwise (an output slice
computed alone against the same slice inside the whole tensor) under both implementations, and the
same check must catch a deliberately batch-variant twin (its reduction split chosen from the
number of rows, as a shape heuristic would), so the check can fail on any CPU.
"""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
from helpers import DTYPE_IDS, DTYPES, assert_close_to_ref, bits_equal, device, max_abs_diff, randn

from kvfid.kernels.invariant.mode import IMPLS, set_batch_invariant_mode
from kvfid.kernels.invariant.softmax import log_softmax, softmax

SHAPE = (5, 6, 70)  # every reduced size is a multiple of 5 (the twin splits by 5)
MEAN_DIMS = [(0,), (1,), (-1,), (0, 2), (1, 2), (0, 1, 2)]
SOFTMAX_DIMS = [0, 1, -2, -1]


randn = partial(randn, scale=2.0)  # values of about +-6: reductions see mixed signs and magnitudes


def kept_dims(x: torch.Tensor, reduced) -> list[int]:
    reduced = {d % x.dim() for d in reduced}
    return [d for d in range(x.dim()) if d not in reduced]


def part(t: torch.Tensor, kept: list[int], index: tuple[int, ...]) -> torch.Tensor:
    """The slice of t at `index` in the kept dims (size 1 there), whole in the reduced ones."""
    where = dict(zip(kept, index))
    return t[tuple(slice(where[d], where[d] + 1) if d in where else slice(None) for d in range(t.dim()))]


def slice_failures(fn, x: torch.Tensor, reduced, most: int = 24) -> list[str]:
    """Output slices whose bits differ between the slice computed alone and inside all of x (at
    most `most` slices, evenly spread, first and last included: interpreter time). `fn(x)`
    reduces over `reduced` and keeps x's rank (keepdim)."""
    kept = kept_dims(x, reduced)
    whole = fn(x)
    failures = []
    indices = list(itertools.product(*(range(x.shape[d]) for d in kept)))
    step = max(1, -(-(len(indices) - 1) // (most - 1)))
    for index in indices[::step] + ([indices[-1]] if (len(indices) - 1) % step else []):
        alone, inside = fn(part(x, kept, index)), part(whole, kept, index)
        if not bits_equal(alone, inside):
            failures.append(f"{index}: max |diff| {max_abs_diff(alone, inside)!r}")
    return failures


def twin_sum(x: torch.Tensor, reduced) -> torch.Tensor:
    """A batch-variant sum over `reduced` (keepdim): split in 5 parts when there is more than one
    output row, in one part when there is one."""
    kept = kept_dims(x, reduced)
    rows = x.permute(*kept, *[d for d in range(x.dim()) if d not in kept])
    rows = rows.reshape(*rows.shape[:len(kept)], -1)  # [*kept, n]
    n_rows = rows[..., 0].numel()
    splits = 5 if n_rows > 1 else 1
    total = rows.reshape(*rows.shape[:-1], splits, -1).sum(-1).sum(-1)  # [*kept]
    shape = [x.shape[d] if d in kept else 1 for d in range(x.dim())]
    return total.reshape(shape)


# ---- mean over any dims ------------------------------------------------------------------------

def mode_mean(impl, reduced):
    def fn(x):
        with set_batch_invariant_mode(impl=impl):
            return x.mean(dim=reduced, keepdim=True)
    return fn


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("reduced", MEAN_DIMS, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_mean_over_any_dims_is_correct_and_batch_invariant(impl, reduced, dtype):
    x = randn(*SHAPE, dtype=dtype)
    out = mode_mean(impl, reduced)(x)
    assert_close_to_ref(out, x.double().mean(dim=reduced, keepdim=True), dtype)
    with set_batch_invariant_mode(impl=impl):
        assert x.mean(dim=reduced).shape == x.mean(dim=reduced, keepdim=True).squeeze(reduced).shape
    failures = slice_failures(mode_mean(impl, reduced), x, reduced)
    assert not failures, f"mean over {reduced} ({impl}): " + "; ".join(failures[:5])


@pytest.mark.parametrize("reduced", [(-1,), (1, 2)], ids=str)
def test_control_a_batch_variant_mean_is_caught(reduced):
    x = randn(*SHAPE)
    n = x.numel() // twin_sum(x, reduced).numel()
    assert slice_failures(lambda t: twin_sum(t, reduced) / n, x, reduced)


# ---- softmax and log-softmax over any dim ------------------------------------------------------

def mode_softmax(impl, dim, log, half_to_float=False):
    op = torch.ops.aten._log_softmax if log else torch.ops.aten._softmax

    def fn(x):
        with set_batch_invariant_mode(impl=impl):
            return op(x, dim, half_to_float)
    return fn


@pytest.mark.parametrize("dim", SOFTMAX_DIMS)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_over_any_dim_is_contiguous_correct_and_batch_invariant(impl, log, dim):
    x = randn(*SHAPE)
    out = mode_softmax(impl, dim, log)(x)
    ref = (torch.log_softmax if log else torch.softmax)(x.double(), dim)
    assert out.is_contiguous() and out.shape == x.shape
    assert_close_to_ref(out, ref, torch.float32)
    failures = slice_failures(mode_softmax(impl, dim, log), x, (dim,))
    assert not failures, f"{'log_' if log else ''}softmax over {dim} ({impl}): " + "; ".join(failures[:5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("impl", IMPLS)
def test_half_to_float(impl, log, dtype):
    x = randn(*SHAPE, dtype=dtype)
    out = mode_softmax(impl, -1, log, half_to_float=True)(x)
    ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    assert_close_to_ref(out, ref, torch.float32)  # fp32 out, fp32 math
    assert not slice_failures(mode_softmax(impl, -1, log, half_to_float=True), x, (-1,))


def test_control_a_batch_variant_softmax_is_caught():
    def twin(x):  # exp over a batch-variant sum
        e = torch.exp(x - x.amax(dim=-1, keepdim=True))
        return e / twin_sum(e, (-1,))
    assert slice_failures(twin, randn(*SHAPE), (-1,))


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_dim_input(impl):
    x = torch.tensor(0.7, device=device())
    assert softmax(x).shape == () and softmax(x).item() == 1.0
    assert log_softmax(x).shape == () and log_softmax(x).item() == 0.0
    with set_batch_invariant_mode(impl=impl):
        inside = (torch.softmax(x, 0), torch.log_softmax(x, 0), x.mean())
    for got, want in zip(inside, (torch.softmax(x, 0), torch.log_softmax(x, 0), x.mean())):
        assert got.shape == () and bits_equal(got, want)


# ---- mm with an output dtype -------------------------------------------------------------------

def stock_mm_dtype_exists(dev: torch.device) -> bool:
    try:
        torch.library.get_kernel("aten::mm.dtype", "CUDA" if dev.type == "cuda" else "CPU")
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(stock_mm_dtype_exists(torch.device("cpu")), reason="this torch has a CPU mm.dtype")
def test_mm_dtype_without_a_stock_kernel_is_left_alone():
    """`aten::mm.dtype` has no CPU kernel here (torch 2.13's CPU build, torch 2.11's CUDA build):
    the mode adds none, under CPU or any key that had none. Where the build has a CUDA kernel the
    mode replaces it, so the whole dispatcher entry may change; which keys have a kernel may not."""
    a, b = randn(4, 8, dtype=torch.bfloat16).cpu(), randn(8, 3, dtype=torch.bfloat16, seed=1).cpu()
    keys = ("CPU", "CUDA")
    before = {k: torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", k) for k in keys}
    assert before["CPU"] is False
    with set_batch_invariant_mode(impl="rowwise"):
        assert {k: torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", k)
                for k in keys} == before
        with pytest.raises(NotImplementedError):
            torch.ops.aten.mm.dtype(a, b, torch.float32)


def twin_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A batch-variant mm with fp32 out: K split in 4 when there is more than one row."""
    splits = 4 if a.shape[0] > 1 else 1
    parts = [x.float() @ y.float() for x, y in zip(a.chunk(splits, 1), b.chunk(splits, 0))]
    return torch.stack(parts).sum(0)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_mm_dtype_rows_alone_equal_rows_in_batch_and_the_twin_is_caught(impl):
    a, b = randn(33, 576, dtype=torch.bfloat16), randn(576, 192, dtype=torch.bfloat16, seed=1)

    def mode_mm(x):
        with set_batch_invariant_mode(impl=impl):
            return torch.ops.aten.mm.dtype(x, b, torch.float32)  # [M, N] fp32
    out = mode_mm(a)
    assert out.dtype == torch.float32
    assert_close_to_ref(out, a.double() @ b.double(), torch.float32)
    bad = [i for i in range(a.shape[0]) if not bits_equal(mode_mm(a[i:i + 1]), out[i:i + 1])]
    assert not bad, f"rows {bad} differ alone"
    twin = twin_mm(a, b)
    assert any(not bits_equal(twin_mm(a[i:i + 1], b), twin[i:i + 1]) for i in range(a.shape[0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_topk_under_the_mode_returns_contiguous_tensors_as_stock_does(impl):
    """A MoE router's experts `.view(-1)` (transformers 5.17's Aria): the stable-sort topk's
    indices are a narrowed sort, made contiguous as stock topk returns them."""
    x = randn(6, 8, dtype=torch.float32, on="cpu")
    stock = torch.topk(x, 2)
    with set_batch_invariant_mode(impl=impl):
        values, indices = torch.topk(x, 2)
        assert values.is_contiguous() and indices.is_contiguous()
        assert indices.view(-1).shape == (12,)
    assert torch.equal(values, stock.values) and torch.equal(indices, stock.indices)
