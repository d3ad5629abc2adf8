"""A visibility mask as the kernels compute it: runs of queries that share one ordered list of
visible keys (a *view*), checked and planned before any launch.

The kernels' claim under a visibility mask: a query's output bits are a function of its own
query and of the keys it sees, in order, and nothing else. Each query works in its *view's
coordinates*: its visible keys numbered 0, 1, ... in held order, the query at the last of them
(its own key, when it sees itself), tiles aligned to those numbers. So the keys it cannot see
change nothing, neither their values nor how many there are nor where they sit: a branch packed
after other branches (which it cannot see) gets the bits it gets as a row of its own, and the bits
the plain causal kernel gives over its visible keys alone. Invisible key tiles are never visited
(they are not in the view).

A query may see any keys at or before its own index: itself and the keys before it (a packed
branch, a tree's ancestors, a chunk of block-local attention), or a selection that leaves itself
out (a sparse indexer's top-k); a query that sees no key (a left-padded row's padding) is not
computed, and its output is left as it is (the callers give zeros). A run is a maximal range of
consecutive queries i, i+1, ... in which each query after the first sees what the one before it
sees plus itself. Its view is the last query's visible keys; the run's queries are the view's
last coordinates, one each. Masks the kernels refuse (one line): a query seeing a later key (not
causal), heads that disagree. Whether a query must see itself (it must, but under a selection)
is the caller's to check (`check_sees_itself`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_visibility(first_valid, window, chunk, aligned: bool) -> None:
    """A visibility mask is the whole pattern: refuse what would be applied beside it."""
    for what, given in (("left padding (first_valid; give it as invisible keys)", first_valid),
                        ("a sliding window", window), ("a chunk (block-local attention)", chunk)):
        if given is not None:
            raise ValueError(f"attention: a visibility mask with {what} is not supported")
    if not aligned:
        raise ValueError("attention: the alignment twins take no visibility mask")


@dataclass(frozen=True)
class Run:
    """Queries first .. first + count - 1 of a batch row, the last `count` keys of `keys`."""

    first: int  # query index (0 .. Tq - 1) of the run's first query
    count: int
    keys: torch.Tensor  # [L] int64 held indexes the run's last query sees, ascending


def as_visibility(mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """[B, Tq, Tk] bool from a visibility mask [B or 1, (H or 1,) Tq, Tk] (bool, True = attend);
    refuses heads that disagree or a shape that does not fit."""
    if mask.dim() == 4:
        if not bool((mask == mask[:, :1]).all()):
            raise ValueError("visibility mask: heads disagree (one mask per batch row is served)")
        mask = mask[:, 0]
    if mask.dim() != 3 or mask.shape[0] not in (1, batch) or tuple(mask.shape[1:]) != (q_len, kv_len):
        raise ValueError(f"visibility mask must be [B={batch}, Tq={q_len}, Tk={kv_len}]; got "
                         f"{tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"visibility mask must be bool (True: the query sees the key); got {mask.dtype}")
    return mask.expand(batch, q_len, kv_len)


def check_causal(visibility: torch.Tensor) -> None:
    """Refuse a [B, Tq, Tk] mask with a query that sees a later key."""
    batch, q_len, kv_len = visibility.shape
    index = torch.arange(q_len, device=visibility.device) + (kv_len - q_len)  # [Tq] held index
    cols = torch.arange(kv_len, device=visibility.device)
    if bool((visibility & (cols[None, None, :] > index[None, :, None])).any()):
        raise ValueError("visibility mask: a query sees a later key (the kernels serve causal "
                         "visibility: query i sees only keys at or before its own index)")


def sees_itself(visibility: torch.Tensor) -> torch.Tensor:
    """[B, Tq] bool: each query of a [B, Tq, Tk] mask sees its own key (the last Tq keys)."""
    q_len, kv_len = visibility.shape[1:]
    index = torch.arange(q_len, device=visibility.device) + (kv_len - q_len)
    return visibility[:, torch.arange(q_len, device=visibility.device), index]


def check_sees_itself(visibility: torch.Tensor) -> None:
    """Refuse a [B, Tq, Tk] mask with a query that does not see itself (a mask that is no
    selection: right padding, an empty row)."""
    if not bool(sees_itself(visibility).all()):
        raise ValueError("visibility mask: a query does not see itself (right padding or an empty "
                         "row); feed left-padded batches or give each query its own key")


def runs(visibility: torch.Tensor) -> list[list[Run]]:
    """Each batch row's runs from a [B, Tq, Tk] bool mask whose queries are the last Tq keys; a
    query that sees no key is in none."""
    check_causal(visibility)
    batch, q_len, kv_len = visibility.shape
    index = torch.arange(q_len, device=visibility.device) + (kv_len - q_len)  # [Tq] held index
    cols = torch.arange(kv_len, device=visibility.device)
    empty = ~visibility.any(-1)  # [B, Tq]
    # Query i joins i - 1's run when it sees itself and, below its index, what i - 1 sees.
    changed = (visibility[:, 1:] != visibility[:, :-1]) & (cols[None, None, :] < index[None, 1:, None])
    joins = ~changed.any(-1) & sees_itself(visibility)[:, 1:] & ~empty[:, :-1]
    starts = torch.ones(batch, q_len, dtype=torch.bool, device=visibility.device)
    starts[:, 1:] = ~joins
    out = []
    for b in range(batch):
        firsts = starts[b].nonzero().flatten().tolist() + [q_len]
        out.append([Run(s, e - s, visibility[b, e - 1].nonzero().flatten())
                    for s, e in zip(firsts, firsts[1:]) if not bool(empty[b, s])])
    return out


@dataclass(frozen=True)
class TilePlan:
    """The Triton kernel's programs: per batch row, query tiles of BLOCK_M view coordinates."""

    programs: torch.Tensor  # [B, P, 5] int64: (tile, first query, first coordinate, count, key offset)
    keys: torch.Tensor  # [total] int64: every run's view (held indexes), concatenated
    per_row: int  # P: programs per batch row (rows with fewer have count-0 entries)


def tile_plan(row_runs: list[list[Run]], block_m: int, device: torch.device) -> TilePlan:
    """Programs for every run: the query tiles its coordinates L - count .. L - 1 cover."""
    entries, keys, offset = [], [], 0
    for row in row_runs:
        mine = []
        for run in row:
            length = run.keys.numel()
            first_coord = length - run.count
            mine += [(t, run.first, first_coord, run.count, offset)
                     for t in range(first_coord // block_m, (length - 1) // block_m + 1)]
            keys.append(run.keys)
            offset += length
        entries.append(mine)
    per_row = max(1, max(len(e) for e in entries))
    table = torch.zeros(len(entries), per_row, 5, dtype=torch.int64)
    for b, mine in enumerate(entries):
        if mine:
            table[b, :len(mine)] = torch.tensor(mine, dtype=torch.int64)
    flat = torch.cat(keys) if keys else torch.zeros(1, dtype=torch.int64)
    return TilePlan(table.to(device), flat.to(device=device, dtype=torch.int64).contiguous(), per_row)
