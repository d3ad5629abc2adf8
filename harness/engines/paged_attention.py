"""The faithful engine's attention: kvfid's native tiling contract over vLLM's paged cache, every
request of a step at once, each position's bits those of kvfid.kernels.attention.native.

The native path computes one batch row at a time: per query tile of `tile_m` positions (aligned
to the row's own positions) it visits the key tiles of `tile_n` positions in order, with one
`bmm` of one fixed shape per model ([Hkv, G * tile_m, D] x [Hkv, D, tile_n]) and an fp32 online
softmax. Here every (request, query tile) of the step is a work item; items are computed in
groups of `slots` (padded with empty items), each group's tiles stacked in the batch dimension
([slots * Hkv, G * tile_m, D]), key tile j of every item in one round, read straight out of the
paged cache: the blocks each key tile covers are gathered from the cache by the request's block
table and read in vLLM's writer layout (kvfid.engines.kv: a view where the layout is the plain or
the transposed block, a gather by its inverse otherwise), fp32, absent positions zero. The plan
of a step (which rows and blocks each group reads, its masks) is made once for all its layers. No request's context is copied out whole, and the step is a few calls per round
instead of a few per request and tile.

The bits of a position stay the native path's:
- every item's slice of every tensor has the native shape and sits at an offset that is a
  multiple of its size, and every product is the native product per batch entry; whether the
  machine's BLAS gives a batch entry the same bits at another batch index and count is a
  property of the machine, so it is probed here once per shape (`slots_for`: the whole group
  computation, random data, each slot against the same item computed alone in a group of one);
  where it fails, groups of one item are used (the native shapes exactly);
- the element-wise ops whose vector body and scalar tail may round differently (exp, addcmul)
  on tensors the size of one item's softmax state ([Hkv, G * tile_m]) run per item, so each
  element sits where the native path puts it; the others are exact in IEEE arithmetic (max,
  subtraction, product, quotient, masking, the dtype conversion) or large tiles whose size is a
  multiple of every vector width;
- a key tile beyond an item's last is fully masked, which leaves the online softmax's state
  bit for bit (the native path relies on the same), so items of different lengths share rounds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvfid.kernels.attention.native import _FLOOR, DEFAULT_CONFIG, NativeConfig
from kvfid.kernels.invariant.mode import stock_ops

SLOTS = 8


@functools.lru_cache(maxsize=None)
def _layouts(isa: str, dtype: torch.dtype, block: int, head: int) -> tuple:
    """Per part (k, v): "plain" ([block, head] as stored), "transposed" ([head, block]), or the
    memory offset in a block of each element (position * head + dim), to gather by."""
    from kvfid.engines.kv import paged_layout

    index = torch.arange(block * head)
    out = []
    for where in paged_layout(isa, dtype, block, head):
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


def _group(q: torch.Tensor, k_tiles, v_tiles, keeps, heads: int, slots: int) -> torch.Tensor:
    """One group: q [slots * Hkv, G*tm, D] fp32 (scaled), per round j the key tiles
    [slots * Hkv, tn, D], value tiles [slots * Hkv, tn, Dv] and keep [slots, 1, G*tm, tn] ->
    [slots * Hkv, G*tm, Dv] (the native path's online softmax, round by round)."""
    rows = q.shape[1]
    m = torch.full((slots * heads, rows), _FLOOR)
    l = torch.zeros(slots * heads, rows)
    acc = torch.zeros(slots * heads, rows, v_tiles[0].shape[-1]) if v_tiles else None
    alpha, summed = torch.empty_like(m), torch.empty_like(l)
    for k, v, keep in zip(k_tiles, v_tiles, keeps):
        s = torch.bmm(q, k.transpose(1, 2))                                     # [S*Hkv, G*tm, tn]
        s = s.view(slots, heads, rows, -1).masked_fill(~keep, float("-inf")).view(slots * heads, rows, -1)
        m_new = torch.maximum(m, s.amax(-1))
        gap = m - m_new
        p = torch.exp(s - m_new[..., None])
        total = p.sum(-1)
        for i in range(slots):             # per item: where the native path puts each element
            at = slice(i * heads, (i + 1) * heads)
            torch.exp(gap[at], out=alpha[at])
            torch.addcmul(total[at], l[at], alpha[at], out=summed[at])
        l, summed = summed, l
        acc = torch.baddbmm(acc * alpha[..., None], p, v)                      # [S*Hkv, G*tm, Dv]
        m = m_new
    return acc / l[..., None]


@functools.lru_cache(maxsize=None)
def slots_for(heads: int, group: int, head: int, tm: int, tn: int, threads: int) -> int:
    """SLOTS where a group's slot has the bits of the same item computed alone on this machine
    (random data, three rounds, a masked diagonal and a fully masked round), else 1."""
    generator = torch.Generator().manual_seed(0)
    rows, rounds = group * tm, 3
    q = torch.randn(SLOTS * heads, rows, head, generator=generator)
    ks = [torch.randn(SLOTS * heads, tn, head, generator=generator) for _ in range(rounds)]
    vs = [torch.randn(SLOTS * heads, tn, head, generator=generator) for _ in range(rounds)]
    position = torch.arange(tm).repeat(group)[:, None]
    keeps = []
    for j in range(rounds):
        ends = torch.tensor([(i * 37) % (rounds * tn) + 1 for i in range(SLOTS)])[:, None, None, None]
        keeps.append((j * tn + torch.arange(tn) <= position + j * tn // 2) & (j * tn + torch.arange(tn) < ends))
    with stock_ops():
        together = _group(q, ks, vs, keeps, heads, SLOTS)
        for i in range(SLOTS):
            at = slice(i * heads, (i + 1) * heads)
            alone = _group(q[at], [k[at] for k in ks], [v[at] for v in vs], [keep[i:i + 1] for keep in keeps],
                           heads, 1)
            if not torch.equal(alone, together[at]):
                return 1
    return SLOTS


@dataclass(frozen=True)
class Group:
    """One group of a step's plan: which query rows and key blocks its slots read, its masks."""

    queries: torch.Tensor          # [S * tm] query row per slot position (T: the zero row)
    ids: torch.Tensor              # [S, R, tn // block] the blocks of key tile j of each slot
    valid: torch.Tensor            # [R, S, 1, tn, 1] key positions the request holds
    keeps: torch.Tensor            # [R, S, 1, G * tm, tn] keys each query may see
    rows: torch.Tensor             # the output rows written, and which slot positions they take
    taken: torch.Tensor


def plan(starts: list[int], lengths: list[int], table: list[list[int]], tm: int, tn: int,
         block: int, group: int, slots: int) -> list[Group]:
    """The step's work (the same for every layer): items (request, query tile) by their number
    of key tiles, in groups of `slots` padded with empty items."""
    total, per_tile = starts[len(lengths)], tn // block
    items = []
    for r, length in enumerate(lengths):
        q_len = starts[r + 1] - starts[r]
        if q_len:
            for qt in range((length - q_len) // tm, (length - 1) // tm + 1):
                items.append((r, qt, (min((qt + 1) * tm, length) - 1) // tn + 1))
    items.sort(key=lambda item: item[2])
    offsets = torch.arange(tm)
    out = []
    for first in range(0, len(items), slots):
        chunk = items[first:first + slots] + [(None, 0, 0)] * (slots - len(items[first:first + slots]))
        rounds = max(n for _, _, n in chunk)
        queries = torch.full((slots, tm), total, dtype=torch.long)
        ids = torch.zeros(slots, rounds, per_tile, dtype=torch.long)
        ends = torch.zeros(slots, dtype=torch.long)
        q_pos = torch.full((slots,), -1, dtype=torch.long)
        for i, (r, qt, n) in enumerate(chunk):
            if r is None:
                continue
            # position qt * tm + t of request r is its query row starts[r] + position - first query
            row = starts[r] + qt * tm + offsets - (lengths[r] - (starts[r + 1] - starts[r]))
            queries[i] = torch.where((row >= starts[r]) & (row < starts[r + 1]), row, total)
            held = table[r][:-(-lengths[r] // block)]
            wanted = [held[b] if b < len(held) else 0 for b in range(n * per_tile)]
            ids[i, :n] = torch.tensor(wanted, dtype=torch.long).view(n, per_tile)
            ends[i], q_pos[i] = lengths[r], qt * tm
        key_pos = torch.arange(rounds * tn).view(rounds, 1, 1, tn)                       # [R, 1, 1, tn]
        own = (q_pos[:, None] + offsets.repeat(group)[None])[None, :, :, None]          # [1, S, G*tm, 1]
        keeps = (key_pos <= own) & (key_pos < ends[None, :, None, None])                 # [R, S, G*tm, tn]
        valid = (key_pos < ends[None, :, None, None])[:, :, :1, :, None]                 # [R, S, 1, tn, 1]
        flat = queries.view(-1)
        taken = flat < total
        out.append(Group(flat, ids, valid, keeps[:, :, None], flat[taken], taken))
    return out


_PLAN: dict = {}        # the last step's metadata, what it said, its plan (every layer reads one step)


def step_plan(metadata, tm: int, tn: int, block: int, group: int, slots: int) -> list[Group]:
    """The plan of the step `metadata` describes, made once for all its layers (made again if
    the metadata object or what it says changed)."""
    said = (metadata.query_start_loc, metadata.seq_lens, metadata.block_table)
    last = _PLAN.get("said")
    if (_PLAN.get("metadata") is not metadata or _PLAN.get("shape") != (tm, tn, block, group, slots)
            or not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(said, last))):
        starts = metadata.query_start_loc.tolist()
        lengths = metadata.seq_lens.tolist()[:len(starts) - 1]
        _PLAN.update(metadata=metadata, said=tuple(t.clone() for t in said),
                     shape=(tm, tn, block, group, slots),
                     plan=plan(starts, lengths, metadata.block_table.tolist(), tm, tn, block, group, slots))
    return _PLAN["plan"]


def paged_attention(output: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, isa: str,
                    metadata, num_heads: int, scale: float, config: NativeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Causal attention of every request of a step over the paged cache, into `output`
    [T, Hq * Dv]: request r's queries are query[starts[r]:starts[r+1]] ([T, Hq * D]), the last
    positions of its `seq_lens[r]` keys, held in the blocks `block_table[r]` (vLLM's CPU
    attention metadata: query_start_loc, seq_lens, block_table)."""
    blocks, heads, block, width = kv_cache.shape
    head, tm, tn = width // 2, config.tile_m, config.tile_n
    group = num_heads // heads
    if tn % block:
        raise NotImplementedError(f"a key tile of {tn} positions over KV blocks of {block}")
    per_tile = tn // block
    slots = slots_for(heads, group, head, tm, tn, torch.get_num_threads())
    groups = step_plan(metadata, tm, tn, block, group, slots)
    layouts = _layouts(isa, kv_cache.dtype, block, head)
    total = int(metadata.query_start_loc[-1])
    scaled = query[:total].view(total, num_heads, head)
    scaled = torch.cat([scaled * scale if scale != 1.0 else scaled, scaled.new_zeros(1, num_heads, head)])
    memory = kv_cache.view(blocks, heads, 2, block * head)
    written = output.view(output.shape[0], -1)
    with stock_ops():
        for g in groups:
            rounds = g.ids.shape[1]
            q = scaled[g.queries].view(slots, tm, heads, group, head).permute(0, 2, 3, 1, 4)
            q = q.reshape(slots * heads, group * tm, head).float()               # [S*Hkv, G*tm, D]
            part = memory[g.ids]                                     # [S, R, nb, Hkv, 2, block*D]
            tiles = []
            for which, layout in enumerate(layouts):       # fp32, absent positions zero
                stored = _positions(part[..., which, :], layout, block, head)   # [S, R, nb, Hkv, block, D]
                tile = torch.empty(rounds, slots, heads, per_tile, block, head)
                tile.copy_(stored.permute(1, 0, 3, 2, 4, 5))
                tile = tile.view(rounds, slots, heads, tn, head).masked_fill_(~g.valid, 0.0)
                tiles.append(tile.view(rounds, slots * heads, tn, head))
            done = _group(q, tiles[0].unbind(0), tiles[1].unbind(0), g.keeps.unbind(0), heads, slots)
            done = done.view(slots, heads, group, tm, -1).permute(0, 3, 1, 2, 4).reshape(slots * tm, -1)
            written[g.rows] = done[g.taken].to(output.dtype)
    return output
