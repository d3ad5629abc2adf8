"""The recording scheduler: vLLM's own V1 scheduler, unchanged in what it decides, subclassed
through vLLM's public extension point (`scheduler_cls`) to write down what load does to each
request. vLLM imports it by its qualified name (`SCHEDULER`) in the engine's process, in this
one or in the process of vLLM's own OpenAI server, and it writes into the folder `$KVFID_LOAD_DIR`:

- `requests.jsonl`, one line per request when it leaves the engine (finished or aborted): its
  engine id, status, the steps it was scheduled in, tokens scheduled, the largest number of
  sequences sharing one of its steps (co-resident), each admission's prefix-cache hit (the first
  and every resume), and each preemption's computed length;
- per request its engine state (each layer's K and V read out of the paged cache by
  kvfid.engines.kv) over the positions it holds when it leaves (`<n>-final.pt`) and just before
  each preemption frees its blocks (`<n>-preempted-<i>.pt`): the live tail a resume rebuilds.

In process (kvfid's
engines: vLLM-CPU's one-rank executor in the caller's process) the scheduler and the worker share
a process, so the paged cache is read in place, between steps: vLLM's scheduler runs after the
last step's output and before the next step (asynchronous scheduling would overlap them; the
load run turns it off). vLLM's OpenAI server runs its worker in another process than its
scheduler: there no state is read, and each line's `kv_note` says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from vllm.v1.core.sched.scheduler import Scheduler

from kvfid.engines.kv import layers_of, read_blocks
from kvfid.engines.load_compare import Seen, save_state

DIR_ENV = "KVFID_LOAD_DIR"
STATES_ENV = "KVFID_LOAD_STATES"       # "0": no engine states read (the sweep counts only)
SCHEDULER = f"{__name__}.RecordingScheduler"
REQUESTS = "requests.jsonl"


class RecordingScheduler(Scheduler):
    """vLLM's scheduler; it also records each request's preemptions, recompute, prefix-cache
    hits, co-residents and engine states (the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kvfid_folder = Path(os.environ[DIR_ENV])
        self.kvfid_folder.mkdir(parents=True, exist_ok=True)
        self.kvfid_seen: dict[str, Seen] = {}
        self.kvfid_kv_note: str | None = None

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        counts = out.num_scheduled_tokens
        admitted = {r.req_id for r in out.scheduled_new_reqs} | set(out.scheduled_cached_reqs.resumed_req_ids)
        for request_id, n in counts.items():
            seen = self.kvfid_seen.setdefault(request_id, Seen())
            seen.steps += 1
            seen.scheduled += n
            seen.coresident = max(seen.coresident, len(counts))
            if request_id in admitted:     # its computed tokens were advanced by this step's n
                seen.cache_hits.append(self.requests[request_id].num_computed_tokens - n)
        return out

    def _preempt_request(self, request, *args, **kwargs):
        seen = self.kvfid_seen.setdefault(request.request_id, Seen())
        seen.preempted_at.append(request.num_computed_tokens)
        seen.states.append(self._save_state(request, f"preempted-{len(seen.preempted_at)}"))
        return super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request, *args, **kwargs):
        seen = self.kvfid_seen.pop(request.request_id, Seen())
        final = self._save_state(request, "final")
        line = seen.line(request_id=request.request_id, status=str(request.status.name),
                         prompt=len(request.prompt_token_ids or ()), output=len(request.output_token_ids),
                         computed=request.num_computed_tokens, final_state=final,
                         kv_note=self.kvfid_kv_note)
        with open(self.kvfid_folder / REQUESTS, "a") as out:
            out.write(json.dumps(line) + "\n")
        return super()._free_request(request, *args, **kwargs)

    def _save_state(self, request, tag: str) -> str | None:
        """The request's K and V over its computed positions, saved; the file's name or None."""
        length = request.num_computed_tokens
        if length == 0 or os.environ.get(STATES_ENV) == "0":
            return None
        try:
            layers = layers_of(self.vllm_config.compilation_config)
            if not layers or layers[0].kv_cache is None or not torch.is_tensor(layers[0].kv_cache):
                raise RuntimeError("no attention layer with a paged cache in the scheduler's process "
                                   "(vLLM's server runs its worker apart from it)")
            block_ids = list(self.kv_cache_manager.get_block_ids(request.request_id)[0])
            keys, values = read_blocks(layers, block_ids, length)
        except Exception as err:   # a layout or executor kvfid cannot read: said, not guessed
            self.kvfid_kv_note = f"{type(err).__name__}: {str(err)[:200]}"
            return None
        return save_state(self.kvfid_folder, f"{_safe(request.request_id)}-{tag}.pt",
                          request.all_token_ids[:length], keys, values)


def _safe(request_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in request_id)
