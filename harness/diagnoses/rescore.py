"""How a supplied trajectory is scored: the generator's reference and each re-scoring construction.

The **reference** is what a generator computes: the prompt in one call, then one continuation
token at a time over the cache, each step's next-token logits at one position. A **re-scoring**
keeps the logits at every continuation position the way a trainer or an engine builds them:

* `prefill`: one forward over prompt + continuation, logits at every position; `chunked:N` the
  same through the cache in chunks of N; `batched:N` the prefill with N identical rows.
* `cached:K`: an engine's prefix-cache hit. An earlier, different request prefilled ids[:K] plus
  another continuation and was cut back to K; the rest is fed in one forward with all its
  logits. The logits predicting the first continuation token sit at the prompt's last position,
  so K is at most len(prompt) - 1; `cached:prompt` is exactly that (an engine recomputes the last
  cached token to get its logits); a fraction is of the whole trajectory (prompt + continuation).
* `spec:k[+pattern]`: the continuation verified as a speculative decoder verifies it, k drafts
  plus one per forward, the accepted positions' rows kept; the acceptance pattern is returned.

The engine constructions run through kvfid.protocol.prefix_reuse.feed_rows, the code of the
protocol's `cached:K` and `spec:k` arms, over the trajectory without its last token (which no
logits are asked after), exactly the ids the reference feeds.
"""

from __future__ import annotations

import torch

from kvfid.protocol.constructions import Construction, kinds, parse_construction
from kvfid.protocol.decode import Runner, as_batch, new_cache
from kvfid.inputs.trajectories import Trajectory


def _rescoring() -> tuple[str, ...]:
    return tuple(k.kind for k in kinds() if k.rescores and k.kind)


# The kinds a trainer or an engine re-scores by (each Construction says: `rescores`).
CONSTRUCTIONS = _rescoring()
ALLOWED = "prefill, chunked:N, batched:N, cached:K, spec:k, spec:tree:WxD"


def reference_logits(runner: Runner, t: Trajectory) -> torch.Tensor:
    """The generator's next-token logits for each continuation token: [len(tokens), V]."""
    logits, cached = runner.forward(as_batch(t.prompt_ids), new_cache(runner.module))
    rows = [logits[0]]
    for token in t.tokens[:-1]:
        logits, cached = runner.forward(as_batch([token]), cached)
        rows.append(logits[0])
    return torch.stack(rows)


def rescored_logits(runner: Runner, t: Trajectory, construction: "Construction | str"
                    ) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """Each continuation token's logits under `construction`, [len(tokens), V], and for
    `spec:k` the accepted draft count of each verification step."""
    c = parse_construction(construction)
    check_constructions([c])
    ids = list(t.prompt_ids + t.tokens)
    first = len(t.prompt_ids) - 1  # position whose logits predict the first continuation token
    return c.rescore(runner, ids, len(t.prompt_ids), first, len(t.tokens),
                     runner.module.config.get_text_config().vocab_size, cached_length(c, t))


def cached_length(c: Construction, t: Trajectory) -> int | None:
    """How many leading tokens of the trajectory a prefix-cache hit takes from the earlier
    request (None: a construction that takes none); ValueError (exit 2 at the command) when K
    passes the prompt's last position."""
    k = c.trajectory_length(len(t.prompt_ids), len(t.prompt_ids) + len(t.tokens))
    last = len(t.prompt_ids) - 1
    if k is not None and not 1 <= k <= last:
        raise ValueError(f"{c.label} on trajectory {t.id!r}: K={k} must be at least 1 and at "
                         f"most {last}, the prompt's last position, whose logits predict the "
                         f"first continuation token (prompt {len(t.prompt_ids)} tokens)")
    return k


def check_constructions(constructions, trajectories=()) -> None:
    """Refuse a construction a trainer or engine does not re-score by (live, incremental,
    cobatched), and a `cached:K` whose K passes a trajectory's prompt (ValueError)."""
    for construction in constructions:
        c = parse_construction(construction)
        if not c.rescores:
            raise ValueError(f"replay re-scores by {ALLOWED}; got {c.label!r}")
        for t in trajectories:
            cached_length(c, t)
