"""One stack value from the command line down: `--stack LABEL` beside the separate options, one
checked set-up for the diagnoses (kvfid.diagnoses.subject), one option name for constructions."""

import json

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.diagnoses.subject import STACK_PARTS, command_stack
from kvfid.errors import BadInput
from kvfid.stacks.stack import Stack

TINY = ["--model", "tiny-llama", "--prompt", "What is 2+2?"]


def kvfid(*args):
    return CliRunner().invoke(main, list(args))


def test_a_label_names_the_stack_the_separate_options_name():
    assert command_stack("native/bf16+bi@t1") == Stack("native", "bf16", True, threads=1)
    assert command_stack(None, backend="native", dtype="bf16", batch_invariant=True,
                         threads=1) == Stack("native", "bf16", True, threads=1)
    assert command_stack("eager/fp32+bi+scan+compile@t2@tp2") == Stack(
        "eager", "fp32", True, threads=2, compiled=True, faithful_recurrence=False, tp=2)
    assert command_stack(None) == Stack()     # nothing given: the options' defaults
    # A separate option that says what the label says is no conflict; --device is in no label.
    assert command_stack("native/bf16+bi@t1", "cpu", batch_invariant=True, threads=1,
                         faithful_recurrence=True, tp=1) == Stack("native", "bf16", True, threads=1)


@pytest.mark.parametrize("given", [{"dtype": "fp32"}, {"backend": "sdpa"}, {"threads": 2},
                                   {"batch_invariant": False}, {"faithful_recurrence": False},
                                   {"compiled": True}, {"tp": 2}])
def test_a_separate_option_that_disagrees_with_the_label_is_refused(given):
    (field, value), = given.items()
    with pytest.raises(BadInput, match=f"--stack native/bf16\\+bi@t1 and {STACK_PARTS[field]}"):
        command_stack("native/bf16+bi@t1", **given)


def test_threads_the_label_leaves_unset_are_a_conflict_too():
    # `sdpa/bf16` says torch's own thread count; --threads 1 would make it sdpa/bf16@t1.
    with pytest.raises(BadInput, match="threads: None"):
        command_stack("sdpa/bf16", threads=1)


@pytest.mark.parametrize("command", [
    ["repro", *TINY],
    ["repro", *TINY, "--program", "packed:2x4+4"],
    ["blame", *TINY],
    ["replay", "missing.jsonl", "--model", "tiny-llama"],
])
def test_stack_with_a_conflicting_option_is_a_usage_error_in_each_diagnosis(command):
    result = kvfid(*command, "--stack", "sdpa/fp32@t1", "--dtype", "bf16")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--stack sdpa/fp32@t1 and --dtype bf16 disagree" in lines[0]


@pytest.mark.parametrize("flag", ["--threads", "--tp"])
def test_an_option_given_at_its_default_value_still_conflicts(flag):
    # given, not defaulted: `--tp 1` beside a label's @tp2 is two stacks
    result = kvfid("repro", *TINY, "--stack", "sdpa/fp32@t2@tp2", flag, "1")
    assert result.exit_code == 2 and "disagree" in result.output, result.output


def test_a_bad_label_is_one_line_and_exit_2():
    result = kvfid("repro", *TINY, "--stack", "sdpa-bf16")
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "--stack sdpa-bf16" in result.output


def test_stack_runs_what_the_separate_options_run():
    """The control: the same stack spelled both ways measures the same record, bit for bit;
    the old option name `--arms` still selects the constructions."""
    common = [*TINY, "-B", "3", "-S", "3", "--format", "json"]
    one = kvfid("repro", *common, "--stack", "sdpa/fp32@t1", "--constructions", "live,prefill")
    separate = kvfid("repro", *common, "--dtype", "fp32", "--threads", "1", "--arms",
                     "live,prefill")
    assert one.exit_code == 0 and separate.exit_code == 0, one.output + separate.output
    records = [json.loads(r.stdout) for r in (one, separate)]
    assert records[0]["stack"]["label"] == "sdpa/fp32@t1"
    assert list(records[0]["arms"]) == ["live", "prefill"]
    measured = [{"prefix_sha": r["prefix_sha"], "stack": r["stack"], "verdict": r["verdict"],
                 "arms": {name: (arm["cache_sha"], arm["logits_sha"], arm["suffix"])
                          for name, arm in r["arms"].items()}} for r in records]
    assert measured[0] == measured[1]


@pytest.mark.parametrize("command", ["repro", "replay"])
def test_one_option_name_for_constructions_the_old_one_hidden(command):
    shown = kvfid(command, "--help").output
    assert "--constructions" in shown and "--arms" not in shown
    assert "--stack LABEL" in shown
