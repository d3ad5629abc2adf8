"""transformers' continuous batching as kvfid starts it: a `ContinuousBatchingManager` made from
one EngineConfig (the one translation to its settings: page size, block budget, token budget per
step, block sharing, logprobs on, greedy), what it refuses, and a request's K/V read out of its
paged cache. kvfid.engines.transformers_engine is the engine behind the seam; its load runs step
a manager made here without its loop (kvfid.engines.transformers_load).

The model is the preset's fp32 master loaded at the dtype as transformers loads it
(kvfid.inputs.models.loaded_at), a fresh copy per manager: the manager switches its attention.
"""

from __future__ import annotations

import contextlib
import inspect
import time

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvfid.engines import transformers_faithful
from kvfid.engines.seam import EngineConfig
from kvfid.errors import BadInput, Unavailable
from kvfid.inputs.models import load_model, loaded_at
from kvfid.kernels import DTYPES

ATTENTION = {"paged|sdpa": "sdpa", "paged|eager": "paged|eager"}   # kvfid's name -> the manager's
RESULT_TIMEOUT_S = 600.0


def require() -> None:
    """Unavailable (exit 3) where this transformers has no continuous batching kvfid can read."""
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


def version() -> str:
    """The engine and its version, as records name it."""
    return f"transformers {transformers.__version__} continuous batching"


def refusal(config: EngineConfig) -> str | None:
    """Why this engine cannot serve `config` (None: it can), in one line."""
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


def read_pages(cache, request_id: str, length: int):
    """Every layer's K and V [1, H_kv, T, D] of a request over its first `length` positions (at
    most what its blocks hold), copied out of its allocator's rows of the paged cache."""
    keys, values = {}, {}
    for allocator in cache.cache_allocators.values():
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


PAGE = 256     # the paged cache's page in tokens where the config names none (transformers' default)


@contextlib.contextmanager
def manager(config: EngineConfig, looping: bool = True):
    """A continuous batching manager on a fresh copy of the model at the config's dtype (the
    faithful engine's attention and mode installed around it with `config.faithful`) and torch
    threads, for the block. `looping`: its generation loop started in its own thread (stopped
    after); without, only its batch processor made, and the caller steps it
    (kvfid.engines.transformers_load)."""
    model = loaded_at(load_model(config.model).master, DTYPES[config.dtype]).eval()
    if config.faithful:
        why = transformers_faithful.unserved(model.config)
        if why:
            raise BadInput(f"--faithful on {config.model}: {why}")
    model.set_attn_implementation(ATTENTION[config.attention or "paged|sdpa"])
    page = config.block_size or PAGE
    longest = config.max_len + 1
    blocks = config.kv_blocks or max(16, 4 * (-(-longest // page)) * max(1, config.max_seqs // 4))
    batching = ContinuousBatchingConfig(
        page_size=page, num_blocks=blocks, max_batch_tokens=config.chunk or max(longest, 2048),
        max_requests_per_batch=config.max_seqs, return_logprobs=True, auto_switch_to_flash=False,
        allow_block_sharing=config.prefix_caching, use_cuda_graph=False, use_async_batching=False,
        seed=config.seed, max_blocks_per_request=0)
    generation = GenerationConfig(do_sample=False, max_new_tokens=1, eos_token_id=-1,
                                  pad_token_id=model.config.pad_token_id or 0)
    with contextlib.ExitStack() as stack:
        if config.faithful:
            stack.enter_context(transformers_faithful.installed(model, config.dtype))
        stack.enter_context(_torch_threads(config.threads))
        try:
            made = model.init_continuous_batching(generation_config=generation,
                                                  continuous_batching_config=batching)
            if looping:
                made.start()
                _processor(made)
            else:
                made.batch_processor = made._create_batch_processor()
        except (ValueError, RuntimeError) as err:   # the manager refuses a model or a config here
            first = (str(err).splitlines() or [""])[0][:240]
            raise Unavailable(f"transformers' continuous batching did not start on {config.model} "
                              f"({type(err).__name__}: {first})") from None
        try:
            yield made
        finally:
            if looping:
                made.stop(block=True)


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """torch's threads at `threads` within the block (None: as they are), restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
