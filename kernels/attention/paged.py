"""kvfid's attention contract over a paged KV cache (vLLM-CPU's layout): the faithful vLLM
engine's attention. Every request of a step is computed by the native path's tile math
(kvfid.kernels.attention.native_tiles.run_tiles), so each position's bits are those
kvfid.kernels.attention.native computes for that request alone, whatever else shares the step.

A layer's cache is [blocks, Hkv, block, 2 * D]: the first half of a block's memory holds its
keys, the second its values, each in the layout the engine's writer chose. The layout is not
known here: the engine side measures it (kvfid.engines.kv.paged_layout writes index-coded keys
with the engine's own writer) and hands `layouts(...)` of it in, so this module never imports
the engine. A request's keys are gathered by its block table from the blocks that cover the key
range its tiles read, read in the writer's layout (a view where the layout is the plain or the
transposed block, a gather by its inverse otherwise) into fp32, absent positions zero. Key tiles
and spans are fixed by absolute positions, never by blocks, so every block size gives the same
bits. The plan of a step (each request's tiles and blocks) is made once for all its layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfid.kernels.attention.native_tiles import DEFAULT_CONFIG, NativeConfig, Pattern, Plan, plan, query_scale, run_tiles
from kvfid.kernels.invariant.mode import stock_ops


def layouts(where_k: torch.Tensor, where_v: torch.Tensor, block: int, head: int) -> tuple:
    """Per part (k, v), from the writer's layout (`where[m]`: the index position * head + dim of
    the element stored at memory offset m of a block): "plain" ([block, head] as stored),
    "transposed" ([head, block]), or the memory offset of each element, to gather by."""
    index = torch.arange(block * head)
    out = []
    for where in (where_k, where_v):
        if torch.equal(where, index):
            out.append("plain")
        elif torch.equal(where, index.view(block, head).t().reshape(-1)):
            out.append("transposed")
        else:
            out.append(torch.argsort(where))
    return tuple(out)


def _positions(part: torch.Tensor, layout, block: int, head: int) -> torch.Tensor:
    """Blocks of one part [..., block * head] in the writer's layout -> [..., block, head] (a view
    where the layout is plain or transposed)."""
    if isinstance(layout, str):
        shaped = part.unflatten(-1, (block, head) if layout == "plain" else (head, block))
        return shaped if layout == "plain" else shaped.transpose(-1, -2)
    return part[..., layout].unflatten(-1, (block, head))


@dataclass(frozen=True)
class Request:
    """One request of a step: its query rows, its tiles, the blocks covering the keys they read."""

    rows: slice            # its rows of the step's query and output
    length: int            # keys it holds (its last query is at position length - 1)
    work: Plan
    ids: torch.Tensor      # the blocks holding positions first_block * block ...
    first_block: int
    held_blocks: int       # blocks the key buffer spans (those gathered, then zeros)


def step_plan(starts: list[int], lengths: list[int], table: list[list[int]], block: int,
              config: NativeConfig) -> list[Request]:
    """Each request's work: the query tiles of its last starts[r+1] - starts[r] positions."""
    out = []
    for r, length in enumerate(lengths):
        q_len = starts[r + 1] - starts[r]
        if not q_len:
            continue
        work = plan(length - q_len, length, Pattern(), config)
        first_block = work.start // block
        filled = -(-min(work.stop, length) // block)          # blocks holding keys it reads
        spans = -(-work.stop // block) - first_block
        ids = torch.tensor(table[r][first_block:filled], dtype=torch.long)
        out.append(Request(slice(starts[r], starts[r + 1]), length, work, ids, first_block, spans))
    return out


_STEP: dict = {}        # the last step's metadata, what it said, its plan (every layer reads one step)


def planned(metadata, block: int, config: NativeConfig) -> list[Request]:
    """The plan of the step `metadata` describes (vLLM's CPU attention metadata: query_start_loc,
    seq_lens, block_table), made once for all its layers (again if the metadata object or what
    it says changed)."""
    said = (metadata.query_start_loc, metadata.seq_lens, metadata.block_table)
    last = _STEP.get("said")
    if (_STEP.get("metadata") is not metadata or _STEP.get("shape") != (block, config)
            or not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(said, last))):
        starts = metadata.query_start_loc.tolist()
        lengths = metadata.seq_lens.tolist()[:len(starts) - 1]
        _STEP.update(metadata=metadata, said=tuple(t.clone() for t in said), shape=(block, config),
                     plan=step_plan(starts, lengths, metadata.block_table.tolist(), block, config))
    return _STEP["plan"]


def paged_attention(output: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, layout: tuple,
                    metadata, num_heads: int, scale: float, config: NativeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Causal attention of every request of a step over the paged cache, into `output`
    [T, Hq * D]: request r's queries are query[starts[r]:starts[r+1]] ([T, Hq * D]), the last
    positions of its `seq_lens[r]` keys, held in the blocks `block_table[r]`; `layout` is
    `layouts(...)` of the cache's writer."""
    blocks, heads, block, width = kv_cache.shape
    head = width // 2
    group = num_heads // heads
    memory = kv_cache.view(blocks, heads, 2, block * head)
    queries = query.view(query.shape[0], heads, group, head)
    written = output.view(output.shape[0], heads, group, head)
    factor = query_scale(scale, None)
    with stock_ops():
        for request in planned(metadata, block, config):
            stored = memory[request.ids]                                  # [nb, Hkv, 2, block * D]
            keys, values = (_keys(stored[:, :, which], part, request, block, head)
                            for which, part in enumerate(layout))
            run_tiles(queries[request.rows].transpose(0, 1), factor, keys, values, request.work, config,
                      written[request.rows].transpose(0, 1))
    return output


def _keys(stored: torch.Tensor, layout, request: Request, block: int, head: int) -> torch.Tensor:
    """One part of a request's blocks [nb, Hkv, block * D] -> fp32 [Hkv, stop - start, D] from own
    position work.start, absent positions zero."""
    shaped = _positions(stored, layout, block, head)                      # [nb, Hkv, block, D]
    nb = shaped.shape[0]
    buffer = torch.empty(shaped.shape[1], request.held_blocks, block, head)
    buffer[:, :nb] = shaped.transpose(0, 1)
    buffer = buffer.view(shaped.shape[1], -1, head)                      # [Hkv, positions, D]
    origin = request.first_block * block
    if request.length - origin < buffer.shape[1]:
        buffer[:, request.length - origin:] = 0.0
    return buffer[:, request.work.start - origin:request.work.stop - origin]
