"""Stage programs (harness/stages/program.py, `kvfid repro --program`): the packed layout's
segments and positions, live vs rebuilt arms at the merge boundary (the faithful stack bit-exact,
the variant twin the control), the batched layout composing the packed state, and bad programs
refused in one line before compute."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.stages import program as stages, checks as stages_checks
from kvfid.stacks.stack import Stack
from protocol_fixtures import tiny

PROGRAM = "packed:2x3+2:parallel"  # two branches of 3 tokens, a merge of 2 (each after a delimiter)


def test_packed_layout_places_segments_and_positions():
    spec = stages.parse_program("packed:2x3+2:parallel")
    layout = stages.Layout.start(spec)
    layout.extend([1, 2, 3], 0)
    layout.extend([4, 5], 1)
    layout.extend([6, 7], 2)
    layout.extend([8], 3)
    assert layout.positions == [0, 1, 2, 3, 4, 3, 4, 5]  # branches restart, the merge continues
    assert layout.segments == [0, 0, 0, 1, 1, 2, 2, 3]
    rows = layout.mask(0, 8, __import__("torch").float32)[0, 0] == 0  # [8, 8] visible
    assert rows[5].tolist() == [True, True, True, False, False, True, False, False]  # branch 2
    assert rows[7].all()  # the merge sees everything
    continuing = stages.Layout.start(stages.parse_program("packed:2x3+2"))
    continuing.extend([1, 2], 0)
    continuing.extend([3], 1)
    continuing.extend([4], 2)
    assert continuing.positions == [0, 1, 2, 3]


def test_faithful_stack_is_bit_exact_at_the_merge_boundary_and_the_twin_is_caught():
    spec = stages.parse_program(PROGRAM)
    arms = ("live", "prefill", "chunked:5")
    faithful = stages.run_program(tiny(), Stack("native", "fp32", True), "2+3=", spec, 3, arms)
    assert [c.arm for c in faithful.comparisons] == ["prefill", "chunked:5"]
    for c in faithful.comparisons:
        assert c.bit_exact and c.logits.equal and c.suffix.identical, c
    assert [s.segment for s in faithful.segments] == ["prompt", "branch 1", "branch 2", "merge"]
    assert faithful.comparisons[0].segments_exact == dict.fromkeys(
        ["prompt", "branch 1", "branch 2", "merge"], True)
    # the control: the deliberately variant attention twin (split count from the call's shape)
    # under the same mode; stock sdpa/bf16 is a per-machine finding (docs/protocol.md), not a test
    twin = stages.run_program(tiny(), Stack("twin", "fp32", True), "2+3=", spec, 3, ("live", "prefill"))
    control = twin.comparisons[0]
    assert not control.bit_exact and control.first_bad_segment is not None
    assert not control.segments_exact[control.first_bad_segment]


def test_batched_layout_composes_the_packed_state_on_the_faithful_stack():
    """The branches decoded as rows give the packed program's tokens and, composed, its live
    state bit for bit; the packed prefill rebuilds it."""
    stack, arms = Stack("native", "fp32", True), ("live", "prefill")
    packed = stages.run_program(tiny(), stack, "2+3=", stages.parse_program(PROGRAM), 3, arms)
    batched = stages.run_program(tiny(), stack, "2+3=", stages.parse_program(
        PROGRAM.replace("packed", "batched")), 3, arms)
    assert batched.prefix_sha == packed.prefix_sha
    assert batched.arms["live"].cache_sha == packed.arms["live"].cache_sha
    assert batched.comparisons[0].bit_exact and batched.comparisons[0].suffix.identical


@pytest.mark.parametrize("layout", ["packed", "batched"])
def test_the_triton_kernel_is_bit_exact_at_the_merge_boundary_in_both_layouts(layout):
    """The Triton kernel (in the interpreter on a CPU) under the mode: the packed prefill's
    visibility-mask path and the live branches' causal calls give the merge boundary one state."""
    spec = stages.parse_program(PROGRAM.replace("packed", layout))
    done = stages.run_program(tiny(), Stack("triton", "fp32", True), "2+3=", spec, 2, ("live", "prefill"))
    comparison = done.comparisons[0]
    assert comparison.bit_exact and comparison.logits.equal, comparison
    assert all(comparison.segments_exact.values())


