"""The constructions that reuse a cache as serving engines do: a prefix-cache hit and speculative
verification (rejected drafts cut back out).

Both feed a boundary prefix P into a fresh cache the way an engine does, and leave the cache
covering exactly P with the boundary logits returned, so the protocol snapshots and compares them
like any other construction:

* `cached:K`: an *earlier, different* request prefilled P[:K] followed by another continuation in
  one forward call (|P| - K + 3 tokens: each of P's later tokens plus one, then three more, so the
  earlier request neither matches P nor has P's shape); its cache is cut back to K, as an engine
  keeps the shared prefix's blocks, and P[K:] is extended on top in one forward call. K is a token
  count, a fraction of |P|, or `prompt` (a shared system prompt).
* `spec:k`: P rebuilt as a speculative decoder builds it. The prompt is prefilled; then each step
  verifies the pending token plus up to k draft tokens in one forward call, keeps the drafts that
  are accepted (a draft is accepted when it is P's next token and every draft before it was) and
  cuts the rejected ones back out of the cache. The drafts come from a pattern: `all` (every draft
  is P's next token), `none` (every draft is wrong), `rateR` (each draft right with probability R,
  seeded by the prefix, so a replica redraws the same pattern) or `ngram` (prompt-lookup drafting:
  the k tokens that followed the latest earlier occurrence of the last two tokens). The accepted
  count of every step is kept: the record's acceptance pattern.
* `spec:tree:WxD` / `spec:tree:P1,P2,..`: the same with a draft tree verified under its ancestor
  mask and its accepted path kept (kvfid.protocol.draft_tree).

A cache whose cut leaves a trace (a recurrent state that cannot be rolled back) is refused with one
line. Nothing here knows which backend runs.
"""

from __future__ import annotations

import hashlib
import random

import torch

from kvfid.errors import Unavailable
from kvfid.protocol.decode import Cached, Runner, as_batch

_NGRAM = 2           # the n of prompt-lookup drafting
_EXTRA_OTHER = 3     # how much longer than P the earlier request of `cached:K` is


class RollbackError(Unavailable):
    """The model's cache cannot be cut back without a trace (exit 3)."""


def feed(runner: Runner, at: Cached, construction, prompt_length: int, prefix: list[int],
         vocab_size: int) -> tuple[torch.Tensor, tuple[int, ...] | None, Cached]:
    """Feed `prefix` into the empty cache `at` the engine's way; the boundary logits [1, V] (the
    last row `feed_rows` keeps), for `spec:k` the accepted draft count of each step, and the
    cache covering P."""
    rows, acceptance, at = feed_rows(runner, at, construction, prompt_length, prefix,
                                     vocab_size, first=len(prefix) - 1)
    return rows[-1:], acceptance, at


def feed_rows(runner: Runner, at: Cached, construction, prompt_length: int, prefix: list[int],
              vocab_size: int, first: int, cached_length: int | None = None
              ) -> tuple[torch.Tensor, tuple[int, ...] | None, Cached]:
    """Feed `prefix` into the empty cache `at` the engine's way, keeping the next-token logits of
    positions `first` .. |P|-1, [|P| - first, V] (a trainer re-scoring a trajectory keeps them
    all; the boundary is the last), for `spec:k` the acceptance pattern, and the cache covering
    P. `first` must not precede what the engine computes logits for: K for `cached:K`
    (`cached_length` overrides the construction's K), the prompt's last position for `spec:k`."""
    if hasattr(at.cache, "activate_past_recording"):   # window layers keep what a rollback needs
        at.cache.activate_past_recording()
    rows, acceptance, at = construction.reuse(runner, at, prompt_length, prefix, vocab_size,
                                              first, cached_length)
    at = rollback(at, 0)   # layers that kept past states for the rollback drop what they no longer need
    return rows, acceptance, at


def rollback(at: Cached, tokens: int) -> Cached:
    """Cut the last `tokens` positions out of the cache (0: only trim what is kept for rollback);
    the cache after the cut."""
    cache = at.cache
    if not getattr(cache, "is_croppable", True):
        kinds = sorted({type(layer).__name__ for layer in cache.layers
                        if not getattr(layer, "is_croppable", True)})
        raise RollbackError(f"a prefix-cache hit or a speculative rollback needs a cache that can "
                            f"be cut back; {', '.join(kinds)} keeps a recurrent state that cannot")
    cache.crop(-tokens)
    return at.covering(at.positions - tokens)


def prefix_hit(runner: Runner, at: Cached, k: int, prefix: list[int], vocab_size: int,
            rows: int) -> tuple[torch.Tensor, Cached]:
    """The earlier request, the cut back to K, then P[K:] in one call; its last `rows` logits."""
    later = prefix[k:]
    other = [(t + 1) % vocab_size for t in later] + [(later[-1] + 2 + i) % vocab_size
                                                      for i in range(_EXTRA_OTHER)]
    _, at = runner.forward(as_batch(prefix[:k] + other), at)   # the earlier, different request
    at = rollback(at, len(other))
    logits, at = runner.forward_kept(as_batch(later), at, rows)
    return logits[0], at


def speculate(runner: Runner, at: Cached, construction, prompt_length: int, prefix: list[int],
          vocab_size: int) -> tuple[torch.Tensor, tuple[int, ...], Cached]:
    """The prompt, then verification steps; the logits of positions prompt_length-1 .. |P|-1:
    the prompt's last, then each step's pending token's and its accepted drafts' rows."""
    k, pattern = construction.n, construction.variant
    rng = random.Random(hashlib.sha256(repr((prefix, construction.label)).encode()).digest())
    rate = float(pattern[len("rate"):]) if pattern.startswith("rate") else None
    first, at = runner.forward(as_batch(prefix[:prompt_length]), at)
    kept = [first]   # [1, V]
    at = rollback(at, 0)   # a window layer keeps only its window again (its masks expect that)
    i, acceptance = prompt_length, []   # the cache covers prefix[:i]; prefix[i] is pending
    while i < len(prefix):
        truth = prefix[i + 1:i + 1 + k]              # what the drafts should be (fewer at the end)
        drafts = _drafts(pattern, rate, rng, prefix[:i + 1], truth, vocab_size)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == truth[accepted]:
            accepted += 1
        step = [prefix[i]] + drafts
        rows, at = runner.forward_kept(as_batch(step), at, len(step))
        kept.append(rows[0, :1 + accepted])
        at = rollback(at, len(drafts) - accepted)
        acceptance.append(accepted)
        i += 1 + accepted
    # The last step ends at |P| only with all its drafts kept, so its last row is the boundary's.
    return torch.cat(kept), tuple(acceptance), at


def _drafts(pattern: str, rate: float | None, rng: random.Random, context: list[int],
            truth: list[int], vocab_size: int) -> list[int]:
    """Up to len(truth) draft tokens for the next step under the acceptance pattern."""
    wrong = [(t + 1) % vocab_size for t in truth]
    if pattern == "all":
        return list(truth)
    if pattern == "none":
        return wrong
    if rate is not None:
        return [t if rng.random() < rate else w for t, w in zip(truth, wrong)]
    return _lookup(context, len(truth))


def _lookup(context: list[int], k: int) -> list[int]:
    """Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the
    context's last `_NGRAM` tokens (none when there is no earlier occurrence)."""
    if k == 0 or len(context) <= _NGRAM:
        return []
    tail = context[-_NGRAM:]
    for start in range(len(context) - _NGRAM - 1, -1, -1):
        if context[start:start + _NGRAM] == tail:
            return context[start + _NGRAM:start + _NGRAM + k]
    return []
