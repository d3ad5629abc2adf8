"""vLLM-CPU's fp8 K/V cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`): its bytes read back exactly
as vLLM's writer stored them; kvfid's paged attention reads them as vLLM stores them (the fp8
kind times the layer's scale), each request bit for bit the native path over those values alone;
the faithful engine with an fp8 cache exact in every construction, in the stored format and
dequantized, and really computing from the fp8 cache (its logprobs are not the bf16 cache's);
stock's decode-built fp8 cache is not its prefill-built one (the control); and an fp8 cache the
machine or the engine cannot keep is refused in one line before compute, nothing stored."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("vllm", reason="vLLM is not installed here; `make install-vllm`, then `make test-vllm`")

from kvfid.cli import main  # noqa: E402
from kvfid.engines import kv as engine_kv  # noqa: E402
from kvfid.engines.check import engine_check, render  # noqa: E402
from kvfid.kernels.attention import native, paged  # noqa: E402

KINDS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
BLOCK, HEADS, GROUP, HEAD = 32, 2, 2, 64


def _fp8_values(shape, kind, generator) -> torch.Tensor:
    """Random finite values every fp8 `kind` holds exactly (so the writer stores them as they
    are), as bf16 (also exact)."""
    bits = torch.randint(0, 256, shape, generator=generator, dtype=torch.int16).to(torch.uint8)
    values = bits.view(KINDS[kind]).float()
    return torch.where(values.isfinite(), values, torch.zeros_like(values)).to(torch.bfloat16)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_reader_inverts_vllms_fp8_writer(kind):
    """fp8-exact keys and values written by vLLM's own writer at scattered slots read back as the
    fp8 values themselves, bitwise; the fp8 layout is measured, not the bf16 one assumed."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(1)
    tokens = 70
    keys = _fp8_values((tokens, HEADS, HEAD), kind, generator)         # [T, H, D]
    values = _fp8_values((tokens, HEADS, HEAD), kind, generator)
    table = torch.tensor([5, 2, 7])
    slots = table[torch.arange(tokens) // BLOCK] * BLOCK + torch.arange(tokens) % BLOCK
    cache = torch.zeros(8, HEADS, BLOCK, 2 * HEAD, dtype=torch.uint8)   # vLLM-CPU keeps fp8 as bytes
    k_cache, v_cache = cache.view(8, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, k_cache, v_cache, slots, "vec", k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype=kind)
    where_k, where_v = engine_kv.paged_layout("vec", torch.uint8, BLOCK, HEAD, kind)
    memory = cache[table].view(3, HEADS, 2, BLOCK * HEAD).view(KINDS[kind])
    read_k = engine_kv.unpack_blocks(memory[:, :, 0], where_k, BLOCK, HEAD)[:, :tokens]   # [H, T, D]
    read_v = engine_kv.unpack_blocks(memory[:, :, 1], where_v, BLOCK, HEAD)[:, :tokens]
    assert read_k.dtype == KINDS[kind]
    assert torch.equal(read_k.float(), keys.transpose(0, 1).float())
    assert torch.equal(read_v.float(), values.transpose(0, 1).float())
    # the keys are not stored plainly: reading them as the values' layout would be wrong
    plain = engine_kv.unpack_blocks(memory[:, :, 0], where_v, BLOCK, HEAD)[:, :tokens]
    assert not torch.equal(plain.float(), keys.transpose(0, 1).float())


def _fp8_step(kind, requests, scales, seed=0):
    """A paged fp8 cache holding each request's keys (vLLM's writer, scattered blocks, scales
    `scales`), the step's queries, and per request the dense values the cache stands for."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // BLOCK) for _, n in requests) + 3
    cache = torch.zeros(blocks, HEADS, BLOCK, 2 * HEAD, dtype=torch.uint8)
    k_cache, v_cache = cache.view(blocks, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    order = torch.randperm(blocks, generator=generator).tolist()
    table = torch.zeros(len(requests), max(-(-n // BLOCK) for _, n in requests), dtype=torch.int32)
    dense, queries, starts = [], [], [0]
    for r, (q_len, length) in enumerate(requests):
        held = -(-length // BLOCK)
        table[r, :held] = torch.tensor([order.pop() for _ in range(held)])
        keys = torch.randn(length, HEADS, HEAD, generator=generator).to(torch.bfloat16)
        values = torch.randn(length, HEADS, HEAD, generator=generator).to(torch.bfloat16)
        slots = table[r].long()[torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK
        ops.cpu_attn_reshape_and_cache(keys, values, k_cache, v_cache, slots, "vec", k_scale=scales[0],
                                       v_scale=scales[1], kv_cache_dtype=kind)
        stored = [engine_kv.unpack_blocks(cache[table[r, :held].long()].view(held, HEADS, 2, -1)
                                          .view(KINDS[kind])[:, :, which], where, BLOCK, HEAD)[:, :length]
                  for which, where in enumerate(engine_kv.paged_layout("vec", torch.uint8, BLOCK, HEAD, kind))]
        # what the cache stands for: fp32(stored) * scale, [T, H, D]
        dense_k, dense_v = (s.float().mul(scale).transpose(0, 1) for s, scale in zip(stored, scales))
        query = torch.randn(q_len, HEADS * GROUP, HEAD, generator=generator).to(torch.bfloat16)
        dense.append((query, dense_k, dense_v))
        queries.append(query)
        starts.append(starts[-1] + q_len)
    return cache, table, torch.cat(queries).view(starts[-1], -1), starts, dense


@pytest.mark.parametrize("gathered", [False, True], ids=["view", "gathered"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_paged_attention_reads_the_fp8_cache_as_vllm_stores_it(kind, gathered):
    """Every request of a step (decodes stacked and alone, a prefill, a chunk) has the native
    path's bits over the values the fp8 cache stands for, alone; the control: the same bytes read
    without their scale give other bits (the scale is applied, not assumed 1). `gathered`: the
    layout read by its inverse permutation (how an AMX layout is read) instead of as a view."""
    from types import SimpleNamespace

    scales = (0.5, 2.0)                              # powers of two: the dense side holds them exactly
    requests = [(1, 1), (1, 65), (1, 200), (37, 37), (20, 150), (1, 64), (3, 97), (1, 33)]
    cache, table, query, starts, dense = _fp8_step(kind, requests, scales)
    where = engine_kv.paged_layout("vec", torch.uint8, BLOCK, HEAD, kind)
    layout = tuple(torch.argsort(w) for w in where) if gathered else paged.layouts(*where, BLOCK, HEAD)
    metadata = SimpleNamespace(query_start_loc=torch.tensor(starts, dtype=torch.int32),
                               seq_lens=torch.tensor([n for _, n in requests], dtype=torch.int32),
                               block_table=table)
    scale = HEAD ** -0.5
    out = torch.full((starts[-1], HEADS * GROUP * HEAD), float("nan"), dtype=torch.bfloat16)
    paged.paged_attention(out, query, cache, layout, metadata, HEADS * GROUP, scale,
                          stored=KINDS[kind], kv_scales=scales)
    for r, (q, k, v) in enumerate(dense):
        alone = native.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(torch.bfloat16),
                                 v.transpose(0, 1)[None].to(torch.bfloat16), scale=scale)
        alone = alone[0].transpose(0, 1).reshape(q.shape[0], -1)
        got = out[starts[r]:starts[r + 1]]
        assert torch.equal(got, alone), (r, requests[r], (got.float() - alone.float()).abs().max())
    unscaled = torch.zeros_like(out)
    paged.paged_attention(unscaled, query, cache, layout, metadata, HEADS * GROUP, scale,
                          stored=KINDS[kind], kv_scales=(1.0, 1.0))
    assert not torch.equal(unscaled, out)


def test_faithful_engine_with_an_fp8_cache_is_exact_in_every_construction(tiny_folder):
    """Faithful vLLM with an fp8_e4m3 cache: every construction 0 differing logprobs, the engine
    states equal in their stored bytes and scales and dequantized; the cache really is fp8 and
    really is read (the same engine with a bf16 cache gives other logprobs)."""
    fp8 = engine_check(f"hf:{tiny_folder}", "bf16", 2, 8, 32, kv=True, faithful=True, threads=1,
                       kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_cache_dtype == "fp8_e4m3" and fp8.label.endswith("+kv:fp8_e4m3")
    assert [r.construction for r in fp8.rows][-1] == "prefix cache cold vs warm"
    for row in fp8.rows:
        assert row.differ == 0 and row.tokens > 0, row
        assert row.kv.items_exact == row.kv.items == 2 and row.kv.n_diff == 0, row
        assert row.kv_dequantized is not None and row.kv_dequantized.exact, row
    assert fp8.rows[-1].served_tokens >= 32 and fp8.exact
    text = render(fp8)
    assert "fp8_e4m3 bytes and their scales" in text and "dequantized" in text
    bf16 = engine_check(f"hf:{tiny_folder}", "bf16", 2, 8, 32, faithful=True, threads=1)
    assert bf16.rows[0].kv_dequantized is None
    # same prompts and greedy tokens compared per position: the fp8 cache changes the numbers
    from kvfid.engines.seam import EngineConfig, started
    from kvfid.engines.registry import engine_for

    vllm = engine_for("vllm")
    prompt = [256, 72, 105, 33, 40, 41, 42, 43] * 5
    logprobs, kinds = {}, {}
    for kind in ("auto", "fp8_e4m3"):
        config = EngineConfig(f"hf:{tiny_folder}", "bf16", max_len=64, faithful=True, threads=1,
                              kv_cache_dtype=kind)
        with started(vllm, config) as running:
            made = running.generate([prompt], 6, ignore_eos=True)[0]
            state = running.read_states([made.request], [prompt + made.ids[:-1]])[0]
        logprobs[kind], kinds[kind] = made.logprobs, (state.keys[0].dtype, set(state.layers[0].parts))
    assert kinds["fp8_e4m3"] == (torch.float8_e4m3fn, {"k", "v", "k_scale", "v_scale"})
    assert kinds["auto"] == (torch.bfloat16, {"k", "v"})
    assert logprobs["auto"] != logprobs["fp8_e4m3"]


def test_stock_vllm_with_an_fp8_cache_is_not_exact(tiny_folder, tmp_path):
    """The control, in its own process at vLLM's own threads (as test_engine.py's bf16 control):
    stock vLLM-CPU with an fp8 cache gives decode and prefill re-scoring other logprob bits. Its
    fp8 K/V are read and compared in both formats; on this 2-layer model the fp32 K/V's few-ULP
    differences fall inside one fp8 step, so the stored bytes agree (measured), which is why the
    faithful test's exact K/V are asserted beside exact logprobs."""
    import os
    import subprocess
    import sys

    from kvfid.records.read import from_json

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: vLLM-CPU's attention does not split, decode and prefill may agree")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    shown = subprocess.run([sys.executable, "-m", "kvfid.cli", "engine-check", "--kv", "--model",
                            f"hf:{tiny_folder}", "--dtype", "fp32", "-n", "2", "--tokens", "8",
                            "--kv-cache-dtype", "fp8_e4m3", "--format", "json"],
                           capture_output=True, text=True, timeout=600,
                           env={**env, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert shown.returncode == 0, shown.stderr[-2000:]
    result = from_json(shown.stdout)
    assert result.kv_cache_dtype == "fp8_e4m3" and not result.exact
    decode = result.rows[0]
    assert decode.differ > 0 and decode.max_abs > 0
    for row in result.rows:            # both formats compared in every row, on the same positions
        assert row.kv is not None and row.kv_dequantized is not None
        assert row.kv.positions == row.kv_dequantized.positions > 0
        assert (row.kv.n_diff == 0) == (row.kv_dequantized.n_diff == 0)


def _refused(args, tmp_path):
    db = tmp_path / "ledger.sqlite"
    shown = CliRunner().invoke(main, [*args, "--db", str(db)])
    assert "Traceback" not in shown.output
    return shown, db


def test_an_fp8_cache_the_cpu_cannot_keep_is_refused_before_compute(tiny_folder, tmp_path, monkeypatch):
    """A CPU without AVX-512 or AMX: one line naming the option and vLLM's reason, exit 3,
    no engine started, nothing stored."""
    import vllm._custom_ops  # noqa: F401  (vLLM picks its C library by the ISA as it loads it:
    import vllm.v1.attention.backends.cpu_attn  # noqa: F401  both loaded before the ISA is hidden)

    from kvfid.engines import vllm_llm

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(vllm_llm, "engine", lambda *a, **k: pytest.fail("an engine was started"))
    shown, db = _refused(["engine-check", "--model", f"hf:{tiny_folder}", "--kv-cache-dtype",
                          "fp8_e5m2", "-n", "1", "--tokens", "2"], tmp_path)
    assert shown.exit_code == 3, shown.output
    line = shown.output.strip()
    assert "\n" not in line and "--kv-cache-dtype fp8_e5m2" in line and "AVX-512" in line
    assert not db.exists()
    shown, db = _refused(["engine-load", "--model", f"hf:{tiny_folder}", "--kv-cache-dtype",
                          "fp8_e4m3", "-n", "2"], tmp_path)
    assert shown.exit_code == 3 and "--kv-cache-dtype fp8_e4m3" in shown.output, shown.output
    assert not db.exists()


def test_an_fp8_cache_an_engine_does_not_offer_is_a_usage_error(tiny_folder, tmp_path):
    shown, db = _refused(["engine-check", "--engine", "transformers", "--model", "tiny-llama",
                          "--kv-cache-dtype", "fp8_e4m3", "-n", "1", "--tokens", "2"], tmp_path)
    assert shown.exit_code == 2, shown.output
    assert "--engine transformers: --kv-cache-dtype fp8_e4m3 is not offered" in shown.output
    assert not db.exists()
    shown, _ = _refused(["engine-check", "--model", f"hf:{tiny_folder}", "--kv-cache-dtype", "fp8"],
                        tmp_path)
    assert shown.exit_code == 2 and "fp8_e4m3" in shown.output
    out = tmp_path / "rollouts.jsonl"
    shown = CliRunner().invoke(main, ["rollouts", "--model", "tiny-llama", "--kv-cache-dtype",
                                      "fp8_e4m3", "--out", str(out)])
    assert shown.exit_code == 2 and "--kv-cache-dtype fp8_e4m3 is for a serving engine" in shown.output
    assert not out.exists()


def test_faithful_engine_load_with_an_fp8_cache_equals_alone(tiny_folder, tmp_path):
    """engine-load's plan under a KV budget that preempts, faithful with an fp8_e4m3 cache: every
    request's tokens, logprobs and fp8 K/V (saved as the bytes' fp8 kind) equal its alone run."""
    from kvfid.engines.load import run_load
    from kvfid.engines.load_plan import LoadShape, plan_load

    shape = LoadShape(requests=6, clients=4, tokens=12, short=(8, 40), long=(100, 180), prefixes=1,
                      prefix_length=64, prefix_share=0.5, mean_gap=1.0)
    plan = plan_load(shape, seed=3)
    parts = run_load(str(tiny_folder), "bf16", plan, 8, faithful=True, threads=1, work=tmp_path,
                     kv_cache_dtype="fp8_e4m3")
    rows = parts["requests"]
    assert len(rows) == 6 and not any(r.missing for r in rows)
    assert all(r.kv is not None and r.kv.positions > 0 for r in rows), parts["notes"]
    assert any(r.preemptions for r in rows), "the KV budget forced no preemption"
    assert not any(r.differs for r in rows), [(r.index, r.first_logprob_step, r.kv) for r in rows]
    saved = torch.load(next((tmp_path / "load").glob("*.pt")))
    assert saved["keys"][0].dtype == torch.float8_e4m3fn


def test_the_fp8_cache_is_one_setting_for_the_engine_and_its_server(tiny_folder):
    """The config's stored format becomes vLLM's `kv_cache_dtype` in the one translation
    (vllm_llm.settings), hence the server's `--kv-cache-dtype` flag; `auto` sets nothing."""
    from kvfid.engines import vllm_llm
    from kvfid.engines.load_server import server_command
    from kvfid.engines.seam import EngineConfig

    config = EngineConfig(f"hf:{tiny_folder}", "bf16", kv_cache_dtype="fp8_e5m2")
    assert vllm_llm.settings(config, str(tiny_folder))["kv_cache_dtype"] == "fp8_e5m2"
    assert "kv_cache_dtype" not in vllm_llm.settings(config.with_(kv_cache_dtype="auto"), str(tiny_folder))
    command = server_command(str(tiny_folder), "bf16", config, 128, 8000)
    assert command[command.index("--kv-cache-dtype") + 1] == "fp8_e5m2"
    assert "fp8_e5m2 KV cache" in config.label()


def test_rollouts_from_an_engine_with_an_fp8_cache_say_so(tiny_folder):
    """`rollouts --engine vllm --kv-cache-dtype fp8_e4m3`: sampled with the fp8 cache, one logprob
    per token, the stack label naming the stored format (a replay knows what produced them)."""
    from kvfid.engines.check import engine_rollouts

    rows = engine_rollouts("vllm", f"hf:{tiny_folder}", "arith", 2, 6, 0.8, 0, "bf16", faithful=True,
                           threads=1, kv_cache_dtype="fp8_e4m3")
    assert len(rows) == 2
    for row in rows:
        assert row["stack"].endswith("/bf16+faithful+kv:fp8_e4m3"), row["stack"]
        assert len(row["logprobs"]) == len(row["tokens"]) > 0
