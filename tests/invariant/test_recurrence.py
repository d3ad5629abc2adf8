"""The faithful recurrence (kernels/recurrence.py) on a tiny random-weight Qwen3-Next (Gated DeltaNet
+ full attention + MoE) at the transformers level: with the batch-invariant mode and the faithful
form, a prefill, a chunked prefill and incremental decoding give the same bits for the logits and
every cache tensor (keys, values, conv and recurrent states), and batch 1 equals batch 2; without
the faithful form the chunked scan and the recurrent step are different algorithms and the
recurrent states differ (the negative control). The switch restores what it found.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_to_ref

import mode_models as mm
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.kernels.recurrence import faithful_recurrence, recurrent_layers
from kvfid.protocol.decode import cache_keyword

LENGTH = 8


@pytest.fixture(scope="module")
def next_bf16():
    return mm.build("qwen3_next", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def next_fp32():
    return mm.build("qwen3_next", dtype=torch.float32)


def test_recurrent_layers_found_from_attributes(next_fp32):
    assert [name for name, _ in recurrent_layers(next_fp32)] == [
        f"model.layers.{i}.linear_attn" for i in range(3)]
    assert recurrent_layers(mm.build("qwen3_moe", dtype=torch.float32)) == []


def test_switch_restores_what_it_found(next_bf16):
    layer = recurrent_layers(next_bf16)[0][1]
    switch = faithful_recurrence(next_bf16)
    with switch:
        assert "forward" in vars(layer)
        with faithful_recurrence(next_bf16, enabled=False):
            assert "forward" in vars(layer)
        with pytest.raises(RuntimeError):
            with switch:
                raise RuntimeError("body fails")
        assert "forward" in vars(layer)
    assert "forward" not in vars(layer)


def test_faithful_prefill_is_bit_exact_with_incremental_and_batch(next_bf16):
    ids = mm.prompt(LENGTH)
    with set_batch_invariant_mode(impl="rowwise"), faithful_recurrence(next_bf16):
        incremental = mm.run(next_bf16, ids, [1] * LENGTH)
        assert mm.differing(incremental, mm.run(next_bf16, ids, [LENGTH])) == []
        assert mm.differing(incremental, mm.run(next_bf16, ids, [3, 5])) == []
        assert mm.differing(incremental, mm.run(next_bf16, mm.prompt(LENGTH, batch=2), [LENGTH]), row=0) == []
    parts = set(incremental[1])
    assert {"0.conv", "0.recurrent", "3.keys", "3.values"} <= parts, sorted(parts)


@torch.no_grad()
def _padded_row_states(model, ids: torch.Tensor, pad: int) -> tuple[torch.Tensor, dict]:
    """Row 0 of a batch of 2: `ids` [1, T] left-padded by `pad` (masked, position ids from its
    first real token) beside an unpadded row of T + pad tokens; its last logits and its recurrent
    and conv states."""
    from transformers import DynamicCache

    length = ids.shape[1]
    other = mm.prompt(length + pad, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=ids.dtype), ids], dim=1), other])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=batch, attention_mask=mask, position_ids=positions,
                **{cache_keyword(model): cache}, use_cache=True)
    states = {k: v[:1].clone() for k, v in mm.cache_tensors(cache).items()
              if k.endswith(("conv", "recurrent"))}
    return out.logits[:1, -1], states


def test_a_left_padded_row_reaches_its_first_token_from_the_zero_state(next_fp32):
    """A left-padded row's pads are masked, so its state stays zero and its first real token runs
    the decode step from zero; the first token of an empty cache runs that step too, so the
    padded row's logits and states are the bits of the row alone (fp32: while an empty cache's
    first token took the layer's first-call path, the logits and layer 2's states differed)."""
    ids = mm.prompt(LENGTH)
    with set_batch_invariant_mode(impl="rowwise"), faithful_recurrence(next_fp32):
        alone = mm.run(next_fp32, ids, [LENGTH])
        padded = _padded_row_states(next_fp32, ids, 3)
    states = {k: v for k, v in alone[1].items() if k.endswith(("conv", "recurrent"))}
    assert states
    assert mm.differing((alone[0], states), padded) == []


def test_chunked_scan_differs_from_the_recurrence_it_replaces(next_bf16):
    """Negative control: the stock prefill's chunked scan is another algorithm than the step."""
    ids = mm.prompt(LENGTH)
    with set_batch_invariant_mode(impl="rowwise"):
        differ = mm.differing(mm.run(next_bf16, ids, [1] * LENGTH), mm.run(next_bf16, ids, [LENGTH]))
    assert any(name.endswith("recurrent") for name in differ), differ


def test_faithful_prefill_computes_the_same_function(next_fp32):
    """Correctness: the faithful prefill's logits and states match the chunked prefill's (fp32)."""
    model = next_fp32
    ids = mm.prompt(LENGTH)
    chunked = mm.run(model, ids, [LENGTH])
    with faithful_recurrence(model):
        faithful = mm.run(model, ids, [LENGTH])
    assert_close_to_ref(faithful[0], chunked[0], torch.float32)
    for name, tensor in chunked[1].items():
        assert_close_to_ref(faithful[1][name], tensor, torch.float32)


