"""Shards of a run: `--shard I/N` takes every N-th item starting at I, so processes (torchrun
ranks, `--jobs N`) given one run id fill one run."""

from __future__ import annotations

from dataclasses import dataclass

from kvfid.errors import BadInput


class ShardError(BadInput, ValueError):
    """A `--shard` that is not I/N with 0 <= I < N."""


@dataclass(frozen=True)
class Shard:
    """Every `count`-th item, starting at `index`."""

    index: int = 0
    count: int = 1

    def takes(self, item_index: int) -> bool:
        return item_index % self.count == self.index


def parse_shard(text: str) -> Shard:
    """`I/N` with 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ShardError(f"bad shard {text!r}; expected I/N, e.g. 0/2") from None
    if not 0 <= index < count:
        raise ShardError(f"bad shard {text!r}; need 0 <= I < N")
    return Shard(index, count)
