"""Visibility masks in the kernels (Triton, interpreted here, and native): correctness against
fp64, the bitwise claim (a query's bits depend on its visible keys alone: not on invisible keys'
values, nor on how many invisible segments there are or where its keys sit; prefill equals
decode), the negative control (key tiles at held indexes), and the refusals."""

from __future__ import annotations

import pytest
import torch
from dataclasses import replace

from helpers import (DTYPE_IDS, DTYPES, assert_bitwise_equal, assert_close_to_ref, bits_equal,
                     device, randn)

from kvfid.kernels.attention import kernel as triton_attention
from kvfid.kernels.attention import native
from kvfid.kernels.attention.config import AttentionConfig, config_for
from kvfid.kernels.attention.reference import attention_ref, segment_mask

# Small key tiles so a few dozen keys span several tiles (the interpreter's default is 128 keys).
SMALL = {"triton": {"config": AttentionConfig(block_n=16, max_tile_rows=64, num_warps=4,
                                              num_stages=1, use_dot=False)},
         "native": {"config": native.NativeConfig(tile_m=16, tile_n=16)}}
KERNELS = {"triton": triton_attention.attention, "native": native.attention}
ON = {"triton": device(), "native": torch.device("cpu")}  # the native path is the CPU's


def program(prompt: int, branches: list[int], merge: int, batch: int = 1):
    """A packed stage program: segment ids [B, T] (0 prompt, 1..N branches, N+1 merge) and who
    sees whom (a branch: the prompt and itself; the merge: everything)."""
    lens = [prompt, *branches, merge]
    ids = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])[None].expand(batch, -1)
    n = len(lens)
    sees = torch.eye(n, dtype=torch.bool)
    sees[:, 0] = True
    sees[-1] = True
    return ids, sees


def tree_mask(parents: list[int], prefix: int) -> torch.Tensor:
    """[1, T, T] bool: a prefix, then draft nodes that each see the prefix and their ancestors."""
    total = prefix + len(parents)
    mask = torch.tril(torch.ones(total, total, dtype=torch.bool))
    mask[prefix:, prefix:] = False
    for node, parent in enumerate(parents):
        row = prefix + node
        mask[row, prefix + node] = True
        if parent >= 0:
            mask[row, prefix:] |= mask[prefix + parent, prefix:]
    return mask[None]


def qkv(batch, length, dtype, seed=0, n_q=4, n_kv=2, dim=32, on="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(batch, h, length, dim, dtype=dtype, gen=gen, on=on)
                 for h in (n_q, n_kv, n_kv))


MASKS = {"packed": lambda: segment_mask(*program(11, [7, 9, 5], 6, batch=2)),
         "tree": lambda: tree_mask([-1, 0, 0, 1, 1, 2, -1, 6], prefix=20)}


# ---- correctness -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_visibility_matches_fp64_reference(kernel, mask, dtype):
    visibility = MASKS[mask]()
    q, k, v = qkv(visibility.shape[0], visibility.shape[-1], dtype, on=ON[kernel])
    ref = attention_ref(q.double(), k.double(), v.double(), visibility=visibility)  # reference
    out = KERNELS[kernel](q, k, v, visibility=visibility, **SMALL[kernel])  # kernel
    assert_close_to_ref(out, ref, dtype)  # compare


@pytest.mark.parametrize("kernel", KERNELS)
def test_visibility_with_softcap_and_sinks_matches_fp64_reference(kernel):
    visibility = MASKS["packed"]()
    q, k, v = qkv(2, visibility.shape[-1], torch.float32, on=ON[kernel])
    extra = dict(softcap=5.0, sinks=torch.linspace(-1.0, 2.0, 4))
    ref = attention_ref(q.double(), k.double(), v.double(), visibility=visibility, **extra)
    assert_close_to_ref(KERNELS[kernel](q, k, v, visibility=visibility, **extra), ref, torch.float32)


def test_control_the_reference_check_sees_the_mask():
    visibility = MASKS["packed"]()
    q, k, v = qkv(2, visibility.shape[-1], torch.float32)
    causal = attention_ref(q.double(), k.double(), v.double())
    with pytest.raises(AssertionError):
        assert_close_to_ref(native.attention(q, k, v, visibility=visibility), causal, torch.float32)


# ---- fidelity: a query's bits are those of its visible keys alone -----------------------------

