"""transformers' own continuous batching behind kvfid's engine seam: the engine the registry names
`transformers` (`model.init_continuous_batching`, its `ContinuousBatchingManager` over a paged
cache, `paged|sdpa` or `paged|eager` attention, on CPU).

What kvfid asks of it, and how:

- generation: greedy requests added to one manager (alone: one request, then its result; batched:
  every prompt added, then every result), `return_logprobs` on: the engine's logprob of each token
  it generated, as it computes it.
- prefill re-scoring: this engine returns no prompt logprobs, so position t of a sequence is
  re-scored by a request whose prompt is the sequence up to t and that generates one token (two
  under block sharing: see `rescore`): a prefill over those tokens, whose first logprob is of its
  greedy token. Where that token is not
  the sequence's (the prefill's argmax parts from the decode's), the item is re-scored up to there
  and counted as diverged, as decoded tokens are.
- the step's token budget (`max_batch_tokens`) splits a prefill into chunks (CHUNKED); block
  sharing (`allow_block_sharing`, its prefix cache) serves full blocks of a prompt another request
  left (PREFIX_CACHE; a cold request runs after every cached block is evicted).
- the engine state (KV): each layer's K and V of a request copied out of the paged cache as the
  engine frees the request's blocks (full-attention layers; the blocks' physical rows as its
  allocator reads them).

The manager is made from the config in kvfid.engines.transformers_batching (a fresh copy of the
model per manager); `engine-load` and `engine-bench --load` step one without its loop
(kvfid.engines.transformers_load), `engine-bench` times this module's engine
(kvfid.engines.transformers_bench). Its load plans are greedy (`samples=False`): one sampler draws
for the whole batch, with no seed per request, so a sampled request cannot be run again alone.
"""

from __future__ import annotations

import contextlib
import threading

from kvfid.engines import transformers_bench, transformers_load
from kvfid.engines.bench import render, render_load
from kvfid.engines.seam import (
    CHUNKED,
    KV,
    PREFIX_CACHE,
    Engine,
    EngineConfig,
    Generation,
    Rescored,
)
from kvfid.engines.transformers_batching import (
    RESULT_TIMEOUT_S,
    manager,
    read_pages,
    refusal,
    require,
    version,
)
from kvfid.errors import BadInput, Unavailable
from kvfid.states.cache import BoundaryState


