"""The mode's and the TP-invariant products' glue made cheaper, not one bit changed: each new path
against the path it replaced (kept here as the reference), bit for bit on random inputs, and a
twin that rounds differently caught by the same check, so the check can fail on any CPU.

* element-wise ops (kernels/invariant/ops.py `lane_uniform`): the tensor itself where it is a
  lanes-whole contiguous block, one padded call, or blocks written by the op's `out=` form,
  against a padded copy called in blocks and joined by `cat`;
* complex products only where a model may make them (kernels/invariant/complex_products.py):
  `makes_complex` reads a model's code; a model without them gives the same bits with the stock
  `mul` as with the override, and the ops that make a complex tensor refuse under a mode told
  there are none;
* the TP-invariant row products (kernels/invariant/parallel.py): the segments' inputs copied
  once into one aligned buffer and the tree added level by level, against a clone per segment
  and the tree pair by pair.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE_IDS, DTYPES, assert_bitwise_equal, bits_equal, randn, tiny_model

from kvfid.kernels import KernelRefusal
from kvfid.kernels.invariant import parallel
from kvfid.kernels.invariant.complex_products import STOCK_CALLS, makes_complex
from kvfid.kernels.invariant.mode import set_batch_invariant_mode, stock_ops
from kvfid.kernels.invariant.ops import BLOCK, ELEMENTWISE_OPS, LANES

ROWWISE = set_batch_invariant_mode(impl="rowwise")


# --- element-wise ---------------------------------------------------------------------------

def padded_blocks_then_cat(fn, x: torch.Tensor) -> torch.Tensor:
    """The element-wise path before: a zero-padded contiguous copy, calls of BLOCK elements, cat."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = x.new_zeros(-(-n // LANES) * LANES)
    padded[:n] = flat
    out = torch.cat([fn(padded[i:i + BLOCK]) for i in range(0, padded.numel(), BLOCK)])
    return out[:n].reshape(x.shape)


# Each op as a model calls it, extra arguments included (they reach the `out=` form too).
CALLS = {name: getattr(torch, name, None) or getattr(F, name) for name in ELEMENTWISE_OPS}
CALLS.update(gelu=lambda x: F.gelu(x, approximate="tanh"), softplus=lambda x: F.softplus(x, 2.0, 10.0))
POSITIVE = ("log", "rsqrt", "reciprocal", "log1p")   # inside their domains: no NaN to compare

# Every path: lanes-whole (the tensor itself), one padded call, blocks (`out=`), strided.
SHAPES = {"lanes-whole": (6, 256), "a block": (BLOCK // 256, 256), "padded": (3, 37), "one": (1,),
          "lanes-whole blocks": (2, BLOCK + LANES), "blocks": (2, BLOCK + 5), "strided": (40, 6),
          "strided blocks": (300, 64)}


def element_input(name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    x = randn(*shape, dtype=dtype, seed=len(name), scale=3.0, on="cpu")
    x = x.abs() + 0.25 if name in POSITIVE else x
    return x.t() if shape in (SHAPES["strided"], SHAPES["strided blocks"]) else x   # [N, M] view


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ELEMENTWISE_OPS)
def test_elementwise_paths_keep_the_bits(name, dtype):
    call = CALLS[name]
    for where, shape in SHAPES.items():
        x = element_input(name, shape, dtype)
        before = padded_blocks_then_cat(call, x)          # stock kernel, outside the mode
        with ROWWISE:
            now = call(x)
        assert_bitwise_equal(now, before, f"{name} {where} {tuple(x.shape)}")


def test_elementwise_check_catches_a_path_that_rounds_differently():
    """The twin computes in fp64 and rounds once: the fp32 kernel's several roundings differ."""
    x = element_input("sigmoid", SHAPES["blocks"], torch.float32)
    before = padded_blocks_then_cat(torch.sigmoid, x)
    assert not bits_equal(torch.sigmoid(x.double()).float(), before), "twin not caught"


# --- complex products -------------------------------------------------------------------------

class _ComplexBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.ones(4, dtype=torch.complex64))


def _module_from_source(tmp_path, monkeypatch, name: str, source: str) -> torch.nn.Module:
    """An instance of class `Rotary` of a Python module `name` written from `source`."""
    path = tmp_path / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module.Rotary()


def test_makes_complex_reads_the_models_code(tmp_path, monkeypatch):
    import families

    assert makes_complex(families.model("llama4"))          # its rotary: polar, view_as_complex
    assert not makes_complex(tiny_model("llama")) and not makes_complex(families.model("qwen3-moe"))
    assert makes_complex(torch.nn.Sequential(torch.nn.Linear(2, 2), _ComplexBuffer()))
    plain = "import torch\nclass Rotary(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\n"
    made = plain.replace("x * 2", "torch.view_as_complex(x) * 2")
    assert not makes_complex(_module_from_source(tmp_path, monkeypatch, "kvfid_scan_real", plain))
    assert makes_complex(_module_from_source(tmp_path, monkeypatch, "kvfid_scan_complex", made))


def _stock_mul_registered() -> bool:
    return "RegisterCPU" in repr(torch.library.get_kernel("aten::mul.Tensor", "CPU"))


def test_without_complex_products_mul_is_stock_and_complex_makers_refuse():
    angles = randn(3, 4, seed=3, on="cpu")
    makers = (lambda: torch.view_as_complex(randn(3, 2, seed=4, on="cpu")),
              lambda: torch.polar(torch.ones_like(angles), angles),
              lambda: torch.complex(angles, angles))
    with set_batch_invariant_mode(impl="rowwise", complex_products=False):
        assert _stock_mul_registered()
        for make in makers:
            with pytest.raises(KernelRefusal, match="complex_products=True"):
                make()
    with ROWWISE:
        assert not _stock_mul_registered()                 # the control: the override is there
        assert all(make().is_complex() for make in makers)
    assert _stock_mul_registered()