def _alone(fn, q, k, v, visibility, b, i, **kw):
    """Query i of row b as a decode step of the causal kernel over the keys it sees, gathered."""
    keys = visibility[b, i].nonzero().flatten()
    return fn(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, keys], v[b:b + 1, :, keys], **kw)[0, :, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_query_has_the_causal_bits_of_its_visible_keys(kernel, dtype):
    visibility = MASKS["packed"]()
    q, k, v = qkv(2, visibility.shape[-1], dtype, on=ON[kernel])
    fn, kw = KERNELS[kernel], SMALL[kernel]
    out = fn(q, k, v, visibility=visibility, **kw)
    for b in range(2):
        for i in range(visibility.shape[-1]):
            assert_bitwise_equal(out[b, :, i], _alone(fn, q, k, v, visibility, b, i, **kw),
                                 f"{kernel} row {b} query {i}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_prefill_under_the_mask_equals_decode_steps(kernel):
    visibility = MASKS["tree"]()
    q, k, v = qkv(1, visibility.shape[-1], torch.bfloat16, on=ON[kernel])
    fn, kw = KERNELS[kernel], SMALL[kernel]
    prefill = fn(q, k, v, visibility=visibility, **kw)
    for i in range(visibility.shape[-1]):  # query i alone over the cache up to it
        step = fn(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1],
                  visibility=visibility[:, i:i + 1, :i + 1], **kw)
        assert_bitwise_equal(step[:, :, 0], prefill[:, :, i], f"{kernel} query {i}")


def _shifted(seed: int, on="cpu"):
    """The last branch and the merge of two programs: invisible branches 7 + 9 before the last
    branch, or 4 + 6 + 10 (other values, one more segment, the branch across a 16-key tile edge)."""
    ids_a, sees_a = program(11, [7, 9, 5], 6)
    ids_b, sees_b = program(11, [4, 6, 10, 5], 6)
    q, k, v = qkv(1, ids_b.shape[-1], torch.float32, seed=seed, on=on)
    a = [torch.cat([x[:, :, :11], x[:, :, 11:27] * 0.5 + 1.0, x[:, :, -11:]], 2) for x in (q, k, v)]
    return (a, segment_mask(ids_a, sees_a)), ((q, k, v), segment_mask(ids_b, sees_b))


@pytest.mark.parametrize("kernel", KERNELS)
def test_invisible_keys_and_segments_change_no_bit_of_a_branch(kernel):
    (qkv_a, mask_a), (qkv_b, mask_b) = _shifted(seed=1, on=ON[kernel])
    fn, kw = KERNELS[kernel], SMALL[kernel]
    out_a, out_b = fn(*qkv_a, visibility=mask_a, **kw), fn(*qkv_b, visibility=mask_b, **kw)
    # the last branch (5 queries) sees the prompt and itself in both
    assert_bitwise_equal(out_a[:, :, -11:-6], out_b[:, :, -11:-6], f"{kernel}: last branch")
    # control of the test itself: the merge sees the branches, which differ
    assert not bits_equal(out_a[:, :, -6:], out_b[:, :, -6:])


def held_tiles_twin(q, k, v, visibility, tile=16):
    """A correct attention under `visibility` whose key tiles sit at held indexes (what a kernel
    that only masks does): where a query's visible keys sit decides their tiles, so its bits."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))  # [B, Hq, Tk, D]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5
    s = s.masked_fill(~visibility[:, None], float("-inf"))  # [B, Hq, Tq, Tk]
    m = torch.full(s.shape[:-1], float("-inf"))
    l, acc = torch.zeros(s.shape[:-1]), torch.zeros(*s.shape[:-1], v.shape[-1])
    for start in range(0, s.shape[-1], tile):
        part = s[..., start:start + tile]
        m_new = torch.maximum(m, part.amax(-1))
        m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha, p = torch.exp(m - m_use), torch.exp(part - m_use[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v[:, :, start:start + tile]
        m = m_new
    return acc / l[..., None]


def test_control_key_tiles_at_held_indexes_are_caught():
    (qkv_a, mask_a), (qkv_b, mask_b) = _shifted(seed=1)
    out_a, out_b = held_tiles_twin(*qkv_a, mask_a), held_tiles_twin(*qkv_b, mask_b)
    ref = attention_ref(*(x.double() for x in qkv_a), visibility=mask_a)
    assert_close_to_ref(out_a, ref, torch.float32)  # correct ...
    assert not bits_equal(out_a[:, :, -11:-6], out_b[:, :, -11:-6])  # ... but caught


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", KERNELS)
def test_masks_the_kernels_cannot_serve_are_refused(kernel):
    fn = KERNELS[kernel]
    q, k, v = qkv(1, 6, torch.float32, on=ON[kernel])
    causal = torch.tril(torch.ones(1, 6, 6, dtype=torch.bool))
    for bad, match in ((torch.ones(1, 6, 6, dtype=torch.bool), "sees a later key"),
                       (causal[:, :5], r"must be \[B=1, Tq=6, Tk=6\]"),
                       (causal.float(), "must be bool")):
        with pytest.raises((ValueError, TypeError), match=match):
            fn(q, k, v, visibility=bad)
    for extra, match in (({"window": 3}, "sliding window"), ({"chunk": 4}, "chunk"),
                         ({"first_valid": torch.tensor([1])}, "left padding")):
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, visibility=causal, **extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_visibility_has_the_unsplit_causal_bits_of_its_visible_keys(dtype):
    """On a GPU (tl.dot, the arch's config) at SmolLM2's heads: correct, and each query's bits
    are the causal kernel's over its visible keys with the config's split path off."""
    visibility = segment_mask(*program(61, [70, 50, 64], 56)).cuda()
    q, k, v = qkv(1, visibility.shape[-1], dtype, n_q=9, n_kv=3, dim=64, on="cuda")
    out = triton_attention.attention(q, k, v, visibility=visibility)
    assert_close_to_ref(out, attention_ref(q.double(), k.double(), v.double(), visibility=visibility), dtype)
    unsplit = replace(config_for(q.device, dtype, 64), segment=0)
    for i in range(visibility.shape[-1]):
        assert_bitwise_equal(out[0, :, i], _alone(triton_attention.attention, q, k, v, visibility, 0, i,
                                                  config=unsplit), f"query {i}")
