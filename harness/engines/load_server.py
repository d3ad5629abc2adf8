"""A load run served by vLLM's own OpenAI-compatible server, started here and stopped at the end.

The server (`python -m vllm.entrypoints.openai.api_server`, its engine in its own process) is
started on 127.0.0.1 at a free port with the load run's engine configuration as flags, kvfid's
recording scheduler (`--scheduler-cls`, writing into the run's folder) and, under `--faithful`,
kvfid's plugin (`KVFID_FAITHFUL=1` and its compilation config). The server's worker runs apart
from its scheduler, so a served load run compares tokens and logprob bits, not engine states
(its record's note says so). Its worker is bound to `threads` cores (one by default), the count
the alone runs take: left to itself vLLM-CPU reserves a core in a server and binds the worker to
the rest, and a thread count can change the bits (the faithful engine's tiled GEMM route is per
count: SmolLM2 bf16 through the server at vLLM's binding against alone runs at two threads
differed in 16 of 16 requests). K client threads send the plan
over HTTP (`POST /v1/completions`, the prompt as token ids, `request_id` the planned one, the
sampled token's logprob and token ids back), each waiting its requests' gaps (`gap * step_s`
seconds). What goes wrong is recorded per request, never raised: a rejection (HTTP 4xx), a client
timeout, no answer from a server that died (`Faults.kill_after` kills it after that many answers,
to show what a dead server leaves). The server is stopped (its process group) whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvfid.engines import vllm_llm
from kvfid.engines.load import request_id
from kvfid.errors import Unavailable

START_LIMIT_S = 600
SERVED_NAME = "kvfid-load"


@dataclass(frozen=True)
class Faults:
    """How long a client waits, and failures to inject."""

    client_timeout_s: float = 600.0
    kill_after: int | None = None     # kill the server after this many answers
    step_s: float = 0.05              # seconds per planned gap step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(folder: str, dtype: str, config, max_len: int, port: int) -> list[str]:
    """vLLM's server with the load run's engine configuration (engine.engine's, as flags)."""
    made = vllm_llm.settings(config.with_(model=f"hf:{folder}", dtype=dtype, max_len=max_len,
                                             recording=True, block_size=vllm_llm.BLOCK), folder)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
    for name, value in made.items():       # vLLM's engine arguments are its server's flags
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else f"--no-{flag[2:]}")
        else:
            command += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return command


@contextlib.contextmanager
def server(folder: str, dtype: str, config, max_len: int, into: Path, threads: int):
    """vLLM's server running the configuration, its base URL and process; stopped on exit."""
    # lazy: vLLM is optional (.venv-vllm only)
    from kvfid.engines.load_scheduler import (
        DIR_ENV,  # lazy: vLLM is optional (.venv-vllm only)
    )

    into.mkdir(parents=True, exist_ok=True)
    port, log = _free_port(), into / "server.log"
    env = {**os.environ, DIR_ENV: str(into), "VLLM_BATCH_INVARIANT": "0", "PYTHONSAFEPATH": "1",
           "KVFID_FAITHFUL": "1" if config.faithful else "0"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)      # the server runs its engine in a child
    # its worker bound to `threads` cores, none reserved: the thread count the alone runs take
    # (left to itself, vLLM-CPU reserves a core in a server and binds the worker to the rest)
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    with open(log, "wb") as out:
        process = subprocess.Popen(server_command(folder, dtype, config, max_len, port), stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            if process.poll() is not None:
                raise Unavailable(f"vLLM's server exited at start ({process.returncode}): "
                                  f"{_tail(log)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            if time.monotonic() > deadline:
                raise Unavailable(f"vLLM's server not up within {START_LIMIT_S} s: {_tail(log)}")
            time.sleep(1)
        yield url, process
    finally:
        stop(process)


def stop(process) -> None:
    """The server and its engine (its own session) stopped: SIGTERM, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _tail(log: Path) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return " | ".join(text.strip().splitlines()[-3:])[-400:]


def ask(url: str, planned, timeout: float) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """One planned request over HTTP: its tokens and their logprobs (errors raised as they come)."""

    body = {"model": SERVED_NAME, "prompt": list(planned.prompt), "max_tokens": planned.tokens,
            "temperature": planned.temperature, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "ignore_eos": True, "skip_special_tokens": False,
            "request_id": request_id(planned.index)}
    if planned.seed is not None:
        body["seed"] = planned.seed
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        choice = json.loads(response.read().decode())["choices"][0]
    ids = tuple(int(i) for i in choice["token_ids"])
    return ids, tuple(float(v) for v in choice["logprobs"]["token_logprobs"])


def why(err: BaseException, process, timeout: float) -> str:
    """Why a request has no answer, in one line."""
    if isinstance(err, urllib.error.HTTPError):
        detail = err.read().decode(errors="replace")[:200].replace("\n", " ")
        return f"rejected by the server: HTTP {err.code} {detail}"
    if isinstance(err, (TimeoutError, socket.timeout)) or "timed out" in str(err):
        return f"client timeout: no answer within {timeout:g} s"
    with contextlib.suppress(subprocess.TimeoutExpired):   # a connection cut as the server dies
        process.wait(timeout=5)
    if process.poll() is not None:
        return f"no answer: the server died (exit {process.returncode})"
    return f"no answer: {type(err).__name__}: {str(err)[:160]}"


def clients(url: str, process, plan, faults: Faults) -> tuple[dict, dict, float]:
    """K client threads sending the plan; per index what was served, per index why it is missing."""
    served, missing, lock = {}, {}, threading.Lock()
    answers = [0]

    def client(requests) -> None:
        for planned in requests:
            time.sleep(planned.gap * faults.step_s)
            try:
                got = ask(url, planned, faults.client_timeout_s)
            except Exception as err:    # recorded per request, never raised
                with lock:
                    missing[planned.index] = why(err, process, faults.client_timeout_s)
                continue
            with lock:
                served[planned.index] = got
                answers[0] += 1
                if faults.kill_after is not None and answers[0] == faults.kill_after:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(q,), daemon=True) for q in plan.by_client()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return served, missing, time.perf_counter() - start


def serving(folder: str, dtype: str, threads: int, faults: Faults | None, say=lambda _: None):
    """load.run_load's `served_by`: the load served by vLLM's own server, its worker at
    `threads` threads (bound to the first `threads` cores)."""
    faults = faults or Faults()

    def serve(plan, config, max_len, into):
        say("starting vLLM's OpenAI server on 127.0.0.1")
        with server(folder, dtype, config, max_len, into, threads) as (url, process):
            say(f"server up at {url}; {plan.shape.clients} clients sending")
            served, missing, wall = clients(url, process, plan, faults)
        return served, missing, 0, wall
    return serve
