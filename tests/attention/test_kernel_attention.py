"""kvfid.kernels.attention.kernel: correctness against fp64, bitwise invariance (constructions, batch), controls."""

from __future__ import annotations

import pytest
import torch
from helpers import (BATCH_SIZES, DTYPE_IDS, DTYPES, assert_bitwise_equal, assert_close_to_ref,
                     bits_equal, check_rejects_bad_inputs, device, differing_positions,
                     probe_in_batches, randn)

from kvfid.stacks.twins import attention_twin
from kvfid.kernels.attention.kernel import BLOCK_M, attention, attention_ref, config_for


def make_qkv(batch, n_q_heads, n_kv_heads, length, head_dim, dtype, seed=0):
    """q [B, Hq, T, D], k and v [B, Hkv, T, D] (q for every position; slice for fewer queries)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (randn(batch, h, length, head_dim, dtype=dtype, gen=gen)
               for h in (n_q_heads, n_kv_heads, n_kv_heads))
    return q, k, v


def by_chunks(q, k, v, bounds, fn=attention):
    """The outputs for all positions, computed chunk by chunk over a cache: chunk i covers
    positions bounds[i]:bounds[i+1] and sees keys 0:bounds[i+1]."""
    outs = [fn(q[:, :, s:e], k[:, :, :e], v[:, :, :e]) for s, e in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=2)


# ---- correctness -------------------------------------------------------------------------------

SHAPES = [  # (B, Hq, Hkv, Tq, Tk, D)
    (2, 4, 2, 37, 37, 32),  # GQA prefill, odd length
    (1, 9, 3, 1, 130, 64),  # SmolLM2-like decode over two key tiles
    (1, 2, 1, 21, 150, 128),  # chunk crossing a key-tile boundary, head dim 128
    (2, 2, 2, 5, 5, 16),  # MHA, tiny head dim
    (1, 3, 1, 9, 9, 48),  # head dim not a power of two
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Tq{}-Tk{}-D{}".format(*s))
def test_attention_matches_fp64_reference(shape, dtype):
    batch, n_q, n_kv, q_len, kv_len, head_dim = shape
    q, k, v = make_qkv(batch, n_q, n_kv, kv_len, head_dim, dtype)
    q = q[:, :, kv_len - q_len:]
    ref = attention_ref(q.double(), k.double(), v.double())  # reference
    out = attention(q, k, v)  # kernel
    assert_close_to_ref(out, ref, dtype)  # compare


def test_attention_scale_argument():
    q, k, v = make_qkv(1, 2, 1, 10, 32, torch.float32)
    ref = attention_ref(q.double(), k.double(), v.double(), scale=0.3)
    assert_close_to_ref(attention(q, k, v, scale=0.3), ref, torch.float32)


# ---- fidelity: every position, every construction ---------------------------------------------

LENGTH = 140  # crosses a key tile and does not fill the last query or key tile
BLOCK_N = max(config_for(device(), dtype).block_n for dtype in DTYPES)
assert LENGTH > BLOCK_N and LENGTH % BLOCK_M and LENGTH % BLOCK_N


def constructions(length: int, every_decode: bool = True) -> dict[str, list[int]]:
    """Chunk boundaries of each construction of positions 0..length-1 (decode: one per step).
    Without `every_decode`, decode steps only one below, at and one above the first query-tile
    edge and the key-tile edge, and at the last position, with chunks between (a decode step is
    one stateless launch for one position: interpreter time is per launch)."""
    chunks = {f"chunks-{n}": list(range(0, length, n)) + [length] for n in (5, 16, 37)}
    prompt_then_chunks = [0] + list(range(13, length, 9)) + [length]  # a 13-token prompt, then 9s
    if every_decode:
        decode = {"decode": list(range(length + 1))}
    else:
        steps = {p for edge in (BLOCK_M, BLOCK_N) for p in (edge - 1, edge, edge + 1)} | {length - 1}
        steps = {p for p in steps if p < length}
        decode = {"decode-at-edges": sorted({0, length} | steps | {p + 1 for p in steps})}
    return {**decode, **chunks, "prompt-13-then-chunks-9": prompt_then_chunks}


# The interpreter path computes in fp32 whatever the input dtype (a dtype changes the loads and
# the output cast): the 140-position case in fp32 (every position decoded) and bf16 (decoded at
# the edges), the head-dim-128 case in fp16.
CONSTRUCTION_CASES = [((3, 1, 64, LENGTH), torch.float32, True), ((3, 1, 64, LENGTH), torch.bfloat16, False),
                      ((2, 1, 128, 40), torch.float16, True)]


@pytest.mark.parametrize("heads,dtype,every_decode", CONSTRUCTION_CASES,
                         ids=["Hq3-Hkv1-D64-T140-fp32", "Hq3-Hkv1-D64-T140-bf16", "Hq2-Hkv1-D128-T40-fp16"])
def test_every_position_same_bits_in_prefill_chunks_and_decode(heads, dtype, every_decode):
    n_q, n_kv, head_dim, length = heads
    q, k, v = make_qkv(1, n_q, n_kv, length, head_dim, dtype)
    prefill = attention(q, k, v)  # reference construction: one prefill
    for name, bounds in constructions(length, every_decode).items():
        out = by_chunks(q, k, v, bounds)  # the same positions, built another way
        bad = differing_positions(out, prefill)  # compare, position by position
        assert not bad, (f"{name}: positions {bad} differ from prefill; max |diff| = "
                         f"{(out.double() - prefill.double()).abs().max().item()!r}")


# ---- fidelity: batch ---------------------------------------------------------------------------

# Batch sizes for attention, a subset of helpers.BATCH_SIZES: a sequence is its own program
# (batch is a grid axis, read by no arithmetic) and the interpreter pays per program (the
# 12 sizes summed to 356 programs a dtype), so a few sizes, odd and even, up to one past 32.
ATTENTION_BATCH_SIZES = (2, 3, 8, 17, 33)
assert set(ATTENTION_BATCH_SIZES) <= set(BATCH_SIZES)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_alone_equals_row_in_any_batch(dtype):
    # A 3-query chunk over 21 keys (one program per sequence), placed last among other sequences.
    for n, row, alone in probe_in_batches(attention, dtype, ATTENTION_BATCH_SIZES):
        assert_bitwise_equal(row, alone, f"probe as row {n - 1} of a batch of {n}")


# ---- negative controls -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_control_the_construction_check_catches_a_split_kv_twin(dtype):
    """Twin of the construction test: the same check on a deliberately shape-variant attention
    (split-KV count chosen from the query length) finds differing positions in every
    construction, on any CPU. (Stock SDPA's prefill/decode behaviour differs between CPUs:
    `kvfid kernels` reports it as a finding.)"""
    q, k, v = make_qkv(1, 3, 1, LENGTH, 64, dtype)
    prefill = attention_twin(q, k, v)
    for name, bounds in constructions(LENGTH).items():
        bad = differing_positions(by_chunks(q, k, v, bounds, attention_twin), prefill)
        assert bad, f"{name}: the twin was not caught"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_control_the_batch_check_catches_a_split_kv_twin(dtype):
    """Twin of the batch test: a split count chosen from the batch size is caught at every size."""
    for n, row, alone in probe_in_batches(attention_twin, dtype, ATTENTION_BATCH_SIZES):
        assert not bits_equal(row, alone), f"batch of {n}: the twin was not caught"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_twin_is_a_correct_attention(dtype):
    q, k, v = make_qkv(2, 4, 2, 37, 32, dtype)
    assert_close_to_ref(attention_twin(q[:, :, -5:], k, v),
                        attention_ref(q[:, :, -5:].double(), k.double(), v.double()), dtype)


# ---- contract ----------------------------------------------------------------------------------

def test_attention_rejects_bad_inputs():
    check_rejects_bad_inputs(attention, make_qkv)
