"""kvfid.kernels.jit: in the Triton interpreter a device function's call (ours, and the language's own
during our launches) skips the language re-patch, which the launch did; it computes the
interpreter's own bits, and a launch patches once. Compiled, `kernel` and `device_function` are
`triton.jit` (test_compile.py compiles these kernels)."""

from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager

import pytest
import torch
import triton.runtime.interpreter as interpreter
from helpers import assert_bitwise_equal, bits_equal, randn

from kvfid import kernels
from kvfid.kernels import dot, jit
from kvfid.kernels.attention import kernel as attention_kernel, tiles, visible
from kvfid.kernels.attention.kernel import AttentionConfig, attention
from kvfid.kernels.invariant import matmul, norm, softmax

pytestmark = pytest.mark.skipif(not kernels.interpreting() or jit._INTERPRETED is None,
                                reason="the Triton interpreter, with InterpretedFunction.rewrite")

DEVICE_FUNCTIONS = (tiles.tanh, tiles.merge, tiles.with_sink, tiles.tile_scores, tiles.tile_update,
                    dot.mma, norm._row_sum_tile)
# Two key tiles per segment over three segments: tile_scores, tanh (softcap), tile_update, merge
# and with_sink (sinks, split path) all run, many times per launch.
SPLIT = AttentionConfig(block_n=32, max_tile_rows=64, num_warps=4, num_stages=1, use_dot=False,
                        segment=64)
UNSPLIT = dataclasses.replace(SPLIT, segment=0)


KERNELS = (attention_kernel._attention_kernel, visible._visible_kernel, norm._mean_kernel,
           norm._rms_norm_kernel, matmul._matmul_kernel, softmax._softmax_kernel)


@contextmanager
def stock_calls():
    """Our device functions and kernels with the interpreter's own calls (a re-patch of the
    language at every device call, ours and the language's)."""
    for fn in DEVICE_FUNCTIONS + KERNELS:
        fn.__class__ = jit._INTERPRETED
    try:
        yield
    finally:
        for fn in DEVICE_FUNCTIONS:
            fn.__class__ = jit._DeviceFunction
        for fn in KERNELS:
            fn.__class__ = jit._Kernel


@contextmanager
def counted_patches():
    """The number of `_patch_lang` calls while inside (a list holding one count)."""
    original, count = interpreter._patch_lang, [0]

    def counting(fn):
        count[0] += 1
        return original(fn)

    interpreter._patch_lang = counting
    try:
        yield count
    finally:
        interpreter._patch_lang = original


def test_every_device_function_and_kernel_takes_the_short_calls_and_the_language_its_own_after():
    assert all(type(fn) is jit._DeviceFunction for fn in DEVICE_FUNCTIONS)
    assert all(type(fn) is jit._Kernel for fn in KERNELS)
    import triton.language as tl
    assert tl.sum in jit._LANGUAGE_FUNCTIONS and tl.zeros in jit._LANGUAGE_FUNCTIONS
    norm.rms_norm(randn(4, 8), randn(8))
    assert all(type(fn) is jit._INTERPRETED for fn in jit._LANGUAGE_FUNCTIONS)   # restored


def _runs(dtype, sinks=(0.5, -1.0)):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (randn(1, h, 150, 32, dtype=dtype, gen=gen) for h in (2, 1, 1))
    sinks = torch.tensor(sinks)
    x, w = randn(33, 96, dtype=dtype, seed=1), randn(96, dtype=dtype, seed=2)
    return [attention(q, k, v, config=config, softcap=4.0, sinks=sinks, window=50)
            for config in (SPLIT, UNSPLIT)] + [norm.rms_norm(x, w), norm.mean_last_dim(x),
                                               softmax.log_softmax(x), matmul.matmul(x, x.T)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_short_call_gives_the_bits_of_the_interpreters_own(dtype):
    fast = _runs(dtype)
    with stock_calls():
        stock = _runs(dtype)
    for what, a, b in zip(("split attention", "attention", "rms_norm", "mean", "log_softmax",
                           "matmul"), fast, stock):
        assert_bitwise_equal(a, b, what)
    # the negative control: the comparison sees a changed input (another sink logit)
    assert not bits_equal(fast[0], _runs(dtype, sinks=(0.5, -1.5))[0])


def test_a_launch_patches_the_language_once_and_the_stock_calls_per_device_call():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (randn(1, h, 150, 32, gen=gen) for h in (2, 1, 1))
    with counted_patches() as fast:
        attention(q, k, v, config=UNSPLIT)
    with stock_calls(), counted_patches() as stock:
        attention(q, k, v, config=UNSPLIT)
    assert fast[0] == 1 + len(jit._LANGUAGE_MODULES)   # the kernel's modules, the language's
    assert stock[0] > 1 + 4      # the stock calls re-patch at each key tile's update and tl.sum


def test_a_launch_runs_from_a_frame_larger_than_a_chunk_of_cpythons_frame_stack(monkeypatch):
    """Our launch calls the interpreter's from `_in_fresh_chunk`, whose frame no chunk's rest can
    hold, so the launch's frames start a chunk of their own whatever the caller's depth (where
    an interpreter's small calls straddle a chunk's end, CPython maps and unmaps one per call:
    kernels/jit.py). The control: the interpreter's own call path launches from elsewhere."""
    callers, original = [], jit._INTERPRETED.run

    def spy(self, *args, **kwargs):
        callers.append(sys._getframe(1).f_code)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(jit._INTERPRETED, "run", spy)
    x, w = randn(4, 8), randn(8)
    ours = norm.rms_norm(x, w)
    with stock_calls():
        stock = norm.rms_norm(x, w)
    assert_bitwise_equal(ours, stock, "rms_norm")
    fresh, control = callers
    assert fresh is jit._in_fresh_chunk.__code__ and control is not fresh
    assert fresh.co_nlocals * 8 > 16 * 1024          # 16 KB: CPython 3.11-3.13's chunk
    assert jit._in_fresh_chunk(lambda *a, **k: (a, k), (1, 2), {"x": 3}) == ((1, 2), {"x": 3})
