"""The engine commands without an engine: `kvfid engine-check` and `kvfid rollouts --engine vllm`
exit 3 with the line that installs vLLM; `--server` refuses a bad URL (2) and an absent server
(3); the in-engine comparison counts one flipped bit (its negative control). The engine itself is
tested by tests/engines/with_vllm (`make test-vllm`)."""

from __future__ import annotations

import socket
import sys

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.engines.bits import compare_logprobs


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)   # `import vllm` raises ImportError


@pytest.mark.parametrize("args", [["engine-check", "--model", "smollm2-135m"],
                                  ["engine-check", "--kv", "--faithful", "--model", "smollm2-135m"],
                                  ["engine-check", "--faithful", "--block-size", "default"],
                                  ["engine-check", "--faithful", "--block-size", "128"],
                                  ["engine-bench", "--model", "smollm2-135m"],
                                  ["engine-bench", "--threads", "1", "--model", "smollm2-135m"],
                                  ["engine-bench", "--load", "4", "--model", "smollm2-135m"],
                                  ["engine-load", "--model", "smollm2-135m", "--db", "never.sqlite"],
                                  ["engine-load", "--faithful", "--server", "--model", "smollm2-135m",
                                   "--db", "never.sqlite"],
                                  ["rollouts", "--engine", "vllm", "--model", "smollm2-135m",
                                   "--out", "never.jsonl"],
                                  ["rollouts", "--engine", "vllm", "--faithful", "--model",
                                   "smollm2-135m", "--out", "never.jsonl"]])
def test_without_vllm_the_commands_exit_3_saying_how_to_install_it(no_vllm, args, tmp_path,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(main, args)
    assert shown.exit_code == 3, shown.output
    assert "make install-vllm" in shown.output and len(shown.output.strip().splitlines()) == 1
    assert not (tmp_path / "never.jsonl").exists() and not (tmp_path / "never.sqlite").exists()


def test_faithful_is_for_the_vllm_llm_only(tmp_path):
    shown = CliRunner().invoke(main, ["rollouts", "--faithful", "--model", "tiny-llama", "-n", "1",
                                      "--out", str(tmp_path / "r.jsonl")])
    assert shown.exit_code == 2 and "--engine NAME" in shown.output, shown.output
    assert not (tmp_path / "r.jsonl").exists()


def test_server_refusals(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]       # closed again: nothing listens there
    base = ["rollouts", "--model", "tiny-llama", "-n", "1", "--out", str(tmp_path / "r.jsonl")]
    absent = CliRunner().invoke(main, base + ["--server", f"http://127.0.0.1:{port}"])
    assert absent.exit_code == 3 and "no answer" in absent.output
    bad = CliRunner().invoke(main, base + ["--server", "127.0.0.1:8000"])
    assert bad.exit_code == 2 and "http://" in bad.output


def test_the_in_engine_comparison_is_bitwise():
    a = [[-1.0, -2.0, -0.5], [-3.0]]
    same = compare_logprobs("same", a, [list(x) for x in a])
    assert same.differ == 0 and same.items_exact == 2 and same.tokens == 4 and same.exact
    flipped = [[-1.0, -2.0000002, -0.5], [-3.0]]      # one fp32 ulp at -2
    other = compare_logprobs("flipped", a, flipped)
    assert other.differ == 1 and other.items_exact == 1 and 0 < other.max_abs < 1e-6
    assert not other.exact
    served = compare_logprobs("served", a, [[None, -2.0000002, -0.5], [-3.0]])   # None: served by the cache
    assert served.tokens == 3 and served.differ == 1


def test_the_engines_torch_threads_are_set_and_restored():
    import torch

    from kvfid.engines.vllm_llm import torch_threads

    before = torch.get_num_threads()
    with torch_threads(1) as used:
        assert used == torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with torch_threads(None) as used:
        assert used == before


@pytest.mark.parametrize("args, said", [
    (["--chunk", "64"], "--chunk 64 with seeded sampling"),
    (["--chunk", "48", "--greedy-share", "1"], "a multiple of 32"),
    (["--kv-blocks", "8"], "--kv-blocks 8: the longest request"),
    (["--kill-server-after", "3"], "--kill-server-after needs --server")])
def test_engine_load_refuses_before_any_engine(no_vllm, args, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(main, ["engine-load", "--db", "never.sqlite", *args])
    assert shown.exit_code == 2 and said in shown.output, shown.output
    assert not (tmp_path / "never.sqlite").exists()


@pytest.mark.parametrize("value", ["0", "x", "-32"])
def test_a_bad_block_size_is_a_usage_error(value):
    shown = CliRunner().invoke(main, ["engine-check", "--block-size", value])
    assert shown.exit_code == 2 and "--block-size" in shown.output, shown.output

