"""Complex products under the batch-invariant mode, and where a model needs them.

The stock CPU kernel of a complex product (Llama 4's rotary: `xq_ * freqs_cis`) runs a vector
body and a strided scalar loop that round (a+bi)(c+di) differently, so a product's bits depend
on its operands' layout (a transposed rotary table takes the strided loop: docs/hazards.md,
"Complex products round by their layout"). `mul.Tensor`'s override (SERVE) computes the real and
imaginary parts with real element-wise mul, sub and add, each rounded once whatever the path
(real operands and 0-d ones included); a real product goes to the stock kernel.

The dispatcher does not dispatch by dtype, so that override puts every real product through
Python too. The mode installs it only where complex products may happen: by default always
(`set_batch_invariant_mode(complex_products=True)`), and a stack asks `makes_complex(model)`,
which reads the model's code, never its family's name (a complex parameter or buffer, or
complex-making code in a Python module that defines one of its modules' classes: transformers
keeps a model's code in its modeling file). Where it said none, the mode guards the ops that
make a complex tensor from real ones instead (GUARD: `view_as_complex`, `polar`, `complex`):
reaching one refuses the forward (KernelRefusal), so a product the scan missed never runs on
the stock kernel unnoticed. CPU only (kernels/invariant/ops.py's CPU_ONLY_OPS).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
import sys
from collections.abc import Callable

import torch

from kvfid.kernels import KernelRefusal

SERVE = ("mul.Tensor",)
GUARD = ("view_as_complex", "polar", "complex")
# a complex dtype -> the dtype of its parts
_PARTS = {torch.complex64: torch.float32, torch.complex128: torch.float64}
# What makes a complex tensor in Python source: the constructors, a complex dtype, a Fourier
# transform (substrings: a false match costs only speed), a complex literal.
_COMPLEX_WORDS = ("view_as_complex", "polar", "torch.complex", "complex32", "complex64",
                  "complex128", "chalf", "cfloat", "cdouble", "fft", "stft")
_COMPLEX_LITERAL = re.compile(r"\dj\b")


def makes_complex(model: torch.nn.Module) -> bool:
    """Whether `model` may compute a complex product: it holds a complex parameter or buffer, or
    a Python module defining one of its modules' classes (torch's own aside) has complex-making
    code or cannot be read."""
    names = set()
    for sub in model.modules():     # one walk; a module's own tensors read from its dicts
        if any(t is not None and t.is_complex()
               for t in itertools.chain(sub._parameters.values(), sub._buffers.values())):
            return True
        names.update(cls.__module__ for cls in type(sub).__mro__)
    return any(_source_makes_complex(name) for name in sorted(names)
               if name != "builtins" and name != "torch" and not name.startswith("torch."))


@functools.lru_cache(maxsize=None)
def _source_makes_complex(module_name: str) -> bool:
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, TypeError, OSError):
        return True          # code that cannot be read may make one
    return any(word in source for word in _COMPLEX_WORDS) or bool(_COMPLEX_LITERAL.search(source))


def complex_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b (broadcast; one of them complex64/128, the other that, real or 0-d) as
    (ac - bd) + (ad + bc)i from real element-wise ops: every element rounds alike, whatever the
    operands' layout. A part that is zero (a real operand's imaginary) is not computed."""
    dtype = torch.result_type(a, b)
    part = _PARTS[dtype]

    def parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not t.is_complex():
            return t.to(part), None
        pair = torch.view_as_real(t.to(dtype))   # [..., 2]
        return pair[..., 0], pair[..., 1]

    (re_a, im_a), (re_b, im_b) = parts(a), parts(b)
    if im_a is None:
        return torch.complex(re_a * re_b, re_a * im_b)
    if im_b is None:
        return torch.complex(re_a * re_b, im_a * re_b)
    return torch.complex(re_a * re_b - im_a * im_b, re_a * im_b + im_a * re_b)


def _mul(impl: str, original) -> Callable:
    stock = _stock_mul(original)

    def mul(keys, a, b):
        if torch.result_type(a, b) in _PARTS and all(_plain(t) for t in (a, b)):
            return complex_product(_tensor(a), _tensor(b))
        return stock(keys, a, b)
    return mul


def _stock_mul(original) -> Callable:
    """The stock `mul.Tensor` called with what the dispatcher hands a Python kernel (a wrapped
    number arrives as a Python number, which the stock kernel takes only as a tensor)."""
    def stock(keys, a, b):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return original.call_boxed(keys, a, b)
        return _with_number(lambda x, y: original.call_boxed(keys, x, y), a, b)
    return stock


def _plain(t) -> bool:
    """A strided tensor without a conjugate bit, or a number."""
    return not isinstance(t, torch.Tensor) or (t.layout == torch.strided and not t.is_conj())


# A Python number's dtype as a wrapped-number tensor holds it.
_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64,
                  complex: torch.complex128}


def _tensor(x) -> torch.Tensor:
    """x, or a Python number as a 0-d tensor of its own dtype."""
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=_NUMBER_DTYPES[type(x)])


def _with_number(stock: Callable, a, b) -> torch.Tensor:
    """stock(a, b) where one of them is a Python number: a wrapped number, which a Python kernel
    receives unwrapped and the stock kernel takes only as a tensor. It goes in as a 0-d tensor of
    the number's own dtype (the value the kernel reads), or of the promoted dtype, beside the
    tensor or, when that is 0-d, a 1-element view of it: the first that promotes to the dtype the
    wrapped number gave."""
    tensor, number = (a, b) if isinstance(a, torch.Tensor) else (b, a)
    wanted = torch.result_type(tensor, number)
    held = _tensor(number)
    views = (tensor, tensor.reshape(1)) if tensor.dim() == 0 else (tensor,)
    for scalar in (held, held.to(wanted)):
        for view in views:
            if torch.result_type(view, scalar) == wanted:
                out = stock(view, scalar) if a is tensor else stock(scalar, view)
                return out.reshape(tensor.shape) if view is not tensor else out
    raise AssertionError(f"no operand promotes {tensor.dtype} by {number!r} to {wanted}")


def _guard(op: str) -> Callable:
    def factory(impl: str, original) -> Callable:
        def refuse(keys, *args, **kwargs):
            raise KernelRefusal(f"aten::{op} made a complex tensor under a batch-invariant mode "
                                "entered without complex products: kvfid's reading of the model's "
                                "code (makes_complex) missed it; the mode with "
                                "complex_products=True serves it")
        return refuse
    return factory


# The stock kernel as `mode.stock_ops()` calls it, where a plain boxed call would not take what a
# Python kernel receives.
STOCK_CALLS = {"mul.Tensor": _stock_mul}

FACTORIES = {"mul.Tensor": _mul, **{op: _guard(op) for op in GUARD}}
