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

The model is the preset's fp32 master loaded at the dtype as transformers loads it
(kvfid.inputs.models.loaded_at), a fresh copy per engine: the manager switches its attention.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvfid.engines import transformers_faithful
from kvfid.engines.seam import (
    CHUNKED,
    KV,
    PREFIX_CACHE,
    Engine,
    EngineConfig,
    Generation,
    Rescored,
)
from kvfid.errors import BadInput, Unavailable
from kvfid.inputs.models import load_model, loaded_at
from kvfid.kernels import DTYPES
from kvfid.states.cache import BoundaryState

ATTENTION = {"paged|sdpa": "sdpa", "paged|eager": "paged|eager"}   # kvfid's name -> the manager's
RESULT_TIMEOUT_S = 600.0


def _require() -> None:
    try:
        # guarded: which transformers has continuous batching
        from transformers.generation.continuous_batching import (
            ContinuousBatchingManager,  # noqa: F401
        )
    except ImportError as err:
        raise Unavailable("transformers' continuous batching is not importable here "
                          f"({err}); it needs transformers 5.x") from None
    if "page_size" not in inspect.signature(ContinuousBatchingConfig.__init__).parameters:
        raise Unavailable(f"transformers {transformers.__version__}'s continuous batching predates "
                          "what kvfid's engine reads (its page size and block allocators, as in "
                          "5.25); install a newer transformers")


def _version() -> str:

    return f"transformers {transformers.__version__} continuous batching"


def _refusal(config: EngineConfig) -> str | None:
    if (config.attention or "paged|sdpa") not in ATTENTION:
        return (f"--attention {config.attention}: its continuous batching runs "
                f"{' or '.join(ATTENTION)} on a CPU")
    if config.faithful and config.attention not in (None, "paged|sdpa"):
        return f"--attention {config.attention} with --faithful: the faithful attention replaces paged|sdpa"
    if config.batch_invariant:
        return "--batch-invariant: this engine has no batch-invariant switch of its own"
    if config.tp > 1:
        return f"--tp {config.tp}: its tensor parallel needs torch.distributed ranks kvfid does not start"
    if config.chunk is not None and config.chunk < 16:
        return f"--chunk {config.chunk}: at least 16 tokens per step"
    if config.block_size is not None and config.block_size < 4:
        return f"--block-size {config.block_size}: at least 4 tokens per page"
    return None


class _Running:
    """A started manager as kvfid.engines.seam.Running: requests added, results collected by id,
    each finished request's K/V copied out as its blocks are freed (those wanted)."""

    def __init__(self, manager, model, config: EngineConfig):
        self.manager, self.model, self.config = manager, model, config
        cache = manager.batch_processor.cache
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
                    copied = self._copy(request_id, self.wanted[request_id])
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

    def _copy(self, request_id: str, length: int):
        """Every layer's K and V [1, H_kv, length, D] of a request, from its allocator's rows."""

        keys, values = {}, {}
        for allocator in self.cache.cache_allocators.values():
            views = getattr(allocator, "_kv_token_views", None)
            if views is None or allocator.layer_type != "full_attention":
                raise Unavailable(f"--kv: a {allocator.layer_type} cache group; kvfid reads "
                                  "full-attention pages only")
            held = len(allocator.block_table.get(request_id, [])) * allocator.tokens_per_page
            rows = torch.tensor(allocator.get_read_indices(request_id, 0, min(length, held)),
                                dtype=torch.long)
            for layer, (k_view, v_view) in views.items():
                keys[layer] = k_view[rows].permute(1, 0, 2).unsqueeze(0).clone()     # [1, H, T, D]
                values[layer] = v_view[rows].permute(1, 0, 2).unsqueeze(0).clone()
        order = sorted(keys)
        return [keys[i] for i in order], [values[i] for i in order]

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

    def _run(self, prompts, tokens: int, eos, keep: dict[int, int], one_at_a_time: bool = False,
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
        requests, got = self._run(prompts, tokens, eos, keep)
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
        requests, got = self._run(flat, tokens, -1, keep, one_at_a_time=len(sequences) == 1, cold=cold)
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


def _processor(manager):
    """The manager's batch processor, which its generation loop makes as it starts (the paged
    cache kvfid reads is its)."""

    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while manager.batch_processor is None:
        if manager.background_thread_status.fatal_error is not None or time.monotonic() > deadline:
            raise RuntimeError(f"its generation loop did not start "
                               f"({manager.background_thread_status.fatal_error})")
        time.sleep(0.01)
    return manager.batch_processor


@contextlib.contextmanager
def _start(config: EngineConfig):
    """A continuous batching manager on a fresh copy of the model at the config's dtype (the
    faithful engine's attention and mode installed around it with `config.faithful`), started
    for the block and stopped after."""


    model = loaded_at(load_model(config.model).master, DTYPES[config.dtype]).eval()
    if config.faithful:

        why = transformers_faithful.unserved(model.config)
        if why:
            raise BadInput(f"--faithful on {config.model}: {why}")
    model.set_attn_implementation(ATTENTION[config.attention or "paged|sdpa"])
    page = config.block_size or 256
    longest = config.max_len + 1
    blocks = config.kv_blocks or max(16, 4 * (-(-longest // page)) * max(1, config.max_seqs // 4))
    batching = ContinuousBatchingConfig(
        page_size=page, num_blocks=blocks, max_batch_tokens=config.chunk or max(longest, 2048),
        max_requests_per_batch=config.max_seqs, return_logprobs=True, auto_switch_to_flash=False,
        allow_block_sharing=config.prefix_caching, use_cuda_graph=False, use_async_batching=False,
        seed=config.seed, max_blocks_per_request=0)
    generation = GenerationConfig(do_sample=False, max_new_tokens=1, eos_token_id=-1,
                                  pad_token_id=model.config.pad_token_id or 0)
    with contextlib.ExitStack() as faithful:
        if config.faithful:

            faithful.enter_context(transformers_faithful.installed(model, config.dtype))
        yield from _managed(model, config, generation, batching)


def _managed(model, config, generation, batching):
    """The manager started at the config's torch threads, a _Running over it yielded, the
    manager stopped and the threads restored."""

    before = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        try:
            manager = model.init_continuous_batching(generation_config=generation,
                                                     continuous_batching_config=batching)
            manager.start()
            _processor(manager)
        except (ValueError, RuntimeError) as err:   # the manager refuses a model or a config here
            first = (str(err).splitlines() or [""])[0][:240]
            raise Unavailable(f"transformers' continuous batching did not start on {config.model} "
                              f"({type(err).__name__}: {first})") from None
        try:
            yield _Running(manager, model, config)
        finally:
            manager.stop(block=True)
    finally:
        torch.set_num_threads(before)


ENGINE = Engine(
    name="transformers", description="transformers' continuous batching (paged cache, CPU)",
    require=_require, version=_version, start=_start, refusal=_refusal,
    offers=frozenset({CHUNKED, PREFIX_CACHE, KV}),
    constructions={CHUNKED: "token budget", PREFIX_CACHE: "block sharing"})
# What `--faithful` runs: kvfid.engines.transformers_faithful (kvfid's attention per request under
# the batch-invariant mode, inside the same manager).
