"""`kvfid engine-load` and `kvfid engine-bench` with `--engine transformers`, on tiny-llama, on CPU:
12 greedy requests from 6 clients under 17 blocks of 32 tokens (what forces this engine to evict
its cached blocks and soft-reset requests), stepped on the caller's thread. Faithful: every request
equals itself alone in tokens, logprob bits and K/V, the soft-reset ones included, and each
preemption's live state equals what the re-prefill rebuilt; stock (the negative control): some
request differs, recorded and stored with what the engine did under pressure. The price tables
of engine-bench (plain and --load). What it cannot run: one line, exit 2, nothing stored."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.engines import transformers_batching
from kvfid.engines.transformers_load import PRESSURE, require_stepping
from kvfid.errors import Unavailable
from kvfid.records.read import from_json


def _refused() -> str | None:
    try:
        require_stepping()
    except Unavailable as err:
        return str(err)
    return None


# What the engine reads and steps is transformers 5.25's continuous batching; an older one is
# refused in one line (tests/engines/test_transformers_engine.py holds that).
runs_here = pytest.mark.skipif(_refused() is not None, reason=f"{_refused()}")

LOAD = ["engine-load", "--engine", "transformers", "--model", "tiny-llama", "-n", "12", "--clients",
        "6", "--tokens", "8", "--kv-blocks", "17", "--threads", "1", "--format", "json"]


def _load(tmp_path_factory, *extra):
    db = tmp_path_factory.mktemp("tf-load") / "ledger.sqlite"
    shown = CliRunner().invoke(main, [*LOAD, "--db", str(db), *extra])
    return shown, db


@pytest.fixture(scope="module")
def faithful(tmp_path_factory):
    return _load(tmp_path_factory, "--faithful")


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return _load(tmp_path_factory)


@runs_here
def test_faithful_under_block_pressure_every_request_equals_itself_alone(faithful):
    shown, db = faithful
    assert shown.exit_code == 0, shown.output
    record = from_json(shown.stdout)
    assert record.engine_name == "transformers" and record.faithful and record.complete and db.is_file()
    assert len(record.requests) == 12 and record.greedy_share == 1.0      # its plans are greedy
    preempted = [r for r in record.requests if r.preemptions]
    assert preempted and record.evictions > 0 and record.offloads == 0, record   # pressure reached
    assert sum(r.recomputed for r in record.requests) > 0
    assert max(r.coresident for r in record.requests) > 1
    for r in record.requests:
        assert r.tokens_equal and r.logprobs == 8 and r.logprobs_differ == 0, r
        assert r.kv is not None and r.kv.exact and r.kv.positions >= r.prompt, r
        assert all(d.exact for d in r.resumed), r
    assert sum(len(r.resumed) for r in preempted) > 0 and record.exact


@runs_here
def test_stock_differs_and_is_recorded_with_what_pressure_did(stock):
    """The negative control of the faithful run: the same plan, schedule and pressure on the stock
    engine; requests batched with others differ from themselves alone in bf16 on this CPU."""
    shown, db = stock
    assert shown.exit_code == 1, shown.output             # a verdict: some request differs
    record = from_json(shown.stdout)
    assert not record.faithful and record.complete and not record.exact and db.is_file()
    assert record.pressure == PRESSURE and record.block_size == 32 and record.kv_blocks == 17
    assert any(r.preemptions for r in record.requests) and record.evictions > 0
    assert sum(r.differs for r in record.requests) > 0
    assert all(r.kv is not None for r in record.requests)


@runs_here
def test_the_stored_run_reports_the_engine_and_the_command_again(stock, tmp_path):
    _, db = stock
    shown = CliRunner().invoke(main, ["engine-report", "latest", "--db", str(db), "--out", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    assert "kvfid engine-load --engine transformers --model tiny-llama" in shown.output
    assert "--greedy-share 1" in shown.output and "17 blocks of 32 tokens" in shown.output
    assert "soft-resets" in shown.output and "cached blocks evicted" in shown.output


@runs_here
def test_engine_bench_prices_the_faithful_engine():
    shown = CliRunner().invoke(main, ["engine-bench", "--engine", "transformers", "--model",
                                      "tiny-llama", "-n", "2", "--tokens", "3", "--threads", "1"])
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert "transformers 5" in lines[0] and "2 prompts x 3 tokens" in lines[0]
    assert [line.split()[0] for line in lines[2:4]] == ["stock", "faithful"]
    assert lines[4].startswith("  stock / faithful: prefill ")


@runs_here
def test_engine_bench_under_load():
    shown = CliRunner().invoke(main, ["engine-bench", "--engine", "transformers", "--model",
                                      "tiny-llama", "-n", "4", "--tokens", "3", "--load", "2",
                                      "--kv-blocks", "17", "--threads", "1"])
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert "4 requests from 2 clients x 3 tokens, 17 KV blocks" in lines[0]
    assert [line.split()[0] for line in lines[2:4]] == ["stock", "faithful"]


@pytest.mark.parametrize("args, said", [
    (["--server"], "engine-load --server is not offered by this engine"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3 is not offered by this engine"),
    (["--greedy-share", "0.5"], "samples greedily only"),
    (["--sweep"], "--sweep: offered for vLLM only"),
    (["--kv-blocks", "8"], "--kv-blocks 8: the longest request")])
@runs_here
def test_what_it_cannot_run_is_one_line_and_exit_2(args, said, tmp_path):
    db = tmp_path / "never.sqlite"
    shown = CliRunner().invoke(main, ["engine-load", "--engine", "transformers", "--model",
                                      "tiny-llama", "--db", str(db), *args])
    assert shown.exit_code == 2 and said in shown.output, shown.output
    assert len(shown.output.strip().splitlines()) == 1 and not db.exists()


def test_a_transformers_without_what_the_load_run_steps_is_refused_in_one_line(monkeypatch, tmp_path):
    class Older:     # 5.17's ContinuousBatchingConfig: a `block_size`, no `page_size`
        def __init__(self, block_size: int = 256):
            self.block_size = block_size

    monkeypatch.setattr(transformers_batching, "ContinuousBatchingConfig", Older)
    db = tmp_path / "ledger.sqlite"
    shown = CliRunner().invoke(main, ["engine-load", "--engine", "transformers", "--model",
                                      "tiny-llama", "-n", "2", "--db", str(db)])
    assert shown.exit_code == 3, shown.output
    said = shown.output.strip().splitlines()
    assert len(said) == 1 and "predates" in said[0] and not db.exists(), shown.output
