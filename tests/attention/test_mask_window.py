"""A sliding window that only the mask states: a model whose attention passes no `sliding_window`
(transformers' PhiMoE builds a sliding-window mask and a sliding-window cache, and calls the
attention without the window) is served by the kernels' window path, read from the mask, so its
prefill is the same computation as its decode over the cache; any other mask keeps the
visibility path."""

from __future__ import annotations

import pytest
import torch

import registry_walk as rw
from kvfid.kernels.attention.reference import visible
from kvfid.kernels.hf_masks import place_keys

SERVES = frozenset({"sliding_window", "visibility"})


def _mask(allowed: torch.Tensor) -> torch.Tensor:
    return allowed[:, None]   # [B, 1, q, kv] bool, as transformers' sdpa mask


def test_a_window_stated_only_by_the_mask_is_read_from_it():
    q_len = kv_len = 9
    mask = _mask(visible(torch.zeros(1, dtype=torch.long), q_len, kv_len, 4, None))
    positions = torch.arange(kv_len)[None]
    placed = place_keys("k", mask, positions, 1, q_len, kv_len, None, None, SERVES, torch.device("cpu"))
    assert placed == {"key_start": 0, "first_valid": None, "window": 4}


def test_control_a_mask_that_is_no_window_keeps_the_visibility_path():
    q_len = kv_len = 9
    allowed = visible(torch.zeros(1, dtype=torch.long), q_len, kv_len, 4, None).clone()
    allowed[0, 8, 0] = True   # the last query also sees key 0: no window's pattern
    placed = place_keys("k", _mask(allowed), torch.arange(kv_len)[None], 1, q_len, kv_len, None,
                        None, SERVES, torch.device("cpu"))
    assert set(placed) == {"visibility"} and torch.equal(placed["visibility"], allowed)


def test_a_kernel_without_windows_is_not_given_one():
    mask = _mask(visible(torch.zeros(1, dtype=torch.long), 9, 9, 4, None))
    placed = place_keys("k", mask, torch.arange(9)[None], 1, 9, 9, None, None,
                        frozenset({"visibility"}), torch.device("cpu"))
    assert set(placed) == {"visibility"}


@pytest.mark.parametrize("stack", ["native/fp32+bi", "native/bf16+bi"])
def test_a_mask_stated_window_model_is_bit_exact_past_its_window_on_the_faithful_stack(stack):
    """PhiMoE, tiny (window 8): the boundary's 9 tokens pass the window. Before the window was
    read from the mask, native+bi differed at layer 1 k (the mask took the visibility path,
    whose tiles sit in the view's coordinates, the decode's in absolute positions)."""
    if "phimoe" not in rw.registry():
        pytest.skip("this transformers has no PhiMoE")
    model = rw.tiny("phimoe")
    assert rw.one(model, stack, boundary=4) == "bit-exact"
    assert rw.one(model, stack, boundary=8) == "bit-exact"
