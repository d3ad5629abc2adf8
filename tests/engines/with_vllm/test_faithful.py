"""The engine state and the faithful engine: vLLM's paged K/V read back exactly as its writer
stored them; the plugin installs through vLLM's extension points and restores them; the faithful
engine's constructions are bit-exact (logprobs and KV; stock vLLM's are not: test_engine.py); and
faithful rollouts replayed on kvfid's native batch-invariant stack give three gaps of exactly 0."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("vllm", reason="vLLM is not installed here; `make install-vllm`, then `make test-vllm`")

from kvfid.cli import main  # noqa: E402
from kvfid.engines import faithful as engine_faithful, kv as engine_kv  # noqa: E402
from kvfid.engines.check import engine_check, render  # noqa: E402

CONSTRUCTIONS = "prefill,chunked:8,cached:prompt,spec:2"


@pytest.mark.parametrize("isa, dtype", [("amx", torch.bfloat16), ("vec", torch.float32),
                                        ("vec", torch.bfloat16)])
def test_the_reader_inverts_vllms_writer(isa, dtype):
    """Random keys and values written by vLLM's own writer at scattered slots read back bitwise."""
    from vllm import _custom_ops as ops

    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX")
    block, heads, head, tokens = 32, 2, 64, 70
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(tokens, heads, head, generator=generator).to(dtype)     # [T, H, D]
    values = torch.randn(tokens, heads, head, generator=generator).to(dtype)
    table = torch.tensor([5, 2, 7])                                             # the request's blocks
    slots = table[torch.arange(tokens) // block] * block + torch.arange(tokens) % block
    cache = torch.zeros(8, heads, block, 2 * head, dtype=dtype)                # vLLM-CPU's layout
    k_cache, v_cache = cache.view(8, heads, 2 * block, head).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, k_cache, v_cache, slots, isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    where_k, where_v = engine_kv.paged_layout(isa, dtype, block, head)
    memory = cache[table].view(3, heads, 2, block * head)
    read_k = engine_kv.unpack_blocks(memory[:, :, 0], where_k, block, head)[:, :tokens]   # [H, T, D]
    read_v = engine_kv.unpack_blocks(memory[:, :, 1], where_v, block, head)[:, :tokens]
    assert torch.equal(read_k, keys.transpose(0, 1)) and torch.equal(read_v, values.transpose(0, 1))
    if dtype == torch.float32 or isa == "amx":   # the writer does not store plainly: a real inversion
        plain = cache[table].view(3, heads, 2 * block, head)[:, :, :block].permute(1, 0, 2, 3).flatten(1, 2)
        assert not torch.equal(plain[:, :tokens], keys.transpose(0, 1))


def test_the_plugin_is_an_entry_point_and_restores_what_it_overrides():
    from importlib.metadata import entry_points

    from vllm.model_executor import custom_op
    from vllm.model_executor.layers import utils
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvfid.kernels.invariant.mode import batch_invariant_mode

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("kvfid_faithful") == "kvfid.engines.faithful:register"
    engine_faithful.register()                       # without KVFID_FAITHFUL=1: nothing changes
    member, stock = AttentionBackendEnum.CPU_ATTN, utils.dispatch_cpu_unquantized_gemm
    assert not member.is_overridden() and batch_invariant_mode() is None
    with engine_faithful.installed():
        assert member.get_class().get_impl_cls().__name__ == "FaithfulAttentionImpl"
        assert utils.dispatch_cpu_unquantized_gemm is not stock
        assert custom_op.op_registry_oot["RMSNorm"].__name__ == "FaithfulRMSNorm"
        assert batch_invariant_mode() == engine_faithful.mode_impl()
    assert not member.is_overridden() and utils.dispatch_cpu_unquantized_gemm is stock
    assert member.get_class().get_impl_cls().__name__ == "CPUAttentionBackendImpl"
    assert "RMSNorm" not in custom_op.op_registry_oot and batch_invariant_mode() is None


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_faithful_engine_is_bit_exact_in_every_row(tiny_folder, dtype, tmp_path):
    faithful = engine_check(f"hf:{tiny_folder}", dtype, 2, 8, 32, kv=True, faithful=True)
    assert [r.construction for r in faithful.rows][-1] == "prefix cache cold vs warm"
    for row in faithful.rows:
        assert row.differ == 0 and row.tokens > 0, row
        assert row.kv.items_exact == row.kv.items == 2 and row.kv.n_diff == 0, row
    assert faithful.rows[-1].served_tokens >= 32
    text = render(faithful)
    assert "engine state" in text and "faithful" in text
    from kvfid.reports.engine_report import write_report
    from kvfid.tasks.engine_store import store_result

    stored = store_result(tmp_path / "ledger.sqlite", faithful)
    report = write_report(stored, tmp_path / "reports")["markdown"].read_text()
    assert "**Bit-exact**: every construction gave the same logprob bits and the same K and V" in report


@pytest.mark.parametrize("block_size", [None, 32, 64, 128], ids=["vllm-default", "32", "64", "128"])
def test_faithful_engine_is_bit_exact_at_every_block_size_vllm_accepts(tiny_folder, block_size):
    """Key tiles and spans are fixed by positions, not by KV blocks: every construction exact at
    vLLM-CPU's default block (none given) and at each size; sequences past the largest block, so
    the prefix cache serves full blocks and chunks cross block and tile edges."""
    result = engine_check(f"hf:{tiny_folder}", "bf16", 2, 140, 32, kv=True, faithful=True, threads=1,
                          block_size=block_size)
    assert result.block_size == (block_size or result.block_size) and result.block_size % 32 == 0
    for row in result.rows:
        assert row.differ == 0 and row.tokens > 0, (block_size, row)
        assert row.kv.items_exact == row.kv.items == 2 and row.kv.n_diff == 0, (block_size, row)
    assert result.rows[-1].served_tokens >= result.block_size


def test_a_block_size_vllm_refuses_is_refused_as_the_engine_starts(tiny_folder):
    """vLLM-CPU's attention takes blocks in multiples of 32 (the faithful backend inherits that):
    16 is refused in one line before any request."""
    from kvfid.errors import Unavailable

    with pytest.raises(Unavailable) as refused:
        engine_check(f"hf:{tiny_folder}", "bf16", 1, 4, 32, faithful=True, threads=1, block_size=16)
    assert "\n" not in str(refused.value) and "block size" in str(refused.value), refused.value


def test_what_the_faithful_attention_cannot_serve_is_refused_as_the_engine_starts(windowed_folder):
    """A sliding window: refused in one line when the engine starts, before any request."""
    from kvfid.engines import vllm_llm
    from kvfid.engines.seam import EngineConfig
    from kvfid.errors import Unavailable

    with pytest.raises(Unavailable) as refused:
        with vllm_llm.engine(EngineConfig(f"hf:{windowed_folder}", "bf16", faithful=True)):
            pytest.fail("the engine started")
    assert "\n" not in str(refused.value) and "does not serve a sliding window" in str(refused.value)


def _gaps(tiny_folder, tmp_path, *flags, dtype="fp32"):
    out = tmp_path / "r.jsonl"
    made = CliRunner().invoke(main, ["rollouts", "--engine", "vllm", *flags, "--model",
                                     f"hf:{tiny_folder}", "--dtype", dtype, "-n", "2",
                                     "--tokens", "10", "--temperature", "1.0", "--out", str(out)])
    assert made.exit_code == 0, made.output
    shown = CliRunner().invoke(main, ["replay", str(out), "--model", f"hf:{tiny_folder}",
                                      "--backend", "native", "--batch-invariant", "--dtype", dtype,
                                      "--constructions", CONSTRUCTIONS, "--format", "json"])
    assert shown.exit_code == 0, shown.output
    return json.loads(shown.stdout)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_faithful_rollouts_replay_with_three_gaps_of_exactly_zero(tiny_folder, tmp_path, dtype):
    """bf16 too: the trainer's model is the one transformers loads (rotary frequencies in fp32,
    as vLLM keeps them); with `module.to(bf16)` the engine gaps were 32/32 on SmolLM2."""
    result = _gaps(tiny_folder, tmp_path, "--faithful", dtype=dtype)
    engine = result["engine_aggregate"]
    assert set(engine) >= {"step-by-step", *CONSTRUCTIONS.split(",")}
    for name, gap in engine.items():                 # engine~step-by-step and engine~C
        assert gap["tokens"] > 0 and gap["differ"] == 0 and gap["max_abs"] == 0, (name, gap)
    for name, gap in result["aggregate"].items():    # step-by-step~C
        assert gap["differ"] == 0, (name, gap)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stock_rollouts_replay_with_an_engine_gap(tiny_folder, tmp_path, dtype):
    engine = _gaps(tiny_folder, tmp_path, dtype=dtype)["engine_aggregate"]
    assert engine["step-by-step"]["differ"] > 0


ENGINE_PROCESS = """
import os, sys
def info(worker):
    from kvfid.engines.kv import attention_layers
    from kvfid.kernels.invariant.mode import batch_invariant_mode
    return (os.getpid(), sorted({type(l.impl).__name__ for l in attention_layers(worker.model_runner)}),
            batch_invariant_mode())
if __name__ == "__main__":
    import vllm
    llm = vllm.LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=128,
                   block_size=32, compilation_config={"custom_ops": ["none"]})
    [(pid, impls, mode)] = llm.collective_rpc(info)
    print(pid != os.getpid(), impls, mode)
"""


def test_the_entry_point_installs_the_faithful_engine_in_vllms_engine_process(tiny_folder, tmp_path):
    """vLLM's own engine process (multiprocessing on), started with KVFID_FAITHFUL=1: the plugin
    loaded there runs kvfid's attention and mode (without the variable `register` changes
    nothing: the test above)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "engine_process.py"
    script.write_text(ENGINE_PROCESS)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_LOGGING_LEVEL": "ERROR",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "KVFID_FAITHFUL": "1"}   # the rpc is a function
    shown = subprocess.run([sys.executable, str(script), str(tiny_folder)], capture_output=True,
                           text=True, timeout=600, env=env)
    assert shown.returncode == 0, shown.stderr[-2000:]
    expected = f"True ['FaithfulAttentionImpl'] {engine_faithful.mode_impl()}"
    assert shown.stdout.strip().splitlines()[-1] == expected
