"""The mode's and the TP-invariant products' glue made cheaper, not one bit changed: each new path
against the path it replaced (kept here as the reference), bit for bit on random inputs, and a
twin that rounds differently caught by the same check, so the check can fail on any CPU.

* complex products only where a model may make them (kernels/invariant/complex_products.py):
  `makes_complex` reads a model's code; a model without them gives the same bits with the stock
  `mul` as with the override, and the ops that make a complex tensor refuse under a mode told
  there are none.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys

import pytest
import torch
from helpers import assert_bitwise_equal, bits_equal, randn, tiny_model

from kvfid.kernels import KernelRefusal
from kvfid.kernels.invariant.complex_products import STOCK_CALLS, makes_complex
from kvfid.kernels.invariant.mode import set_batch_invariant_mode

ROWWISE = set_batch_invariant_mode(impl="rowwise")


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
