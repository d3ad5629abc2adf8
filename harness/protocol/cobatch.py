"""Co-batches: an item's boundary prefix in one batch with other items of other lengths.

`choose` picks the co-batch of a `cobatched:N` construction: N - 1 neighbours from the item set
(seeded by the item id and N), each given its own length, and the item's row among them. The
lengths are chosen, not taken as they come: the neighbours' prompts alone are shorter than a
boundary prefix (prompt + B), which would leave the item's row never padded. So one neighbour is
longer than P (the item's row is left-padded) and the others range from half to one and a half
times |P|, all lengths distinct and different from |P|; a neighbour's tokens are its prompt's ids,
repeated to its length.

`prefill` feeds a co-batch the way transformers pads it (left padding, an attention mask, position
ids counted from each row's first real token); `in_batch` is the greedy loop's feed that
continues all rows in the same batch. Nothing here knows which attention backend runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from kvfid.protocol.decode import Cached, Feeder, Runner
from kvfid.inputs.items import arith_items

PAD_ID = 0  # the token id at pad positions (masked; any id would do)


@dataclass(frozen=True)
class CoBatch:
    """Rows of token ids (unpadded), the item's row among them, and the neighbours' item ids."""

    rows: tuple[tuple[int, ...], ...]
    row: int
    neighbours: tuple[str, ...]

    @property
    def width(self) -> int:
        return max(len(r) for r in self.rows)

    @property
    def pads(self) -> list[int]:
        """Left padding of each row."""
        return [self.width - len(r) for r in self.rows]

    def describe(self) -> dict:
        """What the ledger keeps of the co-batch."""
        return {"row": self.row, "lengths": [len(r) for r in self.rows], "pads": self.pads,
                "neighbours": list(self.neighbours)}


def default_pool(n: int = 16) -> list:
    """Neighbours for an item that comes without an item set (a single prompt): the built-in
    arith set."""
    return arith_items(n)


def choose(prefix: Sequence[int], item_id: str, pool: Sequence[tuple[str, list[int]]], n: int,
           max_length: int) -> CoBatch:
    """The co-batch of `cobatched:n` for the item with boundary prefix `prefix`.

    `pool` holds (item id, prompt ids) of the item set; the item itself is skipped. Neighbour
    lengths stay within `max_length` (the context left for the suffix).
    """
    rng = random.Random(f"cobatched:{n}:{item_id}")
    others = [(i, ids) for i, ids in pool if i != item_id and ids]
    if n > 1 and not others:
        raise ValueError("a co-batch needs other items in the item set")
    size = len(prefix)
    if n > 1 and size >= max_length:
        raise ValueError(f"no room for a neighbour longer than |P| = {size} (limit {max_length})")
    lengths: list[int] = []
    low, high = max(1, size // 2), max(size + 1, min(max_length, size + size // 2))
    while len(lengths) < n - 1:
        if not lengths:  # one neighbour longer than P, so the item's row is padded
            length = rng.randint(size + 1, max(size + 1, min(max_length, size + size // 2)))
        else:
            length = rng.randint(low, high)
        if length != size and (length not in lengths or len(lengths) >= high - low):
            lengths.append(length)
    chosen = [others[rng.randrange(len(others))] for _ in lengths]
    rows = [tuple((ids * (length // len(ids) + 1))[:length]) for (_, ids), length in zip(chosen, lengths)]
    row = rng.randrange(n)
    rows.insert(row, tuple(prefix))
    return CoBatch(tuple(rows), row, tuple(i for i, _ in chosen))


def padded(batch: CoBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids, attention mask and position ids, each [N, W], as transformers pads."""
    width = batch.width
    ids = torch.full((len(batch.rows), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch.rows), width), dtype=torch.long)
    for i, (row, pad) in enumerate(zip(batch.rows, batch.pads)):
        ids[i, pad:] = torch.tensor(row, dtype=torch.long)
        mask[i, pad:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # pad positions get 0, as generate() does
    return ids, mask, positions


def prefill(runner: Runner, at: Cached, batch: CoBatch
            ) -> tuple[torch.Tensor, torch.Tensor, Cached]:
    """One forward call over the padded co-batch; (last logits [N, V], attention mask [N, W],
    the cache after it)."""
    ids, mask, positions = padded(batch)
    logits, at = runner.forward(ids, at, attention_mask=mask, position_ids=positions)
    return logits, mask, at


def in_batch(runner: Runner, at: Cached, batch: CoBatch, logits: torch.Tensor,
             mask: torch.Tensor) -> Feeder:
    """The greedy loop's feed (kvfid.protocol.decode.greedy) for the item's row decoding with
    every row in the same batch: each step feeds the item's token and every other row's own
    argmax, one position further; it gives the item's row of the logits. `logits` [N, V] and
    `mask` [N, W] are the co-batch's after its prefill."""
    rows = {"logits": logits, "mask": mask,
            "positions": torch.tensor([[len(r) - 1] for r in batch.rows], dtype=torch.long)}

    def step(at: Cached, token: int) -> tuple[torch.Tensor, Cached]:
        fed = rows["logits"].float().argmax(-1, keepdim=True).cpu()  # [N, 1]
        fed[batch.row, 0] = token
        rows["mask"] = torch.cat([rows["mask"], torch.ones_like(rows["mask"][:, :1])], dim=1)
        rows["positions"] = rows["positions"] + 1
        rows["logits"], at = runner.forward(fed, at, attention_mask=rows["mask"],
                                            position_ids=rows["positions"])
        return rows["logits"][batch.row], at

    return Feeder(at, step)
