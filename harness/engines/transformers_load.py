"""`kvfid engine-load --engine transformers`: transformers' continuous batching under load, each
request bit for bit against itself alone.

The plan (kvfid.engines.load_plan, greedy: this engine has no seed per request) is sent by K
clients to one manager whose paged cache holds `kv_blocks` pages of 32 tokens and whose step
takes at most `chunk` tokens (its `max_batch_tokens`; default: the longest request or 2048, the
engine check's). The manager is made without its generation loop
(kvfid.engines.transformers_batching.manager) and stepped here, one step as its loop runs it
(its batch processor's schedule, forward and update), so the clients are simulated on the step
loop like vLLM's (a client sends its next request `gap` steps after its previous one finished)
and a plan replays the same schedule. `Stepped` writes down what load does to each request
(kvfid.engines.load_compare.Seen: steps, tokens scheduled, co-residents, block-sharing hits per
admission, each preemption's computed length) and saves its K/V as the engine frees its blocks:
at each preemption and when it finishes. Then every request runs alone on a second manager (the
same configuration, its default cache size, every cached block evicted before each request) and
is compared (kvfid.engines.load_compare.compared), as vLLM's are.

What this engine does when its blocks run out (transformers 5.25, read in its source:
`ContinuousBatchProcessor.prepare_next_batch`, the scheduler's `_process_candidates` and the
`OffloadingManager`; the record's `pressure`, and what the run counted):

1. below 15% free blocks (the FIFO scheduler's safety margin) it admits no new prompt beyond the
   first of a step, decoding requests go on;
2. a request that cannot get its next block is starved; it first evicts every block kept for
   block sharing (`evictions`);
3. then it preempts starved requests, newest first, until the rest fit: copied to a host swap
   pool where one is configured (`cpu_offload_space`, 0 by default: none; `offloads`), otherwise
   soft reset: its blocks freed, and it waits as a new request whose prompt is its prompt and the
   tokens it generated, re-prefilled when scheduled again (recompute: `preemptions`, `recomputed`);
4. where nothing can be scheduled nor preempted it fails every request; the budget check below
   refuses a budget that cannot hold the longest request before anything starts.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from transformers.generation.continuous_batching import ContinuousBatchingManager, RequestStatus
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

from kvfid.engines.load_compare import PlanRun, Seen, Served, compared, save_state
from kvfid.engines.load_plan import Clients, LoadPlan, LoadShape, PlannedRequest, plan_load
from kvfid.engines.seam import EngineConfig
from kvfid.engines.transformers_batching import manager, read_pages, refusal, require, version
from kvfid.errors import BadInput, Unavailable
from kvfid.records.engine_load import EngineLoadRecord

BLOCK = 32                  # the paged cache's page in tokens under load (vLLM's load runs' block)
DEFAULT_BUDGET = 2048       # the step's token budget where --chunk names none (at least the longest request)
PRESSURE = ("evicts its cached (block-sharing) blocks first, then soft-resets the newest starved "
            "requests: their blocks freed, prompt and generated tokens re-prefilled when scheduled "
            "again (recompute; no host swap pool: cpu_offload_space 0); no new prompt admitted "
            "below 15% free blocks")
# What Stepped calls on the manager and on its batch processor (its loop's own step).
STEPPING = {ContinuousBatchingManager: ("_create_batch_processor",),
            ContinuousBatchProcessor: ("prepare_next_batch", "_generation_step", "update_batch")}


def request_id(index: int) -> str:
    """The id a planned request is sent with."""
    return f"kvfid-load-{index}"


class Stepped:
    """A manager made without its loop, stepped by the caller; it records what each request goes
    through and saves its K/V into `folder` (`folder` None: nothing read, for timing). The
    engine's methods are wrapped on its own instances (the scheduler, the cache, the offloading
    manager), never patched in its code."""

    def __init__(self, made, folder: Path | None):
        self.manager, self.folder = made, folder
        self.processor = made.batch_processor
        self.cache, self.scheduler = self.processor.cache, self.processor.scheduler
        self.seen: dict[str, Seen] = {}
        self.lines: dict[str, dict] = {}          # a finished request's line (kvfid.engines.load_compare)
        self.admitted: set[str] = set()           # scheduled since its last (re)queueing
        self.hits: dict[str, int] = {}            # its latest block-sharing hit, until admitted
        self.evictions = self.offloads = 0
        self.preempting: list[str] = []           # requests freed by the offloading call under way
        self.in_offload = False
        self.kv_note: str | None = None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self._wrap()

    def _wrap(self) -> None:
        cache, scheduler, offloading = self.cache, self.scheduler, self.processor.offloading_manager
        free, search, evict = cache.free_blocks, cache.search_prefix_match, cache.evict_cached_blocks
        schedule, offload = scheduler.schedule_batch, offloading.offload_requests

        def free_blocks(request_id, no_cache=False):
            self._freeing(request_id, no_cache)
            return free(request_id, no_cache)

        def search_prefix_match(request_id, prompt_ids):
            found = search(request_id, prompt_ids)
            self.hits[request_id] = int(found)
            return found

        def evict_cached_blocks():
            evicted = evict()
            self.evictions += bool(evicted)
            return evicted

        def schedule_batch(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if out[0]:
                self._scheduled(out[0])
            return out

        def offload_requests():
            self.in_offload, self.preempting = True, []
            try:
                return offload()
            finally:
                self.in_offload = False
                waiting = scheduler.waiting_requests
                self.offloads += sum(r in waiting and waiting[r].is_cpu_offloaded for r in self.preempting)

        cache.free_blocks, cache.search_prefix_match = free_blocks, search_prefix_match
        cache.evict_cached_blocks, scheduler.schedule_batch = evict_cached_blocks, schedule_batch
        offloading.offload_requests = offload_requests

    def _scheduled(self, batch) -> None:
        """A step's batch: each request's step, tokens, co-residents and, at its admission, the
        positions block sharing served it."""
        for future in batch:
            request = future.state.request_id
            seen = self.seen.setdefault(request, Seen())
            seen.steps += 1
            seen.scheduled += future.query_length
            seen.coresident = max(seen.coresident, len(batch))
            if request not in self.admitted:
                seen.cache_hits.append(self.hits.pop(request, 0))
                self.admitted.add(request)

    def _freeing(self, request: str, no_cache: bool) -> None:
        """A request's blocks about to be freed: preempted (the offloading call frees it with
        `no_cache`), or finished; its K/V saved over the positions it computed."""
        state = self.scheduler.active_requests.get(request)
        if state is None or request not in self.seen:
            return
        seen = self.seen[request]
        if self.in_offload and no_cache:
            seen.preempted_at.append(state.position_offset)
            self.preempting.append(request)
            self.admitted.discard(request)
            saved = self._save(request, state, f"preempted-{len(seen.preempted_at)}")
            if saved:
                seen.states.append(saved)
        elif not self.in_offload and state.status == RequestStatus.FINISHED:
            self.lines[request] = seen.line(computed=state.position_offset, kv_note=None,
                                            final_state=self._save(request, state, "final"))

    def _save(self, request: str, state, tag: str) -> str | None:
        """The request's K and V over its computed positions, saved; the file's name, or None
        (nothing read, or a cache kvfid cannot read: said once in `kv_note`)."""
        length = state.position_offset
        if self.folder is None or length == 0:
            return None
        try:
            keys, values = read_pages(self.cache, request, length)
        except Exception as err:   # a cache group kvfid cannot read: said, not guessed
            self.kv_note = f"{type(err).__name__}: {str(err)[:200]}"
            return None
        tokens = (list(state.initial_tokens) + list(state.generated_tokens))[:length]
        return save_state(self.folder, f"{request}-{tag}.pt", tokens, keys, values)

    def add(self, planned: PlannedRequest) -> str:
        """A planned request sent (greedy, its tokens all generated: end-of-turn ignored)."""
        request = request_id(planned.index)
        self.seen[request] = Seen()
        self.manager.add_request(list(planned.prompt), request_id=request,
                                 max_new_tokens=planned.tokens, eos_token_id=-1)
        return request

    def step(self) -> list:
        """One step as the manager's loop runs it; the results it finished (GenerationOutput)."""
        if self.processor.prepare_next_batch():
            self.processor._generation_step(self.manager.model)
            self.processor.update_batch()
        queue, done = self.manager.output_router.output_queue, []
        while not queue.empty():
            done.append(queue.get_nowait())
        return done

    def served(self, out) -> Served:
        """A finished request as compared: its tokens, logprobs and line (the K/V note added)."""
        line = self.lines.get(out.request_id, {})
        if line and self.kv_note:
            line = {**line, "kv_note": self.kv_note}
        return Served(tuple(out.generated_tokens), tuple(float(v) for v in out.logprobs), line)


