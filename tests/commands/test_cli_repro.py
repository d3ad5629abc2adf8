"""`kvfid repro` and `kvfid models` through click's runner: JSON equals the library's record."""

import json

import pytest
from click.testing import CliRunner

from kvfid.stacks.stack import Stack
from kvfid.cli import main
from kvfid.environment import envinfo
from kvfid.diagnoses.repro import Repro, difference_kind, settle_in_fp32, verdict
from kvfid.protocol.protocol import ItemPlan, parse_transplant, run_item
from protocol_fixtures import tiny
from kvfid.inputs.items import Item, match_answer

TIMING_KEYS = {"wall_s", "forward_s", "overhead", "setup_s", "warmup_s"}


def strip_timing(value):
    """Drop wall-clock fields, which differ run to run; keep everything measured in bits."""
    if isinstance(value, dict):
        return {k: strip_timing(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [strip_timing(v) for v in value]
    return value


def test_repro_json_matches_the_library_record():
    args = ["repro", "--model", "tiny-llama", "--prompt", "What is 2+2?", "--dtype", "bf16",
            "-B", "6", "-S", "5", "--arms", "live,prefill,chunked:4", "--replicas", "prefill",
            "--transplant", "live<-prefill:keys", "--format", "json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    from_cli = json.loads(result.stdout)
    environment, key = from_cli.pop("environment"), from_cli.pop("environment_key")
    assert key == envinfo.environment_key(environment) and environment["versions"]["torch"]
    shown = from_cli.pop("verdict")
    plan = ItemPlan(6, 5, ("live", "prefill", "chunked:4"), ("prefill",),
                    (parse_transplant("live<-prefill:keys"),))
    item, stack = Item("prompt", "What is 2+2?"), Stack("sdpa", "bf16")
    from_library = run_item(tiny(), stack, item, plan, matcher=match_answer)
    from_library = settle_in_fp32(Repro(tiny(), stack, item, plan, []), from_library)
    assert shown == verdict(from_library)
    assert from_cli.pop("difference") == difference_kind(from_library)
    expected = json.loads(from_library.to_json())
    assert expected.pop("environment") is None      # a run's record: the run carries it
    assert strip_timing(from_cli) == strip_timing(expected)


def test_repro_text_names_the_verdicts():
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-qwen2", "--prompt", "hi",
                                       "-B", "4", "-S", "4", "--transplant", "prefill<-live"])
    assert result.exit_code == 0, result.output
    for text in ("live ~ prefill", "live ~ incremental  [bridge]", "cache", "suffix",
                 "prefill<-live:all", "overhead"):
        assert text in result.output


def test_repro_takes_an_item_from_an_item_set():
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--item-set", "arith",
                                       "--item", "3", "-B", "3", "-S", "3", "--format", "json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["item"]["id"] == "arith-0003" and record["item"]["answer"] is not None


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-9"], "valid: tiny-llama"),
    (["--backend", "flash"], "valid: sdpa, eager, triton"),
    (["--dtype", "int4"], "valid: bf16, fp16, fp32"),
    (["--arms", "live,decode"], "valid: live, prefill"),
    (["-B", "0"], "must be positive"),
    (["-S", "-3"], "must be positive"),
    (["-B", "5000"], "exceeds the model's context"),
    (["--transplant", "live<prefill"], "RECIPIENT<-DONOR"),
])
def test_bad_input_exits_2_with_the_valid_names(args, message):
    base = ["repro", "--model", "tiny-llama", "--prompt", "x"]
    result = CliRunner().invoke(main, base + args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_prompt_and_item_set_are_exclusive():
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama"])
    assert result.exit_code == 2 and "exactly one of --prompt" in result.output


def test_cuda_device_without_cuda_exits_3():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--prompt", "x",
                                       "--device", "cuda"])
    assert result.exit_code == 3


def test_models_lists_every_preset_with_availability():
    result = CliRunner().invoke(main, ["models", "--format", "json"])
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert {"tiny-llama", "tiny-qwen2", "tiny-mistral", "smollm2-135m",
            "qwen2.5-0.5b-shape", "llama-3.2-1b-shape"} <= set(rows)
    assert rows["tiny-llama"]["available"] is True


REPRO = ["repro", "--model", "tiny-llama", "--prompt", "What is 2+2?", "-B", "4", "-S", "4"]


@pytest.mark.parametrize("options, expect, code", [
    # incremental decoding is live's own construction: same bits, whatever the machine
    (["--arms", "live,incremental"], "bit-exact", 0),
    (["--arms", "live,incremental"], "diverges", 1),
    # the twin's split-KV count follows the call's shape: prefill differs on every machine
    (["--backend", "twin", "--arms", "live,prefill"], "diverges", 0),
    (["--backend", "twin", "--arms", "live,prefill"], "bit-exact", 1),
    (["--arms", "live"], "bit-exact", 1),                   # nothing compared: no verdict
])
def test_expect_exits_1_when_the_verdict_is_otherwise(options, expect, code):
    result = CliRunner().invoke(main, REPRO + options + ["--expect", expect, "--format", "json"])
    assert result.exit_code == code, result.output
    record = json.loads(result.stdout)
    assert (record["verdict"] == expect) == (code == 0)


def test_repro_text_ends_with_the_verdict():
    result = CliRunner().invoke(main, REPRO + ["--arms", "live,incremental"])
    assert result.exit_code == 0 and result.output.rstrip().endswith("verdict: bit-exact")


def test_verdict_counts_only_comparisons_with_live():
    from dataclasses import replace

    from kvfid.records.record import CacheDiff, Comparison, ItemRecord, ItemRef, SuffixDiff

    same = dict(suffix=SuffixDiff(identical=True), cache=CacheDiff(bit_exact=True))
    differ = dict(suffix=SuffixDiff(identical=False, first_divergence=2),
                  cache=CacheDiff(bit_exact=True))
    record = ItemRecord(ItemRef("x"), "tiny-llama", {}, 2, 2, "ok", comparisons=(
        Comparison("live", "prefill", "arm", **same),
        Comparison("prefill", "prefill", "replica", **differ)))   # a replica pair
    assert verdict(record) == "bit-exact"
    record = replace(record, comparisons=(*record.comparisons,
                                          Comparison("live", "chunked:4", "arm", **differ)))
    assert verdict(record) == "diverges"
    assert verdict(replace(record, status="short", comparisons=())) is None