class _Running:
    """A started manager as kvfid.engines.seam.Running: requests added, results collected by id,
    each finished request's K/V copied out as its blocks are freed (those wanted)."""

    def __init__(self, made, model, config: EngineConfig):
        self.manager, self.model, self.config = made, model, config
        cache = made.batch_processor.cache
        self.cache = cache
        self.block_size = int(next(iter(cache.cache_allocators.values())).tokens_per_page)
        self.wanted: dict[str, int] = {}          # request id -> positions to read at its free
        self.read: dict[str, tuple[list, list]] = {}
        self.served: dict[str, int] = {}
        self.lock = threading.Lock()
        free, search = cache.free_blocks, cache.search_prefix_match

        def free_blocks(request_id, *args, **kwargs):
            if request_id in self.wanted:
                try:
                    copied = read_pages(cache, request_id, self.wanted[request_id])
                except Exception as err:    # never into the engine's loop: said when read
                    copied = err
                with self.lock:
                    self.read[request_id] = copied
            return free(request_id, *args, **kwargs)

        def search_prefix_match(request_id, prompt_ids):
            found = search(request_id, prompt_ids)
            self.served[request_id] = int(found)
            return found
        cache.free_blocks, cache.search_prefix_match = free_blocks, search_prefix_match
        self.count = 0

    def _ids(self, n: int) -> list[str]:
        self.count += n
        return [f"kvfid-{i}" for i in range(self.count - n, self.count)]

    def _results(self, requests: list[str]) -> dict:
        """Every request's GenerationOutput, in any order the manager answers."""
        got = {}
        while len(got) < len(requests):
            out = self.manager.get_result(timeout=RESULT_TIMEOUT_S)
            if out is None:
                raise Unavailable("transformers' continuous batching gave no result within "
                                  f"{RESULT_TIMEOUT_S:g} s (its generation loop stopped)")
            if out.error:
                raise Unavailable(f"transformers' continuous batching failed a request: {out.error}")
            got[out.request_id] = out
        return got

    def run(self, prompts, tokens: int, eos, keep: dict[int, int], one_at_a_time: bool = False,
            cold: bool = False) -> list:
        """One call: every prompt added, then every result (`one_at_a_time`: each request alone,
        its result before the next is added; `cold`: after evicting every cached block); `keep[i]`:
        read request i's first so many positions as its blocks are freed."""
        requests = self._ids(len(prompts))
        self.read.clear()
        self.wanted = {requests[i]: n for i, n in keep.items()}
        got = {}
        for request, prompt in zip(requests, prompts):
            if cold:
                while self.cache.evict_cached_blocks():
                    pass
            self.manager.add_request(list(prompt), request_id=request, max_new_tokens=tokens,
                                     eos_token_id=eos)
            if one_at_a_time or cold:
                got.update(self._results([request]))
        if len(got) < len(requests):
            got = self._results(requests)
        return requests, got

    def generate(self, prompts, tokens, temperature=0.0, seed=None, stop_ids=(), ignore_eos=False):
        if temperature != 0.0:
            raise BadInput("--engine transformers samples greedily only: its logprobs under a "
                           "temperature are of the scaled logits, not the model's")
        eos = -1 if ignore_eos else (list(stop_ids) or -1)
        keep = {i: len(p) + tokens - 1 for i, p in enumerate(prompts)}
        requests, got = self.run(prompts, tokens, eos, keep)
        return [Generation(list(got[r].generated_tokens), [float(v) for v in got[r].logprobs], r)
                for r in requests]

    def rescore(self, sequences, starts, read_cache=False):
        cold = self.config.prefix_caching and not read_cache
        flat, owner = [], []
        for item, (seq, start) in enumerate(zip(sequences, starts)):
            for t in range(start, len(seq)):
                flat.append(seq[:t])
                owner.append((item, t))
        keep = {j: len(flat[j]) for j, (item, t) in enumerate(owner)
                if t == len(sequences[item]) - 1}          # each item's longest prefix
        # one sequence: each of its prefills alone; several: every prefill of every sequence in one call
        # Under block sharing each request generates 2 tokens, not 1: the engine registers the blocks
        # a forward completed only for a request that is not finished by it, so a 1-token request
        # would leave nothing a warm request could read (the first token's logprob is the same).
        tokens = 2 if self.config.prefix_caching else 1
        requests, got = self.run(flat, tokens, -1, keep, one_at_a_time=len(sequences) == 1, cold=cold)
        made = []
        for item, seq in enumerate(sequences):
            lps, last, served, stop = [], None, 0, False
            for j, (owner_item, t) in enumerate(owner):
                if owner_item != item:
                    continue
                last = requests[j]
                served = max(served, self.served.get(requests[j], 0))
                out = got[requests[j]]
                if stop or list(out.generated_tokens[:1]) != [seq[t]]:
                    stop = True               # the prefill's argmax is another token: diverged here
                    continue
                lps.append(float(out.logprobs[0]))
            made.append(Rescored(lps, served, last, diverged=stop))
        return made

    def read_states(self, requests, sequences):
        states = []
        for request, seq in zip(requests, sequences):
            if request not in self.read:
                raise Unavailable(f"request {request}: its K/V was not read as the engine freed it")
            if isinstance(self.read[request], Exception):
                err = self.read[request]
                raise Unavailable(f"request {request}: its K/V could not be read ({type(err).__name__}: {err})")
            keys, values = self.read[request]
            held = keys[0].shape[2]
            states.append(BoundaryState(seq[:held], keys=keys, values=values))
        return states


@contextlib.contextmanager
def _start(config: EngineConfig):
    """The engine as kvfid.engines.seam.Running: a looping manager (`manager`) for the block."""
    with manager(config) as made:
        yield _Running(made, made.model, config)


def _bench(**options):
    return transformers_bench.engine_bench(**options), render


def _load_bench(*args, **options):
    return transformers_bench.load_bench(*args, **options), render_load


ENGINE = Engine(
    name="transformers", description="transformers' continuous batching (paged cache, CPU)",
    require=require, version=version, start=_start, refusal=refusal,
    offers=frozenset({CHUNKED, PREFIX_CACHE, KV}),
    constructions={CHUNKED: "token budget", PREFIX_CACHE: "block sharing"},
    load=transformers_load.engine_load, bench=_bench, load_bench=_load_bench, samples=False)
# What `--faithful` runs: kvfid.engines.transformers_faithful (kvfid's attention per request under
# the batch-invariant mode, inside the same manager).