def test_stock_ops_is_per_thread_and_nests():
    """Inside stock_ops() this thread reaches the stock kernels (the guard's op runs), another
    thread the overrides (it refuses); an inner block's exit leaves the outer one stock."""
    x = randn(3, 2, on="cpu")
    seen = []

    def other_thread():
        try:
            torch.view_as_complex(x)
            seen.append("stock")
        except KernelRefusal:
            seen.append("override")

    with set_batch_invariant_mode(impl="rowwise", complex_products=False):
        with stock_ops():
            with stock_ops():
                assert torch.view_as_complex(x).is_complex()
            assert torch.view_as_complex(x).is_complex()
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
        with pytest.raises(KernelRefusal):
            torch.view_as_complex(x)
    assert seen == ["override"]


@contextlib.contextmanager
def _real_products_rounded_twice():
    """A twin: every floating product rounded once more (times 1 + 2^-10), a path that differs."""
    stock = STOCK_CALLS["mul.Tensor"](torch.library.get_kernel("aten::mul.Tensor", "CPU"))

    def twin(keys, a, b):
        out = stock(keys, a, b)
        return stock(keys, out, 1 + 2 ** -10) if out.is_floating_point() else out

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("mul.Tensor", twin, "CPU", with_keyset=True)
    try:
        yield
    finally:
        lib._destroy()


def _logits(model, ids, **mode) -> torch.Tensor:
    with set_batch_invariant_mode(impl="tiled", **mode), torch.inference_mode():
        return model(input_ids=ids).logits


def test_a_model_without_complex_products_keeps_its_bits_with_the_stock_mul():
    model = tiny_model("llama", seed=3)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    served = _logits(model, ids)
    assert_bitwise_equal(_logits(model, ids, complex_products=False), served, "logits")
    with _real_products_rounded_twice():
        twin = _logits(model, ids, complex_products=False)
    assert not bits_equal(twin, served), "twin not caught"


def test_a_faithful_stack_serves_complex_products_only_to_a_model_that_makes_them():
    import families

    from kvfid.inputs.models import from_module
    from kvfid.stacks.stack import parse_stack

    stack = parse_stack("native/fp32+bi")
    for module, served in ((families.model("llama4"), True), (families.model("smollm3"), False)):
        with stack.activate(from_module(module)):
            assert _stock_mul_registered() is not served
            if not served:
                with pytest.raises(KernelRefusal):
                    torch.view_as_complex(randn(2, 2, on="cpu"))


# --- TP-invariant row products ----------------------------------------------------------------

def segment_products_cloned(x, segments):
    """The row-parallel products before: each input segment cloned alone."""
    width, rows = segments[0].shape[1], x.reshape(-1, x.shape[-1])
    out = torch.stack([F.linear(rows[:, i * width:(i + 1) * width].clone(
        memory_format=torch.contiguous_format), weight) for i, weight in enumerate(segments)])
    return out.view(len(segments), *x.shape[:-1], out.shape[-1])


def tree_sum_pairwise(parts):
    """The tree before: pair by pair, over a list."""
    level = list(parts.unbind(0))
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return level[0]


def tree_sum_in_sequence(parts):
    """A twin: the parts added one after another."""
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", [False, True], ids=["stock", "mode"])
def test_row_products_keep_their_bits(dtype, mode):
    gen = torch.Generator().manual_seed(5)
    w = randn(96, 448, dtype=dtype, gen=gen, on="cpu")
    bias = randn(96, dtype=dtype, gen=gen, on="cpu")
    inputs = [randn(1, 448, dtype=dtype, gen=gen, on="cpu"), randn(17, 448, dtype=dtype, gen=gen, on="cpu"),
              randn(2, 5, 448, dtype=dtype, gen=gen, on="cpu"),
              randn(448, 6, dtype=dtype, gen=gen, on="cpu").t()]        # a strided [6, 448] view
    with set_batch_invariant_mode(impl="tiled") if mode else contextlib.nullcontext():
        for count in (8, 4, 2, 1):
            segments = parallel.cut(w, count, 1)
            for x in inputs:
                now = parallel.segment_products(x, segments)
                before = segment_products_cloned(x, segments)
                assert_bitwise_equal(now, before, f"{count} segments of {tuple(x.shape)}")
                reduced = parallel.tree_sum(before.float()).to(dtype) + bias
                assert_bitwise_equal(parallel.row_reduce(now, dtype, bias), reduced, "row_reduce")


def test_the_tree_by_levels_is_the_tree_pair_by_pair():
    for count in range(1, 10):
        parts = randn(count, 7, 33, seed=count, scale=1e3, on="cpu")
        assert_bitwise_equal(parallel.tree_sum(parts), tree_sum_pairwise(parts), f"{count} parts")
    parts = randn(8, 7, 33, seed=8, scale=1e3, on="cpu")
    assert not bits_equal(tree_sum_in_sequence(parts), tree_sum_pairwise(parts)), "twin not caught"


def test_segment_inputs_are_the_segments_each_aligned_as_a_fresh_tensor():
    rows = randn(3, 8 * 7, dtype=torch.bfloat16, on="cpu")
    parts = parallel.segment_inputs(rows, 8)
    first = parts[0].data_ptr()
    for i, part in enumerate(parts):
        assert part.is_contiguous() and (part.data_ptr() - first) % parallel.ALIGN_BYTES == 0
        assert bits_equal(part, rows[:, 7 * i:7 * (i + 1)])