def test_repro_program_through_the_command_line():
    args = ["repro", "--model", "tiny-llama", "--prompt", "2+3=", "--backend", "native",
            "--dtype", "fp32", "--batch-invariant", "--program", PROGRAM, "-S", "2",
            "--arms", "live,prefill", "--replicas", "live,prefill", "--expect", "bit-exact",
            "--format", "json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["verdict"] == "bit-exact" and record["program"] == PROGRAM
    assert record["replicas"] == [{"arm": a, "bit_exact": True, "suffix_identical": True}
                                  for a in ("live", "prefill")]
    assert record["environment_key"]


def test_repro_program_text_names_the_twin_s_first_bad_segment():
    """`repro` with a layout, printed: the control stack's rebuilt arm differs from live, the
    first bad layer and segment named, the verdict diverges."""
    args = ["repro", "--model", "tiny-llama", "--prompt", "2+3=", "--backend", "twin", "--dtype",
            "fp32", "--batch-invariant", "--program", PROGRAM, "-S", "2", "--arms", "live,prefill",
            "--expect", "diverges"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.strip().startswith("prefill"))
    assert "differs" in row and any(name in row for name in ("prompt", "branch", "merge")), row
    assert "segments whose keys or values differ" in result.output
    assert result.output.rstrip().endswith("verdict: diverges")


@pytest.mark.parametrize("program, message", [
    ("packed:0x8+4", "an empty stage"),
    ("packed:3x0+4", "an empty stage"),
    ("packed:3x8+0", "an empty stage"),
    ("stacked:3x8+4", "layout 'stacked' is not available"),
    ("batched:3x8+4", "batched branches are rows from the prompt"),
    ("batched:10x2+2:parallel", "the branch delimiters differ in length"),
    ("packed:3x8+4:sideways", "positions 'sideways'"),
    ("packed:3x8", "spell it LAYOUT:NxL+M"),
    ("packed:16x400+8", "exceed the model's context"),
])
def test_bad_programs_exit_2_in_one_line_before_compute(program, message):
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--prompt", "x",
                                       "--program", program])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_a_model_with_local_layers_is_refused_in_one_line():
    from kvfid.stacks.serving import LayerInfo

    layers = [LayerInfo(0, "full_attention", "DynamicLayer", "full", ()),
              LayerInfo(1, "sliding_attention", "DynamicSlidingWindowLayer", "window",
                        ("sliding_window",), 4096)]
    with pytest.raises(stages_checks.ProtocolError, match="layer 1 is sliding_window"):
        stages_checks.check_layers(layers)
    stages_checks.check_layers(layers[:1])


@pytest.mark.parametrize("extra, message", [
    (["--arms", "live,batched:2"], "a stage program is rebuilt by"),
    (["--arms", "live,prefill", "--replicas", "incremental"], "--replicas incremental: not among"),
    (["--arms", "prefill"], "compared with live; include it"),
    (["--cross", "int4"], "--cross int4"),
    (["--arms", "live,prefill", "--transplant", "live<-incremental"], "incremental is not among the arms"),
    (["--arms", "live,prefill", "--transplant", "live<-prefill:segment=branch7"], "segment 'branch7'"),
])
def test_options_a_program_cannot_take_exit_2(extra, message):
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--prompt", "x",
                                       "--program", PROGRAM, *extra])
    assert result.exit_code == 2 and message in result.output, result.output


def test_segment_transplants_move_one_stage_of_the_donor():
    from kvfid.stages import transplant as stages_transplant

    spec = stages.parse_program(PROGRAM)
    ranges = stages_transplant.segment_ranges(7, spec, [12, 12, 10])
    assert ranges == {"prompt": (0, 7), "branch1": (7, 22), "branch2": (22, 37), "merge": (37, 49)}
    move = stages_transplant.parse("live<-prefill:segment=branch2+keys", ranges, ("live", "prefill"))
    assert move.selection.positions == (22, 37) and move.selection.keys and not move.selection.values
    record = stages.run_program(tiny(), Stack("twin", "fp32", True), "2+3=", spec, 3,
                                ("live", "prefill"), transplants=(move,))
    (row,) = record.transplants
    assert row.transplant == "live<-prefill:keys+positions=22-37"
    assert row.outcome in ("donor", "recipient", "third", "boundary")
    if row.outcome != "boundary":
        assert len(row.suffix) == 3


def test_the_crossing_freezes_the_program_from_the_reference_live_run():
    from kvfid.stages.crossing import run_program_crossing

    spec, stack = stages.parse_program(PROGRAM), Stack("native", "bf16", True)
    measured = stages.measure(tiny(), stack, "2+3=", spec, 3, ("live", "prefill"))
    crossing = run_program_crossing(tiny(), measured, stack.label, [stack.with_dtype("fp32"), stack], 3,
                            frozenset())
    assert [(c.stack, c.arm) for c in crossing.cells] == [
        ("native/fp32+bi", "incremental"), ("native/fp32+bi", "prefill"),
        ("native/bf16+bi", "incremental"), ("native/bf16+bi", "prefill")]
    # the reference stack's own cells rebuild its live state: its suffix, its cache bits
    own = [c for c in crossing.cells if c.stack == "native/bf16+bi"]
    assert all(c.suffix_equals_reference for c in own)
    assert own[1].cache_sha == measured.run.arms["live"].cache_sha
    assert all(row.bit_exact for row in crossing.within)