def test_a_stack_turns_the_faithful_form_on_and_restores_it(next_bf16):
    from kvfid.stacks.stack import parse_stack
    from kvfid.kernels.recurrence import is_stepped

    stack = parse_stack("eager/bf16+bi+fr")      # an earlier label reads as the faithful stack
    assert stack.faithful_recurrence and stack.batch_invariant and stack.label == "eager/bf16+bi"
    assert stack == parse_stack("eager/bf16+bi")  # +bi steps the recurrence unless asked not to
    assert stack.describe()["faithful_recurrence"] is True and stack.with_dtype("fp32").faithful_recurrence
    scan = parse_stack("eager/bf16+bi+scan")
    assert not scan.faithful_recurrence and scan.label == "eager/bf16+bi+scan"
    assert scan.describe()["faithful_recurrence"] is False   # a +bi record says which ran
    assert parse_stack("eager/bf16+fr").label == "eager/bf16+fr"
    assert "faithful_recurrence" not in parse_stack("eager/bf16").describe()  # records read as before

    class Prepared:  # what Stack.activate needs of a kvfid model
        def cast(self, dtype, device):
            return next_bf16

    layer = recurrent_layers(next_bf16)[0][1]
    with stack.activate(Prepared()) as module:
        assert module is next_bf16 and is_stepped(layer)
    assert not is_stepped(layer) and "forward" not in vars(layer)


def test_the_command_line_and_case_files_turn_the_faithful_form_on(tmp_path):
    """`--batch-invariant` steps the recurrence unless `--chunked-scan` (and `faithful_recurrence
    = [...]` in a case's stacks) asks for the scan: Qwen3-Next's prefill, stepped by its decode
    recurrence, is bit-exact with live, where the chunked scan differs in the recurrent state (the
    control)."""
    from click.testing import CliRunner

    from families import build
    from kvfid.cli import main
    from kvfid.runs.case import load_case

    folder = build("qwen3-next", tmp_path / "qwen3-next")
    args = ["repro", "--model", f"hf:{folder}", "--prompt", "What is 17*23?", "--backend", "eager",
            "--batch-invariant", "--threads", "1", "-B", "8", "-S", "3", "--ignore-eos",
            "--arms", "live,prefill"]
    scan = CliRunner().invoke(main, args + ["--chunked-scan", "--expect", "diverges"])
    assert scan.exit_code == 0, scan.output
    assert "eager/bf16+bi+scan@t1" in scan.output
    faithful = CliRunner().invoke(main, args + ["--expect", "bit-exact"])
    assert faithful.exit_code == 0, faithful.output
    assert "eager/bf16+bi@t1" in faithful.output
    case = tmp_path / "case.toml"
    case.write_text('name = "c"\nmodel = "tiny-llama"\nB = 4\nS = 4\n[items]\nset = "arith"\n'
                    'n = 1\n[stacks]\nbackends = ["eager"]\ndtypes = ["bf16"]\nthreads = 1\n'
                    'faithful_recurrence = [false, true]\n')
    assert [s.label for s in load_case(case).stacks] == ["eager/bf16@t1", "eager/bf16+fr@t1"]
    case.write_text(case.read_text().replace("faithful_recurrence = [false, true]\n",
                                             "batch_invariant = [true]\n"))
    assert [s.label for s in load_case(case).stacks] == ["eager/bf16+bi@t1"]


def test_a_restored_recurrent_state_keeps_the_cache_length_and_decodes_the_same_bits(next_fp32):
    # A linear layer counts the tokens it has seen where transformers keeps such a counter (5.25's
    # `cumulative_length_linear`: the cache's `get_seq_length` when layer 0 is linear, and so the
    # next position): a state read out and put into a fresh cache continues as the original does.
    from transformers import DynamicCache

    from kvfid.states.layers import read_cache, restore_cache

    ids = mm.prompt(LENGTH + 1)
    keyword = cache_keyword(next_fp32)   # 5.17 names it `past_key_values`: `cache=` is dropped

    def next_logits(cache):
        return next_fp32(input_ids=ids[:, LENGTH:], **{keyword: cache}, use_cache=True).logits

    with torch.no_grad():
        cache = DynamicCache(config=next_fp32.config)
        next_fp32(input_ids=ids[:, :LENGTH], **{keyword: cache}, use_cache=True)
        states = read_cache(cache, next_fp32.config)
        fresh, lost = DynamicCache(config=next_fp32.config), DynamicCache(config=next_fp32.config)
        restore_cache(fresh, states)
        restore_cache(lost, states)
        assert int(fresh.get_seq_length()) == int(cache.get_seq_length()) == LENGTH
        live = next_logits(cache)
        assert torch.equal(next_logits(fresh), live)
        # Control, where the counter exists: the same state with its count lost continues from
        # position 0, and the bits differ.
        counters = [layer.cumulative_length_linear for layer in lost.layers
                    if isinstance(getattr(layer, "cumulative_length_linear", None), torch.Tensor)]
        if counters:
            for counter in counters:
                counter.zero_()
            assert int(lost.get_seq_length()) == 0
            assert not torch.equal(next_logits(lost), live)