def drive(stepped: Stepped, plan: LoadPlan, say=lambda _: None) -> PlanRun:
    """The plan sent by its clients on the step loop (kvfid.engines.load.drive's schedule): what
    was served per index, why each other one is missing, the steps and the wall time."""
    planned = {r.index: r for r in plan.requests}
    index = {request_id(r.index): r.index for r in plan.requests}
    clients = Clients(plan)
    served: dict[int, Served] = {}
    missing: dict[int, str] = {}
    step, start = 0, time.perf_counter()
    while True:
        for sent in clients.due(step):
            stepped.add(sent)
        if clients.idle():
            after = clients.next_step(step)
            if after is None:
                break
            step = after
            continue
        try:
            finished = stepped.step()
        except RuntimeError as err:    # nothing schedulable nor preemptible: it fails every request
            why = f"the engine stopped: {(str(err).splitlines() or [''])[0][:200]}"
            missing.update({r.index: why for r in plan.requests if r.index not in served})
            break
        for out in finished:
            at = index[out.request_id]
            if out.error:
                missing[at] = f"failed by the engine: {out.error[:200]}"
            else:
                served[at] = stepped.served(out)
            clients.finished(planned[at].client, step)
        step += 1
        if step % 100 == 0:
            say(f"step {step}: {len(served)} of {len(plan.requests)} requests done")
    return PlanRun(served, missing, stepped.folder, step, time.perf_counter() - start)


