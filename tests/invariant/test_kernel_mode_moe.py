"""The mode's MoE, recurrent-scan and element-wise overrides (kernels/invariant/ops.py): each against a
plain fp64 reference (tolerance per dtype), bitwise batch-invariant (a row, line, matrix, position
or element computed alone has the bits it has inside a bigger call), and the same invariance
check catching a twin that is batch-variant by construction (its split or formula chosen from the
call's size), so the check can fail on any CPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPE_IDS, DTYPES, assert_bitwise_equal, assert_close_to_ref, bits_equal, randn

from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.invariant.ops import conv1d_depthwise_ref, lane_uniform

ROWWISE = set_batch_invariant_mode(impl="rowwise")


def grouped_mm(x, w, counts):
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return torch._grouped_mm(x, w, offs=offs)


def grouped_mm_ref(x, w, counts):
    rows, start = [], 0
    for g, n in enumerate(counts):
        rows.append(x[start:start + n].double() @ w[g].double())
        start += n
    return torch.cat(rows)


def twin_grouped_mm(x, w, counts):
    """Batch-variant by construction: a group of more than one row sums K in two halves, each
    rounded to the dtype."""
    out, start = [], 0
    for g, n in enumerate(counts):
        xs, wg = x[start:start + n].float(), w[g].float()
        if n > 1:
            h = xs.shape[1] // 2
            out.append((xs[:, :h] @ wg[:h]).to(x.dtype) + (xs[:, h:] @ wg[h:]).to(x.dtype))
        else:
            out.append((xs @ wg).to(x.dtype))
        start += n
    return torch.cat(out)


def grouped_row_alone_equal(fn, dtype) -> bool:
    """Row 0 of expert 1 alone (1 token) vs among 7 tokens of that expert, 3 experts busy."""
    x, w = randn(12, 96, dtype=dtype, seed=1, on="cpu"), randn(3, 96, 40, dtype=dtype, seed=2, on="cpu")
    crowd = fn(x, w, [3, 7, 2])[3:4]
    alone = fn(x[3:4], w, [0, 1, 0])
    return bits_equal(alone, crowd)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_mm_matches_reference(dtype):
    x, w = randn(12, 96, dtype=dtype, seed=1, on="cpu"), randn(3, 96, 40, dtype=dtype, seed=2, on="cpu")
    ref = grouped_mm_ref(x, w, [3, 7, 2])
    with ROWWISE:
        out = grouped_mm(x, w, [3, 7, 2])
    assert_close_to_ref(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_mm_row_is_batch_invariant_and_twin_is_not(dtype):
    with ROWWISE:
        assert grouped_row_alone_equal(grouped_mm, dtype)
    assert not grouped_row_alone_equal(twin_grouped_mm, dtype), "the check cannot see a variant kernel"


def twin_sum(x, dim):
    """Batch-variant by construction: more than one output row sums each row in two halves."""
    moved = x.movedim(dim, -1)
    if moved.numel() // moved.shape[-1] > 1:
        h = moved.shape[-1] // 2
        return moved[..., :h].sum(-1) + moved[..., h:].sum(-1)
    return moved.sum(-1)


def twin_cumsum(x, dim):
    """Batch-variant by construction: more than one line adds a zero-sum offset pair per step."""
    moved = x.movedim(dim, -1)
    if moved.numel() // moved.shape[-1] > 1:
        out = (moved * 3).cumsum(-1) - (moved * 2).cumsum(-1)
    else:
        out = moved.cumsum(-1)
    return out.movedim(-1, dim)


REDUCTIONS = {"sum": (lambda x, d: torch.sum(x, d), lambda x, d: x.double().sum(d), twin_sum),
              "cumsum": (lambda x, d: torch.cumsum(x, d), lambda x, d: x.double().cumsum(d), twin_cumsum)}


def line_alone_equal(fn, x, dim) -> bool:
    """Line (0, 0) along `dim` alone vs inside x [4, 70, 6]; sum's output drops `dim`."""
    dim = dim % x.dim()
    index = [slice(0, 1)] * x.dim()
    index[dim] = slice(None)
    alone, whole = fn(x[tuple(index)], dim), fn(x, dim)
    out_index = list(index) if whole.dim() == x.dim() else [i for d, i in enumerate(index) if d != dim]
    return bits_equal(alone, whole[tuple(out_index)])


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reductions(name, dtype):
    op, ref, twin = REDUCTIONS[name]
    x = randn(4, 70, 6, dtype=dtype, seed=3, on="cpu")
    with ROWWISE:
        for dim in (0, 1, -1):
            assert_close_to_ref(op(x, dim), ref(x, dim), dtype)
            assert line_alone_equal(op, x, dim), f"{name} over dim {dim} is not invariant"
    control = randn(4, 70, 6, seed=3, on="cpu")  # fp32: a rounding difference stays visible
    assert not all(line_alone_equal(twin, control, dim) for dim in (1, -1)), "twin not caught"


