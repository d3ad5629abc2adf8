"""kvfid.kernels.attention.paged without an engine: a step of requests (decodes, prefills, chunks
around tile, span and block edges) over a paged cache whose blocks are laid out plainly,
transposed, or by any permutation of a block (an engine's writer chooses), at every block size:
each request's positions have, bit for bit, what the native path computes for it alone. A control
shows the reader reads the blocks the table names. With vLLM's own writer:
tests/engines/with_vllm/test_paged_attention.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import assert_bitwise_equal, randn
from test_kernel_attention_native_tiles import refuse_every_call_but_a_tile

from kvfid.kernels.attention import native, paged

HEADS, GROUP, HEAD = 2, 3, 32
# (queries, keys held): decodes one past a key tile, at a block edge and past a span; a prefill;
# chunks; a long prefill chunk across a span edge
REQUESTS = [(1, 1), (1, 65), (1, 200), (37, 37), (20, 150), (1, 64), (3, 97), (1, 33), (16, 300),
            (70, 600), (1, 513)]


def _where(kind: str, block: int, gen: torch.Generator) -> torch.Tensor:
    """A writer's layout: where[m] = the element (position * HEAD + dim) stored at offset m."""
    index = torch.arange(block * HEAD)
    if kind == "plain":
        return index
    if kind == "transposed":
        return index.view(block, HEAD).t().reshape(-1)
    return torch.randperm(block * HEAD, generator=gen)


def _step(dtype, block: int, kind: str, requests=REQUESTS):
    """A paged cache holding each request's keys at scattered blocks in layout `kind`, the step's
    queries (the last q_len positions of each), the dense tensors, the layout and the metadata."""
    gen = torch.Generator().manual_seed(block)
    wheres = (_where(kind, block, gen), _where(kind, block, gen))
    held = [-(-length // block) for _, length in requests]
    blocks = sum(held) + 3
    memory = torch.zeros(blocks, HEADS, 2, block * HEAD, dtype=dtype)
    order = torch.randperm(blocks, generator=gen).tolist()
    table = torch.zeros(len(requests), max(held), dtype=torch.int32)
    dense, starts = [], [0]
    for r, (q_len, length) in enumerate(requests):
        table[r, :held[r]] = torch.tensor([order.pop() for _ in range(held[r])])
        q = randn(q_len, HEADS * GROUP, HEAD, dtype=dtype, gen=gen, on="cpu")
        kv = [randn(length, HEADS, HEAD, dtype=dtype, gen=gen, on="cpu") for _ in range(2)]
        for part, (x, where) in enumerate(zip(kv, wheres)):
            padded = torch.cat([x, x.new_zeros(held[r] * block - length, HEADS, HEAD)])
            flat = padded.view(held[r], block, HEADS, HEAD).permute(0, 2, 1, 3).reshape(held[r], HEADS, -1)
            memory[table[r, :held[r]].long(), :, part] = flat[..., where]
        dense.append((q, *kv))
        starts.append(starts[-1] + q_len)
    cache = memory.view(blocks, HEADS, block, 2 * HEAD)      # the engine's [blocks, Hkv, block, 2 * D]
    query = torch.cat([q for q, _, _ in dense]).view(starts[-1], -1)
    metadata = SimpleNamespace(query_start_loc=torch.tensor(starts, dtype=torch.int32),
                               seq_lens=torch.tensor([n for _, n in requests], dtype=torch.int32),
                               block_table=table)
    return cache, query, starts, dense, paged.layouts(*wheres, block, HEAD), metadata


def _alone(q, k, v, scale):
    """The native path on one request alone: [Tq, Hq * D]."""
    out = native.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                           scale=scale)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("block", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype, kind", [(torch.bfloat16, "plain"), (torch.bfloat16, "transposed"),
                                         (torch.float32, "shuffled")])
def test_every_request_has_the_native_bits_alone_at_every_block_size(block, dtype, kind):
    cache, query, starts, dense, layout, metadata = _step(dtype, block, kind)
    scale = HEAD ** -0.5
    out = torch.full((starts[-1], HEADS * GROUP * HEAD), float("nan"), dtype=dtype)
    paged.paged_attention(out, query, cache, layout, metadata, HEADS * GROUP, scale)
    for r, (q, k, v) in enumerate(dense):
        assert_bitwise_equal(out[starts[r]:starts[r + 1]], _alone(q, k, v, scale),
                             f"request {r} {REQUESTS[r]} at block {block}, {kind}")
    # control: the reader reads the blocks the table names (two rows' blocks swapped)
    swapped = metadata.block_table.clone()
    swapped[[2, 4]] = metadata.block_table[[4, 2]]
    other = torch.zeros_like(out)
    paged.paged_attention(other, query, cache, layout, SimpleNamespace(
        query_start_loc=metadata.query_start_loc, seq_lens=metadata.seq_lens, block_table=swapped),
        HEADS * GROUP, scale)
    assert not torch.equal(other[starts[4]:starts[5]], out[starts[4]:starts[5]])


def test_decode_steps_ending_in_one_key_tile_are_stacked_and_give_their_bits_either_way(monkeypatch):
    """The step's decodes at 1, 33 and 64 keys end in the first key tile: one stack (the test above
    holds their bits to native alone); refused by the probe, one by one, the same bits."""
    cache, query, starts, dense, layout, metadata = _step(torch.bfloat16, 32, "plain")
    step = paged.step_plan(starts, metadata.seq_lens.tolist(), metadata.block_table.tolist(), 32,
                           paged.DEFAULT_CONFIG)
    assert [s.positions for s in step.stacks] == [(0, 63, 32)]      # in the step's order
    stacked = torch.zeros(starts[-1], HEADS * GROUP * HEAD, dtype=torch.bfloat16)
    paged.paged_attention(stacked, query, cache, layout, metadata, HEADS * GROUP, 0.2)
    monkeypatch.setattr(paged, "run_stacked", lambda *args: None)
    alone = torch.zeros_like(stacked)
    paged.paged_attention(alone, query, cache, layout, metadata, HEADS * GROUP, 0.2)
    assert_bitwise_equal(alone, stacked, "decode steps one by one vs stacked")


def test_tiles_computed_one_by_one_give_the_same_bits(monkeypatch):
    """Where the machine's probe refuses every call but a whole tile, tile by tile: the same bits."""
    cache, query, starts, dense, layout, metadata = _step(torch.bfloat16, 32, "plain")
    stacked = torch.zeros(starts[-1], HEADS * GROUP * HEAD, dtype=torch.bfloat16)
    paged.paged_attention(stacked, query, cache, layout, metadata, HEADS * GROUP, 0.2)
    refuse_every_call_but_a_tile(monkeypatch)
    one_by_one = torch.zeros_like(stacked)
    paged.paged_attention(one_by_one, query, cache, layout, metadata, HEADS * GROUP, 0.2)
    assert_bitwise_equal(one_by_one, stacked, "tiles one by one vs stacked")
