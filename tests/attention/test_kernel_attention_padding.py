"""kvfid.kernels.attention.kernel with left padding: correctness, a row's bits independent of its padding and
its neighbours in prefill, chunks and decode, pad keys never read, and the padding-variant twin.

The probe is one sequence of PROBE_LEN positions. In a batch of n it sits at a seeded row among
n - 1 neighbours of random lengths; one neighbour is WIDTH long, so every batch is WIDTH wide and
the probe is left-padded by WIDTH - PROBE_LEN (the others are at most SHORT long: interpreter time). That padding makes the probe's keys straddle a key
tile boundary in padded positions (not in its own), which a kernel whose tiles follow padded
positions cannot hide: the twin (`align_own=False`) must fail the same check.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import DTYPE_IDS, DTYPES, assert_close_to_ref, bits_equal, device, max_abs_diff, randn

from kvfid.kernels.attention.kernel import attention_into, attention_ref, config_for

PROBE_LEN = 24  # own positions of the probe: more than one query tile (16)
WIDTH = 140  # batch width: the probe's padding (116) puts its keys across a 128- or 64-key tile edge
for _dtype in DTYPES:   # the probe's keys cross a key-tile edge in every dtype's config
    _block_n = config_for(device(), _dtype).block_n
    assert (WIDTH - PROBE_LEN) // _block_n != (WIDTH - 1) // _block_n
HQ, HKV, HEAD_DIM = 2, 1, 16
# Batch sizes (a row's bits cannot depend on the grid's batch axis; the sizes vary where the probe
# sits and among which neighbours). The seeded rows (`padded_batch`): n=2 puts the probe first,
# n=3 last, n=5 in the middle among 4 neighbours of 17-140 positions, n=16 at row 7 of 16.
BATCH_SIZES = (2, 3, 5, 16)
FEW_BATCH_SIZES = (3, 16)  # for bf16 and fp16 (last row; among 15); interpreter time
SHORT = 48

# Chunk bounds over the padded batch: a prefill; and a prompt chunk, 7-token chunks (one starts
# among the probe's pad positions, one holds its first position, 116, one crosses its query-tile
# edge, own position 16 = padded 132), a 3-token chunk, then 2 decode steps (its last positions).
SCHEDULES = {"prefill": [0, WIDTH],
             "chunks-then-decode": [0, 107, 114, 121, 128, 135, 138, 139, WIDTH]}


def probe_qkv(dtype):
    """q [1, Hq, L, D], k and v [1, Hkv, L, D] of the probe alone."""
    gen = torch.Generator().manual_seed(0)
    return tuple(randn(1, h, PROBE_LEN, HEAD_DIM, dtype=dtype, gen=gen) for h in (HQ, HKV, HKV))


def padded_batch(probe, n: int, pad_value: float | None = None):
    """The probe left-padded at a seeded row of a batch of n: (q, k, v [n, H, WIDTH, D],
    first_valid [n], probe row). Pad positions hold random values (or `pad_value`)."""
    rng, gen = random.Random(n), torch.Generator().manual_seed(n)
    lengths = [WIDTH] + [rng.randint(1, SHORT) for _ in range(n - 2)]
    row = rng.randrange(n)
    lengths.insert(row, PROBE_LEN)
    dtype = probe[0].dtype
    batch = [randn(n, h, WIDTH, HEAD_DIM, dtype=dtype, gen=gen) for h in (HQ, HKV, HKV)]
    pad = WIDTH - PROBE_LEN
    for t, p in zip(batch, probe):
        t[row, :, pad:] = p[0]
        if pad_value is not None:
            t[row, :, :pad] = pad_value
    first_valid = torch.tensor([WIDTH - n for n in lengths])
    return (*batch, first_valid, row)


def by_schedule(q, k, v, first_valid, bounds, align_own=True):
    """Outputs for all positions, chunk by chunk over a growing cache (chunk i: bounds[i]:bounds[i+1])."""
    outs = []
    for s, e in zip(bounds, bounds[1:]):
        out = torch.zeros_like(q[:, :, s:e])
        outs.append(attention_into(out, q[:, :, s:e], k[:, :, :e], v[:, :, :e], None, first_valid,
                                   align_own=align_own))
    return torch.cat(outs, dim=2)  # [B, Hq, WIDTH, D]


def probe_failures(dtype, sizes=BATCH_SIZES, align_own=True, pad_value=None, first=False) -> list[str]:
    """Every (batch size, schedule) whose probe positions differ in bits from the probe alone
    (only the first one if `first`)."""
    probe = probe_qkv(dtype)
    alone = attention_into(torch.empty_like(probe[0]), *probe)  # [1, Hq, L, D]
    failures = []
    for n in sizes:
        q, k, v, first_valid, row = padded_batch(probe, n, pad_value)
        for name, bounds in SCHEDULES.items():
            out = by_schedule(q, k, v, first_valid, bounds, align_own)[row:row + 1, :, WIDTH - PROBE_LEN:]
            if not bits_equal(out, alone):
                failures.append(f"n={n} {name}: max |diff| {max_abs_diff(out, alone)!r}")
                if first:
                    return failures
    return failures


# ---- correctness -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_padded_batch_matches_fp64_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(3, h, 37, 32, dtype=dtype, gen=gen) for h in (4, 2, 2))
    first_valid = torch.tensor([0, 5, 30])
    for q_len in (37, 9, 1):  # prefill, a chunk that starts inside row 2's padding, decode
        ref = attention_ref(q[:, :, -q_len:].double(), k.double(), v.double(), first_valid=first_valid)
        out = attention_into(torch.zeros_like(q[:, :, -q_len:]), q[:, :, -q_len:], k, v, None, first_valid)
        assert_close_to_ref(out, ref, dtype)


# ---- fidelity: padding and neighbours do not change a row --------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_alone_equals_row_padded_among_any_neighbours(dtype):
    failures = probe_failures(dtype, BATCH_SIZES if dtype == torch.float32 else FEW_BATCH_SIZES)
    assert not failures, "probe differs from alone: " + "; ".join(failures)


def test_pad_keys_are_never_read():
    """NaN in every pad position of the probe: any pad key entering the softmax (even with weight
    0) would make its output NaN."""
    failures = probe_failures(torch.float32, (5,), pad_value=float("nan"))
    assert not failures, "; ".join(failures)


# ---- negative control --------------------------------------------------------------------------

def test_control_tiles_on_padded_positions_are_caught():
    """Twin of the fidelity test: the same kernel with tiles aligned to padded positions (pad keys
    masked, so it is correct) gives the probe other bits, and the same check says so."""
    failures = probe_failures(torch.float32, align_own=False, first=True)
    assert failures, "the padding-variant twin passed the padding-invariance check"


def test_first_valid_is_checked():
    q = torch.zeros(2, 1, 4, 16, device=device())
    with pytest.raises(ValueError, match="first_valid"):
        attention_into(torch.zeros_like(q), q, q, q, None, torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="first_valid"):
        attention_into(torch.zeros_like(q), q, q, q, None, torch.tensor([0]))