def causal_conv(x, w):
    """transformers' causal_conv1d_fn: depthwise, left context K-1, the first T outputs."""
    return torch.nn.functional.conv1d(x, w, None, padding=w.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]]


def conv_update(window, w):
    """causal_conv1d_update: the last K inputs (the conv state and the new token), no padding."""
    return torch.nn.functional.conv1d(window, w, None, padding=0, groups=window.shape[1])[..., -1:]


def twin_conv(x, w):
    """Batch-variant by construction: a call of more than K positions sums its taps backwards."""
    if x.shape[-1] <= w.shape[-1]:
        return conv_update(x, w)
    xp = torch.nn.functional.pad(x.float(), (w.shape[-1] - 1, 0))
    acc = torch.zeros_like(x, dtype=torch.float32)
    for k in reversed(range(w.shape[-1])):
        acc = acc + xp[..., k:k + x.shape[-1]] * w[:, 0, k].float()[None, :, None]
    return acc.to(x.dtype)


def last_position_equal(prefill, update, x, w) -> bool:
    """The last position's conv output: the prefill's (all of x) vs the update's (its window)."""
    return bits_equal(prefill(x, w)[..., -1:], update(x[..., -w.shape[-1]:], w)[..., -1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_causal_conv1d_prefill_equals_update(dtype):
    x, w = randn(2, 48, 13, dtype=dtype, seed=4, on="cpu"), randn(48, 1, 4, dtype=dtype, seed=5, on="cpu") * 0.5
    ref = torch.nn.functional.conv1d(x.double(), w.double(), None, padding=3, groups=48)[..., :13]
    assert_close_to_ref(conv1d_depthwise_ref(x, w, None, 3)[..., :13], ref, dtype)
    with ROWWISE:
        assert_close_to_ref(causal_conv(x, w), ref, dtype)
        assert last_position_equal(causal_conv, conv_update, x, w)
    control_x, control_w = randn(2, 48, 13, seed=4, on="cpu"), randn(48, 1, 4, seed=5, on="cpu")  # fp32
    assert not last_position_equal(twin_conv, twin_conv, control_x, control_w), "twin not caught"


@pytest.mark.parametrize("dtype", (torch.float32,), ids=("fp32",))
def test_solve_triangular_matrix_is_batch_invariant(dtype):
    a = torch.eye(16) + torch.tril(randn(5, 16, 16, seed=6, on="cpu"), -1) * 0.3
    b = randn(5, 16, 8, seed=7, on="cpu")
    ref = torch.linalg.solve_triangular(a.double(), b.double(), upper=False, unitriangular=True)
    with ROWWISE:
        whole = torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)
        alone = torch.linalg.solve_triangular(a[2:3], b[2:3], upper=False, unitriangular=True)
    assert_close_to_ref(whole, ref, dtype)
    assert_bitwise_equal(alone, whole[2:3], "matrix 2 alone vs in the batch")


ELEMENTWISE = {"sigmoid": (torch.sigmoid, torch.sigmoid), "silu": (torch.nn.functional.silu, torch.nn.functional.silu),
               "softplus": (torch.nn.functional.softplus, torch.nn.functional.softplus),
               "exp": (torch.exp, torch.exp), "tanh": (torch.tanh, torch.tanh)}


def twin_sigmoid(x):
    """Variant by construction: the last (size % 7) elements by the tanh identity."""
    out = torch.sigmoid(x.float())
    tail = x.numel() % 7
    if tail:
        flat = out.reshape(-1)
        flat[-tail:] = 0.5 * torch.tanh(0.5 * x.reshape(-1)[-tail:].float()) + 0.5
    return out.to(x.dtype)


def elements_alone_equal(fn, x) -> bool:
    """Every element of x computed alone (a 1-element call) vs inside all of x."""
    whole = fn(x).reshape(-1)
    return bits_equal(torch.cat([fn(v.reshape(1)) for v in x.reshape(-1)]), whole)


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_elementwise_is_position_invariant(name, dtype):
    op, ref = ELEMENTWISE[name]
    x = randn(3, 37, dtype=dtype, seed=8, scale=3.0, on="cpu")
    with ROWWISE:
        out = op(x)
        assert elements_alone_equal(op, x), f"{name}: an element's bits depend on its place"
    assert_close_to_ref(out, ref(x.double()), dtype)
    assert elements_alone_equal(lambda v: lane_uniform(op, v), x)
    assert not elements_alone_equal(twin_sigmoid, randn(2, 40, seed=9, scale=6.0, on="cpu")), "twin not caught"


def twin_cumsum_by_total(x):
    """Variant in the length by construction: prefix = total - (the suffix after it)."""
    total = x.sum(-1, keepdim=True)
    suffix = x.flip(-1).cumsum(-1).flip(-1) - x
    return total - suffix


def prefix_alone_equal(fn, x, k) -> bool:
    """A chunk's first k prefix sums computed over the first k elements alone vs over all of x."""
    return bits_equal(fn(x[..., :k]), fn(x)[..., :k])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cumsum_prefix_does_not_depend_on_the_length(dtype):
    x = randn(3, 64, dtype=dtype, seed=10, on="cpu")
    with ROWWISE:
        assert all(prefix_alone_equal(lambda v: torch.cumsum(v, -1), x, k) for k in (1, 5, 33, 63))
    control = randn(3, 64, seed=10, on="cpu")
    assert not all(prefix_alone_equal(twin_cumsum_by_total, control, k) for k in (5, 33)), "twin not caught"


def rotary_products(x, position_ids, product):
    """A complex rotary as transformers 5.17's Llama 4 computes it: the angles by a matmul, then
    transposed (the position dim innermost in memory), turned complex by polar; x [1, T, H, D/2]
    complex64 times them by `product`."""
    inv = torch.linspace(1.0, 1e-3, x.shape[-1])[None, :, None]                # [1, D/2, 1]
    angles = (inv @ position_ids[:, None, :].float()).transpose(1, 2)          # [1, T, D/2]
    return product(x, torch.polar(torch.ones_like(angles), angles)[:, :, None, :])


def positions_alone_equal(product, x) -> bool:
    """Each position's rotary products computed in a 1-position call vs inside the whole call."""
    positions = torch.arange(x.shape[1])[None]
    whole = torch.view_as_real(rotary_products(x, positions, product))
    alone = [torch.view_as_real(rotary_products(x[:, t:t + 1].clone(), positions[:, t:t + 1], product))
             for t in range(x.shape[1])]
    return bits_equal(torch.cat(alone, 1), whole)


def twin_complex_product(a, b):
    """Variant in the call's length by construction: a call of several positions rounds its
    products once from fp64, a 1-position call computes them in fp32."""
    if a.shape[1] == 1:
        return a * b
    return (a.to(torch.complex128) * b.to(torch.complex128)).to(a.dtype)


def test_complex_products_do_not_depend_on_the_call_length():
    """The stock CPU kernel rounds a complex product by its vector body or its strided loop, so
    with 5.17's Llama 4 rotary tables a position's bits depended on the call (measured on an
    AVX-512 EPYC: 900 of 950 positions); under the mode each part is real mul, sub and add."""
    x = torch.view_as_complex(randn(1, 19, 4, 8, 2, seed=11, on="cpu"))
    stock = rotary_products(x, torch.arange(19)[None], torch.mul)
    with ROWWISE:
        assert positions_alone_equal(torch.mul, x)
        out = rotary_products(x, torch.arange(19)[None], torch.mul)
    ref = rotary_products(x.to(torch.complex128), torch.arange(19)[None], torch.mul)
    assert_close_to_ref(torch.view_as_real(out), torch.view_as_real(ref), torch.float32)
    assert torch.allclose(out, stock, rtol=0, atol=1e-6)
    assert not positions_alone_equal(twin_complex_product, x), "twin not caught"


@pytest.mark.parametrize("operand", [0.1, 3, True, -2.5, torch.tensor(0.3), torch.tensor(3),
                                     torch.tensor(0.3, dtype=torch.bfloat16), torch.randn(5, 7)],
                         ids=lambda v: repr(v) if not isinstance(v, torch.Tensor) else f"{v.dtype}{list(v.shape)}")
def test_real_products_are_the_stock_kernels(operand):
    """`mul` is overridden for its complex products only: every real product (a Python number,
    which a Python kernel receives unwrapped, or a 0-d tensor, on either side) has the stock
    kernel's dtype and bits, under the mode and inside stock_ops()."""
    import contextlib

    from kvfid.kernels.invariant.mode import stock_ops

    tensors = [randn(5, 7, seed=12, on="cpu"), randn(5, 7, seed=12, on="cpu").bfloat16(),
               torch.arange(35).reshape(5, 7), torch.tensor(0.7, dtype=torch.bfloat16), torch.tensor(2)]
    for t in tensors:
        stock = [t * operand, operand * t]
        for block in (contextlib.nullcontext, stock_ops):
            with ROWWISE, block():
                for ours, theirs in zip([t * operand, operand * t], stock):
                    assert ours.dtype == theirs.dtype and bits_equal(ours, theirs), (t.dtype, operand)
