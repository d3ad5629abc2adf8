"""The faithful engine's attention over the paged cache (kvfid.kernels.attention.paged): every
request of a step at once, each position bit for bit what kvfid's native path computes for that
request alone, whatever else shares the step (decodes, prefills and chunks at lengths around the
tile and block edges); a control shows the paged reader really reads the blocks the table names.
The engine-level controls (stock vLLM differs where it does) are test_engine.py's and
test_load.py's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here; `make install-vllm`, then `make test-vllm`")

from kvfid.engines.kv import paged_layout  # noqa: E402
from kvfid.kernels.attention import native, native_tiles, paged  # noqa: E402

BLOCK, HEADS, GROUP, HEAD = 32, 3, 3, 64


def _step(dtype, requests, seed=0):
    """A paged cache holding each request's keys (written by vLLM's own writer at scattered
    blocks), the step's queries (the last q_len positions of each), and the dense tensors."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(seed)
    isa = "vec"
    blocks = sum(-(-length // BLOCK) for _, length in requests) + 3
    cache = torch.zeros(blocks, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
    k_cache, v_cache = cache.view(blocks, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    order = torch.randperm(blocks, generator=generator).tolist()
    table = torch.zeros(len(requests), max(-(-length // BLOCK) for _, length in requests), dtype=torch.int32)
    dense, queries = [], []
    for r, (q_len, length) in enumerate(requests):
        held = -(-length // BLOCK)
        table[r, :held] = torch.tensor([order.pop() for _ in range(held)])
        keys = torch.randn(length, HEADS, HEAD, generator=generator).to(dtype)
        values = torch.randn(length, HEADS, HEAD, generator=generator).to(dtype)
        slots = table[r].long()[torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK
        ops.cpu_attn_reshape_and_cache(keys, values, k_cache, v_cache, slots, isa, k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")
        query = torch.randn(q_len, HEADS * GROUP, HEAD, generator=generator).to(dtype)
        dense.append((query, keys, values))
        queries.append(query)
    starts = [0]
    for q_len, _ in requests:
        starts.append(starts[-1] + q_len)
    return cache, table, torch.cat(queries).view(starts[-1], -1), starts, dense, isa


def _metadata(starts, lengths, table):
    from types import SimpleNamespace

    return SimpleNamespace(query_start_loc=torch.tensor(starts, dtype=torch.int32),
                           seq_lens=torch.tensor(lengths, dtype=torch.int32), block_table=table)


def _native(query, keys, values, scale):
    out = native.attention(query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                           values.transpose(0, 1)[None], scale=scale)     # [1, Hq, Tq, D]
    return out[0].transpose(0, 1).reshape(query.shape[0], -1)


@pytest.mark.parametrize("dtype, gathered, alone", [(torch.bfloat16, False, False),
                                                    (torch.float32, False, False),
                                                    (torch.bfloat16, True, False),
                                                    (torch.bfloat16, False, True)])
def test_every_request_of_a_step_has_the_native_bits_alone(dtype, gathered, alone, monkeypatch):
    """`gathered`: the writer's layout read by its inverse permutation (how an AMX layout is read)
    instead of as a view; `alone`: query tiles never stacked (where the machine's probe fails)."""
    if alone:
        monkeypatch.setattr(native_tiles, "rows_keep_bits", lambda *args: False)
        monkeypatch.setattr(native_tiles, "_calls", native_tiles._calls.__wrapped__)
    where = paged_layout("vec", dtype, BLOCK, HEAD)
    layout = tuple(torch.argsort(w) for w in where) if gathered else paged.layouts(*where, BLOCK, HEAD)
    # decodes at several lengths (one past a key tile, one at a block edge), a prefill, a chunk
    requests = [(1, 1), (1, 65), (1, 200), (37, 37), (20, 150), (1, 64), (3, 97), (1, 33), (16, 300)]
    cache, table, query, starts, dense, isa = _step(dtype, requests)
    scale = HEAD ** -0.5
    out = torch.full((starts[-1], HEADS * GROUP * HEAD), float("nan"), dtype=dtype)
    paged.paged_attention(out, query, cache, layout, _metadata(starts, [n for _, n in requests], table),
                          HEADS * GROUP, scale)
    for r, (q, k, v) in enumerate(dense):
        alone = _native(q, k, v, scale)
        got = out[starts[r]:starts[r + 1]]
        assert torch.equal(got, alone), (r, requests[r], (got.float() - alone.float()).abs().max())
    # control: the reader reads the blocks the table names (two rows' blocks swapped: others' keys)
    swapped = table.clone()
    swapped[[2, 4]] = table[[4, 2]]
    out2 = torch.zeros_like(out)
    paged.paged_attention(out2, query, cache, layout, _metadata(starts, [n for _, n in requests], swapped),
                          HEADS * GROUP, scale)
    assert not torch.equal(out2[starts[4]:starts[5]], out[starts[4]:starts[5]])
