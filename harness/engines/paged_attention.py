"""The faithful engine's attention: kvfid's native tiling contract over vLLM's paged cache, every
request of a step at once, each position's bits those of kvfid.kernels.attention.native.

The native path computes one batch row at a time: per query tile of `tile_m` positions (aligned
to the row's own positions) it visits the key tiles of `tile_n` positions in order, with one
`bmm` of one fixed shape per model ([Hkv, G * tile_m, D] x [Hkv, D, tile_n]) and an fp32 online
softmax. Here every (request, query tile) of the step is a work item; items are computed in
groups of `slots` (padded with empty items), each group's tiles stacked in the batch dimension
([slots * Hkv, G * tile_m, D]), key tile j of every item in one round, read straight out of the
paged cache: the blocks each key tile covers are gathered from the cache by the request's block
table and unpacked with the inverse of vLLM's writer layout (kvfid.engines.kv), fp32, absent
positions zero. No request's context is copied out whole, and the step is a few calls per round
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

import torch

from kvfid.kernels.attention.native import _FLOOR, DEFAULT_CONFIG, NativeConfig
from kvfid.kernels.invariant.mode import stock_ops

SLOTS = 8


@functools.lru_cache(maxsize=None)
def _inverse(isa: str, dtype: torch.dtype, block: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per part (k, v): the memory offset in a block of each element (position * head + dim)."""
    from kvfid.engines.kv import paged_layout

    return tuple(torch.argsort(where) for where in paged_layout(isa, dtype, block, head))


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


def paged_attention(output: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, isa: str,
                    starts: list[int], lengths: list[int], block_table: torch.Tensor, num_heads: int,
                    scale: float, config: NativeConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Causal attention of every request of a step over the paged cache, into `output`
    [T, Hq * Dv]: request r's queries are query[starts[r]:starts[r+1]] ([T, Hq * D]), the last
    positions of its `lengths[r]` keys, held in the blocks `block_table[r]`."""
    blocks, heads, block, width = kv_cache.shape
    head, tm, tn = width // 2, config.tile_m, config.tile_n
    group = num_heads // heads
    if tn % block:
        raise NotImplementedError(f"a key tile of {tn} positions over KV blocks of {block}")
    per_tile = tn // block
    inv_k, inv_v = _inverse(isa, kv_cache.dtype, block, head)
    lengths = list(lengths)[:len(starts) - 1]
    total = starts[len(lengths)]
    scaled = query[:total].view(total, num_heads, head)
    scaled = torch.cat([scaled * scale if scale != 1.0 else scaled, scaled.new_zeros(1, num_heads, head)])
    items = []                                # (request, query tile, key tiles)
    for r, length in enumerate(lengths):
        q_len = starts[r + 1] - starts[r]
        if q_len:
            for qt in range((length - q_len) // tm, (length - 1) // tm + 1):
                items.append((r, qt, (min((qt + 1) * tm, length) - 1) // tn + 1))
    items.sort(key=lambda item: item[2])
    slots = slots_for(heads, group, head, tm, tn, torch.get_num_threads())
    memory = kv_cache.view(blocks, heads, 2, block * head)
    table = block_table.tolist()
    offsets = torch.arange(tm)
    written = output.view(output.shape[0], -1)
    with stock_ops():
        for first in range(0, len(items), slots):
            chunk = items[first:first + slots]
            chunk += [(None, 0, 0)] * (slots - len(chunk))
            # the queries: position qt * tm + i of request r is query row starts[r] + position -
            # (lengths[r] - q_len); outside the request's queries, the zero row
            index = torch.full((slots, tm), total, dtype=torch.long)
            for i, (r, qt, _) in enumerate(chunk):
                if r is not None:
                    position = qt * tm + offsets
                    row = starts[r] + position - (lengths[r] - (starts[r + 1] - starts[r]))
                    index[i] = torch.where((row >= starts[r]) & (row < starts[r + 1]), row, total)
            q = scaled[index].view(slots, tm, heads, group, head).permute(0, 2, 3, 1, 4)
            q = q.reshape(slots * heads, group * tm, head).float()          # [S*Hkv, G*tm, D]
            k_tiles, v_tiles, keeps = [], [], []
            for j in range(max(n for _, _, n in chunk)):
                ids = torch.zeros(slots, per_tile, dtype=torch.long)
                ends = torch.zeros(slots, 1, dtype=torch.long)
                for i, (r, qt, n) in enumerate(chunk):
                    if r is not None and j < n:
                        held = -(-lengths[r] // block)
                        wanted = range(j * per_tile, (j + 1) * per_tile)
                        ids[i] = torch.tensor([table[r][b] if b < held else 0 for b in wanted])
                        ends[i] = lengths[r]
                key_pos = j * tn + torch.arange(tn)                                  # [tn]
                valid = (key_pos[None] < ends)[:, None, :, None]                     # [S, 1, tn, 1]
                part = memory[ids]                                                  # [S, nb, H, 2, block*D]
                for which, inv, out in ((0, inv_k, k_tiles), (1, inv_v, v_tiles)):
                    tile = part[:, :, :, which][..., inv].view(slots, per_tile, heads, block, head)
                    tile = tile.permute(0, 2, 1, 3, 4).reshape(slots, heads, tn, head).float()
                    out.append(torch.where(valid, tile, 0.0).view(slots * heads, tn, head))
                q_pos = torch.tensor([qt * tm if r is not None else -1 for r, qt, _ in chunk])
                own = q_pos[:, None, None] + offsets.repeat(group)[None, :, None]     # [S, G*tm, 1]
                keeps.append(((key_pos[None, None] <= own) & (key_pos[None, None] < ends[:, :, None]))[:, None])
            done = _group(q, k_tiles, v_tiles, keeps, heads, slots)             # [S*Hkv, G*tm, Dv]
            done = done.view(slots, heads, group, tm, -1).permute(0, 3, 1, 2, 4).reshape(slots * tm, -1)
            rows = index.view(-1)
            kept = rows < total
            written[rows[kept]] = done[kept].to(output.dtype)
    return output
