"""What `kvfid engine-load` measures: the plan drawn, the load run and the alone runs
(kvfid.engines.load), optionally the sweep (kvfid.engines.load_sweep), as one EngineLoadRecord
(its text and report: kvfid.reports.engine_load_report).
"""

from __future__ import annotations

import time
from dataclasses import replace

from kvfid.engines import load, load_server, load_sweep, vllm_llm
from kvfid.engines.load_plan import LoadShape, plan_load
from kvfid.errors import BadInput
from kvfid.records.engine_load import EngineLoadRecord

# What vLLM's V1 scheduler does when a step's blocks run out (the record's `pressure`).
PRESSURE = ("preemption by recompute: the newest running request's blocks are freed and it waits; "
            "resumed, its tokens are computed again (the prefix cache may serve full blocks)")


def engine_load(model_name: str, dtype: str, shape: LoadShape, seed: int = 0, kv_blocks: int = 24,
                chunk: int | None = None, faithful: bool = False, prefix_caching: bool = True,
                threads: int | None = None, server: bool = False, sweep=None, faults=None,
                progress=None, kv_cache_dtype: str = "auto") -> EngineLoadRecord:
    """The load run's record (kvfid.engines.load's docstring): `server`, vLLM's own OpenAI
    server started here (kvfid.engines.load_server); `sweep` a SweepShape to run after it;
    `faults` (server only) the failures to inject (load_server.Faults); `kv_cache_dtype`: the
    paged cache's stored format (the saved states are its bytes as fp8)."""

    say = progress or (lambda _: None)
    plan = plan_load(shape, seed)                      # refusals before any engine starts
    load.engine_config(plan, faithful, chunk, kv_blocks, prefix_caching, kv_cache_dtype)
    if sweep is not None and kv_cache_dtype != "auto":
        raise BadInput(f"--sweep with --kv-cache-dtype {kv_cache_dtype}: the sweep runs the "
                       "model's own dtype only")
    load.check_budget(plan, kv_blocks, plan.longest + 1)
    if server and threads is None:
        threads = 1    # the server's worker and the alone runs at one count: the same computation
    vllm_llm.require_vllm()
    folder = vllm_llm.model_folder(model_name)
    start = time.perf_counter()
    served_by = None
    if server:

        served_by = load_server.serving(folder, dtype, threads, faults, say)
    # stock is stock: vLLM's own switch stays off (EngineConfig.batch_invariant, False here)
    parts = load.run_load(folder, dtype, plan, kv_blocks, chunk, faithful, prefix_caching,
                          threads, say=say, served_by=served_by, kv_cache_dtype=kv_cache_dtype)
    record = EngineLoadRecord(model_name, dtype, f"vllm {vllm_llm.version()}", faithful,
                              "server" if server else "in-process", seed, shape.clients,
                              shape.tokens, kv_blocks, chunk, prefix_caching, threads=threads,
                              folder=folder, greedy_share=shape.greedy_share,
                              kv_cache_dtype=kv_cache_dtype, engine_name="vllm", block_size=vllm_llm.BLOCK,
                              pressure=PRESSURE, **parts)
    if sweep is not None:

        record = replace(record, sweep=load_sweep.run_sweep(folder, dtype, sweep, faithful, threads, say))
    incomplete = bool(record.missing)
    return replace(record, wall_s=time.perf_counter() - start, status="incomplete" if incomplete else "ok")