def alone(stepped: Stepped, requests: list[PlannedRequest], say=lambda _: None) -> PlanRun:
    """Each request alone in the manager, every cached block evicted before it (a fresh engine's
    state)."""
    plans = [LoadPlan(0, LoadShape(requests=1, clients=1), (replace(r, client=0, gap=0),))
             for r in requests]
    served, missing = {}, {}
    for done, plan in enumerate(plans):
        if done and done % 16 == 0:
            say(f"alone: {done} of {len(plans)} requests done")
        while stepped.cache.evict_cached_blocks():
            pass
        run = drive(stepped, plan)
        served.update(run.served)
        missing.update(run.missing)
    return PlanRun(served, missing, stepped.folder)


def require_stepping() -> None:
    """Unavailable (exit 3) where this transformers has no continuous batching kvfid reads, or
    its manager lacks what `Stepped` calls."""
    require()
    lacking = [f"{kind.__name__}.{name}" for kind, names in STEPPING.items() for name in names
               if not hasattr(kind, name)]
    if lacking:
        raise Unavailable(f"this transformers' continuous batching has no {', '.join(lacking)}: "
                          "kvfid steps its batch processor as transformers 5.25's loop does")


def load_config(model: str, dtype: str, plan: LoadPlan, kv_blocks: int | None, chunk: int | None,
                faithful: bool, prefix_caching: bool, threads: int | None) -> EngineConfig:
    """A load run's manager (`kv_blocks` None: the alone runs', its default cache size), or
    BadInput (exit 2) saying in one line why this engine cannot run the plan."""
    sampled = [r for r in plan.requests if not r.greedy]
    if sampled:
        raise BadInput(f"--greedy-share {plan.shape.greedy_share:g}: --engine transformers samples "
                       "greedily only (one sampler draws for the whole batch, no seed per request); "
                       "use --greedy-share 1")
    max_len = plan.longest + 1
    config = EngineConfig(model, dtype, max_len, prefix_caching=prefix_caching,
                          chunk=chunk or max(max_len + 1, DEFAULT_BUDGET), faithful=faithful,
                          kv_blocks=kv_blocks, block_size=BLOCK, threads=threads)
    why = refusal(config)
    if why:
        raise BadInput(f"--engine transformers: {why}")
    need = -(-plan.longest // BLOCK)
    if kv_blocks is not None and kv_blocks < need:
        raise BadInput(f"--kv-blocks {kv_blocks}: the longest request ({plan.longest} positions) "
                       f"needs at least {need} blocks of {BLOCK}")
    return config


def engine_load(model_name: str, dtype: str, shape: LoadShape, seed: int = 0, kv_blocks: int = 24,
                chunk: int | None = None, faithful: bool = False, prefix_caching: bool = True,
                threads: int | None = None, server: bool = False, sweep=None, faults=None,
                progress=None, kv_cache_dtype: str = "auto") -> EngineLoadRecord:
    """The load run's record (the module docstring); refused in one line before any manager
    starts where this engine cannot run it (a sampled plan, a server, a sweep, a budget too small)."""
    say = progress or (lambda _: None)
    if server:
        raise BadInput("--server: transformers serve is not driven by kvfid (the load runs in process)")
    if sweep is not None:
        raise BadInput("--sweep: offered for vLLM only (its recording scheduler counts co-residents)")
    plan = plan_load(shape, seed)
    config = load_config(model_name, dtype, plan, kv_blocks, chunk, faithful, prefix_caching, threads)
    require_stepping()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvfid-load-") as work:
        say(f"load: {len(plan.requests)} requests from {shape.clients} clients, {kv_blocks} KV blocks "
            f"of {BLOCK}, {config.chunk} tokens per step")
        with manager(config, looping=False) as made:
            stepped = Stepped(made, Path(work) / "load")
            load_run = drive(stepped, plan, say)
            counts = {"evictions": stepped.evictions, "offloads": stepped.offloads}
        again = [r for r in plan.requests if r.index not in load_run.missing]
        say(f"alone: {len(again)} requests, one at a time")
        with manager(config.with_(kv_blocks=None), looping=False) as made:
            alone_run = alone(Stepped(made, Path(work) / "alone"), again, say)
        parts = compared(plan, load_run, alone_run)
    record = EngineLoadRecord(model_name, dtype, version(), faithful, "in-process", seed, shape.clients,
                              shape.tokens, kv_blocks, config.chunk, prefix_caching, threads=threads,
                              greedy_share=shape.greedy_share, engine_name="transformers",
                              block_size=BLOCK, pressure=PRESSURE, **counts, **parts)
    return replace(record, wall_s=time.perf_counter() - start,
                   status="incomplete" if record.missing else "ok")


@contextlib.contextmanager
def stepped_manager(config: EngineConfig):
    """A manager made without its loop and a Stepped over it reading nothing (for timing)."""
    require_stepping()
    with manager(config, looping=False) as made:
        yield Stepped(made, None)
