"""`spec:tree`: P rebuilt as a tree-shaped speculative verifier builds it (EAGLE-2/3, Medusa
trees in vLLM and SGLang), beside `spec:k`'s chain (kvfid.protocol.prefix_reuse).

The tree is given by its nodes' parents: node j (1..n) hangs under node parents[j-1], node 0 being
the pending token (the root). `spec:tree:WxD` is the full tree of width W and depth D (every node
above depth D has W children); `spec:tree:0,0,1,1` spells the parents (each before its child).
Each verification step feeds the root and the whole draft tree in one forward call under its
ancestor mask (a node sees the cache, its ancestors and itself, nothing of its siblings'
subtrees) with each node's position id its root's plus its depth, the way a verifier packs a
tree; then the accepted path (from the root, the child whose draft is P's next token, as deep as
it goes) is kept: the cache cut back to the root and the path's keys and values gathered after it
in order, as EAGLE's verifiers move the accepted nodes' cache entries. Drafts: at every node on
P's path one child, chosen by a generator seeded by the prefix, carries P's next token (`+rateR`:
with probability R, so a step may stop early), every other node a wrong token. Nodes deeper than
what P has left are pruned, so the last step ends at |P|. The mask is the one visibility-mask
path every stack serves (a 4-D float mask, 0 where a query sees a key); a model whose layers do
not attend through the mask alone (sliding-window, chunked, recurrent, latent) is refused
(constructions.check_rollback).
"""

from __future__ import annotations

import hashlib
import random
import re

import torch

from kvfid.protocol.decode import Cached, Runner, as_batch

MAX_NODES = 64
_SPELLING = re.compile(r"spec:tree:(?:(\d+)x(\d+)|(\d+(?:,\d+)*))(?:\+rate(0?\.\d+))?")


def parse_tree(text: str) -> tuple[tuple[int, ...], str | None] | None:
    """`spec:tree:WxD[+rateR]` or `spec:tree:P1,P2,..[+rateR]` -> (parents, rate) or None when
    it is not a tree's spelling; ValueError naming what is wrong."""
    found = _SPELLING.fullmatch(text)
    if not found:
        return None
    width, depth, spelled, rate = found.groups()
    if spelled is None:
        if int(width) < 1 or int(depth) < 1:
            raise ValueError(f"{text}: a tree of width W >= 1 and depth D >= 1")
        parents, level = [], [0]
        for _ in range(int(depth)):
            nxt = []
            for parent in level:
                for _ in range(int(width)):
                    parents.append(parent)
                    nxt.append(len(parents))
                    if len(parents) > MAX_NODES:
                        raise ValueError(f"{text}: more than {MAX_NODES} draft nodes")
            level = nxt
    else:
        parents = [int(p) for p in spelled.split(",")]
        bad = next((j for j, p in enumerate(parents, 1) if p >= j), None)
        if bad is not None:
            raise ValueError(f"{text}: node {bad}'s parent {parents[bad - 1]} is not an earlier "
                             f"node (0 is the root, nodes count from 1)")
        if len(parents) > MAX_NODES:
            raise ValueError(f"{text}: more than {MAX_NODES} draft nodes")
    if rate is not None and not 0 < float(rate) < 1:
        raise ValueError(f"{text}: +rateR takes R in (0, 1)")
    return tuple(parents), rate


def depths(parents: tuple[int, ...]) -> list[int]:
    """Each node's depth, the root's 0 first."""
    out = [0]
    for parent in parents:
        out.append(out[parent] + 1)
    return out


def ancestor_mask(parents: tuple[int, ...], cached: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n+1, cached+n+1] float: each of the root and its n nodes sees the cache, its
    ancestors and itself (0), nothing else (the dtype's minimum)."""
    n = len(parents) + 1
    sees = torch.zeros(n, cached + n, dtype=torch.bool)
    sees[:, :cached] = True
    for node in range(n):
        at = node
        while True:
            sees[node, cached + at] = True
            if at == 0:
                break
            at = parents[at - 1]
    mask = torch.zeros(sees.shape, dtype=dtype).masked_fill(~sees, torch.finfo(dtype).min)
    return mask[None, None]


def _pruned(parents: tuple[int, ...], depth: int) -> tuple[int, ...]:
    """The tree without nodes deeper than `depth`, renumbered (parents stay before children)."""
    keep, number, out = depths(parents), {0: 0}, []
    for node, parent in enumerate(parents, 1):
        if keep[node] <= depth:
            number[node] = len(out) + 1
            out.append(number[parent])
    return tuple(out)


def _drafts(parents, truth: list[int], rate, rng: random.Random, vocab_size: int):
    """Each node's draft token and the accepted path (node numbers, root excluded)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents, 1):
        children.setdefault(parent, []).append(node)
    level = depths(parents)
    # wrong everywhere first: node j at depth d drafts P's token there plus 1 + j
    tokens = [0] + [(truth[level[j] - 1] + 1 + j) % vocab_size for j in range(1, len(level))]
    path, at = [], 0
    while children.get(at) and level[at] < len(truth):
        if rate is not None and rng.random() >= float(rate):
            break
        chosen = rng.choice(children[at])
        tokens[chosen] = truth[level[at]]
        path.append(chosen)
        at = chosen
    return tokens[1:], path


def verify(runner: Runner, at: Cached, construction, prompt_length: int, prefix: list[int],
           vocab_size: int) -> tuple[torch.Tensor, tuple[int, ...], Cached]:
    """The prompt, then tree verification steps; the logits of positions prompt_length-1 ..
    |P|-1 (the prompt's last, then each step's root and accepted path) and the accepted count of
    each step, and the cache after the last step."""
    parents, rate = construction.tree, construction.variant.partition("+rate")[2] or None
    dtype = next(runner.module.parameters()).dtype
    rng = random.Random(hashlib.sha256(repr((prefix, construction.label)).encode()).digest())
    first, at = runner.forward(as_batch(prefix[:prompt_length]), at)
    kept = [first]   # [1, V]
    i, acceptance = prompt_length, []   # the cache covers prefix[:i]; prefix[i] is pending
    while i < len(prefix):
        truth = prefix[i + 1:]
        tree = _pruned(parents, len(truth))
        drafts, path = _drafts(tree, truth, rate, rng, vocab_size)
        level = depths(tree)
        step = [prefix[i]] + drafts
        rows, at = runner.forward_kept(as_batch(step), at, len(step),
                                       attention_mask=ancestor_mask(tree, i, dtype),
                                       position_ids=torch.tensor([[i + d for d in level]]))
        kept.append(rows[0][[0, *path]])
        at = keep_path(at, i, path)
        acceptance.append(len(path))
        i += 1 + len(path)
    return torch.cat(kept), tuple(acceptance), at


def keep_path(at: Cached, root: int, path: list[int]) -> Cached:
    """Cut the cache back to the root (slot `root`) and gather the accepted nodes after it; the
    cache after the gather."""
    slots = torch.tensor([root + j for j in path], dtype=torch.long)
    for layer in at.cache.layers:
        for name in ("keys", "values"):
            held = getattr(layer, name)
            setattr(layer, name, torch.cat([held[:, :, :root + 1],
                                            held.index_select(2, slots.to(held.device))], dim=2))
    return at.covering(root + 1 + len(path))
