"""kvfid.kernels.attention.native: correctness against fp64 (every mechanism), bitwise invariance
(constructions, batch, left padding, window caches), negative controls, and the contract."""

from __future__ import annotations

import pytest
import torch
from helpers import (BATCH_SIZES, DTYPE_IDS, DTYPES, assert_bitwise_equal, assert_close_to_ref,
                     check_rejects_bad_inputs, differing_positions, probe_in_batches, randn)

from kvfid.stacks.twins import attention_twin
from kvfid.kernels.attention.native import NativeConfig, attention, attention_ref
from kvfid.kernels.invariant.mode import set_batch_invariant_mode


def make_qkv(batch, n_q, n_kv, length, head_dim, dtype, seed=0, v_dim=None):
    gen = torch.Generator().manual_seed(seed)
    return (randn(batch, n_q, length, head_dim, dtype=dtype, gen=gen, on="cpu"),
            randn(batch, n_kv, length, head_dim, dtype=dtype, gen=gen, on="cpu"),
            randn(batch, n_kv, length, v_dim or head_dim, dtype=dtype, gen=gen, on="cpu"))


def by_chunks(q, k, v, bounds, fn=attention, **kw):
    """All positions, chunk by chunk over a growing cache (fresh tensors, as a cache grows)."""
    return torch.cat([fn(q[:, :, s:e].clone(), k[:, :, :e].clone(), v[:, :, :e].clone(), **kw)
                      for s, e in zip(bounds, bounds[1:])], dim=2)


LENGTH = 100  # crosses a 64-key tile, fills neither the last query tile nor the last key tile
CONSTRUCTIONS = {"decode": list(range(LENGTH + 1)),
                 "chunks-37": list(range(0, LENGTH, 37)) + [LENGTH],
                 "prompt-13-then-9": [0] + list(range(13, LENGTH, 9)) + [LENGTH]}
MECHANISMS = {"causal": {}, "window-40": {"window": 40}, "chunk-48": {"chunk": 48},
              "softcap-5": {"softcap": 5.0}, "sinks": {"sinks": torch.linspace(-1.0, 2.0, 6)}}


