"""An fp8 KV cache asked of what cannot keep one, without vLLM: an engine that does not offer it
(a stand-in; exit 2) and vLLM not installed (exit 3), on every command that takes
`--kv-cache-dtype`: one line naming the option or the install, nothing stored or written. vLLM
refusing it on a CPU without AVX-512 or AMX is tests/engines/with_vllm/test_fp8_cache.py's."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.engines.registry import register_engine, unregister_engine
from test_engine_seam import STAND_IN

COMMANDS = [["engine-check", "--db", "never.sqlite"], ["engine-load", "--db", "never.sqlite"],
            ["engine-bench"], ["rollouts", "--out", "never.jsonl"]]


@pytest.fixture
def stand_in():
    register_engine(STAND_IN)
    yield STAND_IN
    unregister_engine(STAND_IN.name)


def _run(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(main, args)
    assert len(shown.output.strip().splitlines()) == 1 and "Traceback" not in shown.output, shown.output
    assert not (tmp_path / "never.sqlite").exists() and not (tmp_path / "never.jsonl").exists()
    return shown


@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_an_engine_without_an_fp8_cache_refuses_it_in_one_line(stand_in, command, tmp_path, monkeypatch):
    shown = _run([command[0], "--engine", "stand-in", "--model", "tiny-llama", "--kv-cache-dtype",
                  "fp8_e4m3", *command[1:]], tmp_path, monkeypatch)
    assert shown.exit_code == 2, shown.output
    assert ("--kv-cache-dtype fp8_e4m3 is not offered by this engine" in shown.output
            or "engine-load is not offered" in shown.output)     # the stand-in has no load door


@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_without_vllm_an_fp8_cache_exits_3_saying_how_to_install_it(command, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)   # `import vllm` raises ImportError
    shown = _run([command[0], "--engine", "vllm", "--model", "smollm2-135m", "--kv-cache-dtype",
                  "fp8_e5m2", *command[1:]], tmp_path, monkeypatch)
    assert shown.exit_code == 3 and "make install-vllm" in shown.output, shown.output


def test_a_stored_format_that_is_none_is_a_usage_error(tmp_path, monkeypatch):
    """click's choice: its usage lines, then the one error line naming the option and the choices."""
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(main, ["engine-check", "--kv-cache-dtype", "int8", "--db", "never.sqlite"])
    assert shown.exit_code == 2 and not (tmp_path / "never.sqlite").exists()
    assert "Invalid value for '--kv-cache-dtype': 'int8' is not one of 'auto', 'fp8_e4m3', " \
           "'fp8_e5m2'" in shown.output
