"""Head-sharded caches: a cache whose K/V hold only this rank's heads, read whole.

Under tensor parallelism each rank's cache holds its own key/value heads ([B, H_kv / N, T, D]).
Within `sharded_heads(gather, keep)` every state read out of a cache has each K/V part gathered
from all ranks along the head dimension (`gather`, in rank order), and every state put back
into a cache keeps only this rank's heads (`keep`), so a boundary state is always the whole
state: compared, fingerprinted and transplanted by the same code as any other. Who the ranks are
is the caller's business (kvfid.stacks.tp); outside the block nothing is changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Iterator

import torch

HEAD_PARTS = ("k", "v")   # the parts sharded by head, dim 1 of [B, H_kv, T, D]

_shards: list[tuple[Callable, Callable]] = []   # (gather, keep), innermost last


@contextlib.contextmanager
def sharded_heads(gather: Callable[[torch.Tensor], torch.Tensor],
                  keep: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Within the block, K/V parts read from a cache are gathered whole and parts put back are
    cut to this rank's heads."""
    _shards.append((gather, keep))
    try:
        yield
    finally:
        _shards.remove((gather, keep))


@contextlib.contextmanager
def whole_heads() -> Iterator[None]:
    """Within the block, caches hold every head (an arm built unsharded inside a sharded stack)."""
    saved = list(_shards)
    _shards.clear()
    try:
        yield
    finally:
        _shards[:] = saved


def read_whole(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's parts as read from this rank's cache -> the whole state's parts."""
    if not _shards:
        return parts
    gather = _shards[-1][0]
    return {name: gather(t) if name in HEAD_PARTS else t for name, t in parts.items()}


def kept(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole state's parts -> what this rank's cache holds."""
    if not _shards:
        return parts
    keep = _shards[-1][1]
    return {name: keep(t) if name in HEAD_PARTS else t for name, t in parts.items()}