# ---- correctness -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mechanism", MECHANISMS, ids=list(MECHANISMS))
def test_native_matches_fp64_reference(mechanism, dtype):
    kw = MECHANISMS[mechanism]
    q, k, v = make_qkv(2, 6, 2, 90, 32, dtype, v_dim=24)  # GQA 3, Dv != Dqk
    q = q[:, :, -41:]  # a chunk over a longer cache
    ref = attention_ref(q.double(), k.double(), v.double(),
                        **{n: (x.double() if torch.is_tensor(x) else x) for n, x in kw.items()})
    assert_close_to_ref(attention(q, k, v, **kw), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_left_padding_matches_reference(dtype):
    q, k, v = make_qkv(3, 4, 2, 40, 16, dtype)
    first_valid = torch.tensor([0, 7, 40])  # the last row is all padding so far
    ref = attention_ref(q.double(), k.double(), v.double(), first_valid=first_valid)
    out = attention(q, k, v, first_valid=first_valid)
    assert_close_to_ref(out, ref, dtype)
    assert not out[1, :, :7].any() and not out[2].any(), "padded queries must be zeros"


# ---- fidelity: every position, every construction ----------------------------------------------

# Plain causal in every dtype; each mechanism in bf16, the two that change the scores in fp32 too.
CONSTRUCTION_CASES = ([("causal", d) for d in DTYPES] + [(m, torch.bfloat16) for m in MECHANISMS
                                                         if m != "causal"]
                      + [("window-40", torch.float32), ("softcap-5", torch.float32)])


@pytest.mark.parametrize("mechanism,dtype", CONSTRUCTION_CASES,
                         ids=[f"{m}-{str(d)[6:]}" for m, d in CONSTRUCTION_CASES])
def test_every_position_same_bits_in_prefill_chunks_and_decode(mechanism, dtype):
    kw = MECHANISMS[mechanism]
    q, k, v = make_qkv(1, 6, 2, LENGTH, 64, dtype)  # SmolLM2's head dim, GQA 3
    prefill = attention(q, k, v, **kw)
    for name, bounds in CONSTRUCTIONS.items():
        bad = differing_positions(by_chunks(q, k, v, bounds, **kw), prefill)
        assert not bad, f"{mechanism} {name}: positions {bad} differ from prefill"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_window_cache_gives_the_full_cache_bits(dtype):
    """A sliding layer's cache keeps only the window (k[:, :, 0] at `key_start`): same bits."""
    window = 40
    q, k, v = make_qkv(1, 4, 2, LENGTH, 32, dtype)
    prefill = attention(q, k, v, window=window)
    for t in range(LENGTH):
        start = max(0, t - window + 1)
        step = attention(q[:, :, t:t + 1], k[:, :, start:t + 1].clone(), v[:, :, start:t + 1].clone(),
                         window=window, key_start=start)
        assert_bitwise_equal(step[:, :, 0], prefill[:, :, t], f"decode at {t} over a window cache")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_alone_equals_row_in_any_batch(dtype):
    for n, row, alone in probe_in_batches(attention, dtype, BATCH_SIZES, on="cpu"):
        assert_bitwise_equal(row, alone, f"probe as row {n - 1} of a batch of {n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_left_padded_row_has_its_bits_alone(dtype):
    """Row 1 padded by 11 among other rows: its valid positions have the bits of the row alone."""
    q, k, v = make_qkv(2, 6, 2, LENGTH, 64, dtype)
    alone = attention(q[1:, :, :LENGTH - 11], k[1:, :, :LENGTH - 11], v[1:, :, :LENGTH - 11])
    padded = [torch.cat([t[:1], torch.cat([torch.zeros_like(t[1:, :, :11]), t[1:, :, :-11]], 2)])
              for t in (q, k, v)]
    out = attention(*padded, first_valid=torch.tensor([0, 11]))
    assert_bitwise_equal(out[1:, :, 11:], alone, "the padded row")


def test_the_mode_leaves_native_bits_alone():
    """Inside a batch-invariant mode the native kernel's fixed-shape products reach the stock
    kernels (stock_ops): the same bits as without the mode."""
    q, k, v = make_qkv(2, 6, 2, 70, 32, torch.bfloat16)
    plain = attention(q, k, v)
    for impl in ("rowwise", "tiled"):
        with set_batch_invariant_mode(impl=impl):
            assert_bitwise_equal(attention(q, k, v), plain, f"native under the {impl} mode")


# ---- negative controls -------------------------------------------------------------------------

def test_control_the_construction_check_catches_a_split_kv_twin():
    q, k, v = make_qkv(1, 6, 2, LENGTH, 64, torch.bfloat16)
    prefill = attention_twin(q, k, v)
    for name, bounds in CONSTRUCTIONS.items():
        assert differing_positions(by_chunks(q, k, v, bounds, attention_twin), prefill), \
            f"{name}: the twin was not caught"


def test_control_tiles_not_aligned_to_positions_differ():
    """The alignment is what makes decode match prefill: shifting the same keys by a position
    (so tiles cut them elsewhere) changes bits somewhere, so the check above can see a misalignment."""
    q, k, v = make_qkv(1, 6, 2, LENGTH, 64, torch.float32)
    aligned = attention(q, k, v, config=NativeConfig(16, 16))
    shifted = attention(q, k, v, key_start=5, config=NativeConfig(16, 16))  # same keys, tiles moved
    torch.testing.assert_close(shifted, aligned)  # the same function ...
    assert differing_positions(shifted, aligned), "... with other bits: tiles moved with positions"


# ---- contract ----------------------------------------------------------------------------------

def test_native_rejects_bad_inputs():
    check_rejects_bad_inputs(attention, make_qkv)
    q, k, v = make_qkv(1, 2, 1, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="tile_n"):
        NativeConfig(16, 24)
