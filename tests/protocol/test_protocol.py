"""The protocol on tiny random models: arms, replicas, the bridge, transplants, the crossing."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from kvfid.states import cache as kv
from kvfid.records import record, read as record_read
from kvfid.stacks.stack import Stack
from kvfid.protocol.decode import Runner
from kvfid.inputs.codecs import ByteCodec
from kvfid.protocol.protocol import (ItemPlan, ProtocolError, parse_construction, parse_transplant,
                              run_construction, run_crossing, run_item, run_live)
from protocol_fixtures import PROMPT, fp32_live, tiny

ALL_ARMS = ("live", "prefill", "incremental", "incremental-1", "chunked:5", "batched:2",
            "batched:3")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_every_arm_covers_p_and_matches_a_no_cache_forward_in_fp32(name):
    with fp32_live(name) as (model, module, prompt, live, prefix, full):
        arms = [live] + [run_construction(module, parse_construction(c), len(prompt), prefix, 4,
                                          model.codec.eos_ids) for c in ALL_ARMS[1:]]
    for arm in arms:
        assert arm.state.length == len(prefix), arm.label
        assert all(k.shape[-2] == len(prefix) for k in arm.state.keys + arm.state.values)
        # Positions and masks are right iff the boundary logits equal a full causal forward.
        torch.testing.assert_close(arm.state.logits.float(), full, rtol=1e-5, atol=1e-5)


def test_forward_calls_are_at_the_protocol_floor():
    model = tiny()
    plan = ItemPlan(6, 5, arms=("live", "prefill", "incremental", "incremental-1", "chunked:4"))
    record = run_item(model, Stack("sdpa", "fp32"), PROMPT, plan)
    prompt, B, S = record.prompt_length, 6, 5
    arms = record.arms
    assert all(len(a.suffix) == S for a in arms.values())   # no EOS in these S tokens
    assert arms["live"].forward_calls == 1 + B + (S - 1)
    assert arms["prefill"].forward_calls == 1 + (S - 1)
    assert arms["incremental"].forward_calls == 1 + B + (S - 1)
    assert arms["incremental-1"].forward_calls == prompt + B + (S - 1)
    assert arms["chunked:4"].forward_calls == -(-(prompt + B) // 4) + (S - 1)
    # The warm-up forward is not counted: the item's calls are its arms' calls.
    assert record.timing.forward_calls == sum(a.forward_calls for a in arms.values())
    assert record.warmup_s > 0


@pytest.mark.parametrize("stack", [Stack("sdpa", "bf16"), Stack("eager", "fp32")],
                         ids=lambda s: s.label)
def test_replicas_are_bit_exact(stack):
    plan = ItemPlan(8, 8, arms=("live", "prefill", "chunked:3", "batched:2"),
                    replicas=("live", "prefill", "chunked:3", "batched:2"))
    record = run_item(tiny("tiny-qwen2"), stack, PROMPT, plan)
    assert [r.construction for r in record.replicas] == ["live", "prefill", "chunked:3",
                                                         "batched:2"]
    for r in record.replicas:
        c = r.comparison
        assert (c.a, c.b, c.kind) == (r.construction, r.construction, "replica")
        assert c.prefix_identical and c.cache.bit_exact, c.b
        assert c.logits.equal and c.suffix.identical, c.b
        assert r.fingerprints.cache_sha == record.arms[r.construction].cache_sha


def test_bridge_live_vs_incremental_is_bit_exact_on_cpu():
    # The live run and teacher-forcing make the same calls with the same shapes.
    for dtype in ("bf16", "fp32"):
        record = run_item(tiny(), Stack("sdpa", dtype), PROMPT, ItemPlan(8, 8))
        assert record.bridge.cache.bit_exact and record.bridge.suffix.identical, dtype


def test_transplant_of_identical_caches_gives_the_recipient_suffix():
    plan = ItemPlan(8, 8, arms=("live", "incremental"),
                    transplants=(parse_transplant("live<-incremental"),
                                 parse_transplant("incremental<-live:keys")))
    record = run_item(tiny(), Stack("sdpa", "fp32"), PROMPT, plan)
    assert [t.outcome for t in record.transplants] == ["recipient", "recipient"]
    assert record.transplants[0].suffix == record.arms["live"].suffix


def test_transplant_outcome_donor_when_the_donor_cache_decides():
    """Donor = a state built over the same P by a perturbed model: its suffix differs."""
    model = tiny()
    prompt = model.codec.prompt_ids(PROMPT.prompt)
    eos = model.codec.eos_ids
    with Stack("sdpa", "fp32").activate(model) as module:
        live = run_live(module, prompt, 8, 8, eos)
        prefix = list(live.state.prefix)
        noisy = kv.BoundaryState(live.state.prefix,
                                 tuple(k * 0 for k in live.state.keys),
                                 tuple(v * 0 for v in live.state.values), live.state.logits)
        from kvfid.protocol.protocol import Arm, decode_suffix, run_transplant
        runner = Runner(module)
        donor = Arm("prefill", noisy, decode_suffix(runner, noisy, 8, eos), 0, 0, 0)
        arms = {"live": live, "prefill": donor}
        assert donor.suffix.tokens != live.suffix.tokens
        out = run_transplant(module, parse_transplant("live<-prefill"), arms, len(prompt), 8,
                             eos)
        back = run_transplant(module, parse_transplant("prefill<-live"), arms, len(prompt), 8,
                              eos)
    assert out.outcome == "donor" and back.outcome == "donor"
    assert prefix == list(donor.state.prefix)


def test_crossing_uses_one_prefix_for_every_cell():
    model = tiny()
    out = run_crossing(model, PROMPT, Stack("sdpa", "bf16"),
                       [Stack("sdpa", "bf16"), Stack("sdpa", "fp16"), Stack("sdpa", "fp32")],
                       B=8, S=6)
    assert out.status == "ok" and len(out.cells) == 6
    assert {c.fingerprints.prefix_sha for c in out.cells} == {out.prefix_sha}
    assert [w.stack for w in out.within] == ["sdpa/bf16", "sdpa/fp16", "sdpa/fp32"]
    assert out.cell("sdpa/fp16", "prefill").construction == "prefill"
    assert record_read.from_json(out.to_json()) == out


def test_eos_before_b_live_tokens_marks_the_item_short():
    model = tiny()
    prompt = model.codec.prompt_ids(PROMPT.prompt)
    with Stack("sdpa", "fp32").activate(model) as module:
        tokens = run_live(module, prompt, 16, 1, model.codec.eos_ids).generated.tokens
    # Declare the first token that is not a repeat to be EOS: the live run must stop there.
    index = next(i for i in range(1, 16) if tokens[i] not in tokens[:i])
    codec = ByteCodec()
    codec.eos_ids = frozenset({tokens[index]})
    short_model = dataclasses.replace(model, codec=codec)
    short = run_item(short_model, Stack("sdpa", "fp32"), PROMPT, ItemPlan(16, 4))
    assert short.status == "short"
    assert f"EOS after {index + 1} of B=16" in short.note
    assert short.comparisons == () and short.prefix == ()
    assert short.arms["live"].generated == tuple(tokens[:index + 1])
    assert record_read.from_json(short.to_json()) == short
    # --ignore-eos: the same item generates all B and S tokens and is compared.
    full = run_item(short_model, Stack("sdpa", "fp32"), PROMPT, ItemPlan(16, 4, ignore_eos=True))
    assert full.status == "ok" and full.ignore_eos and full.comparisons
    assert len(full.arms["live"].suffix) == 4


@pytest.mark.parametrize("bad, message", [
    (lambda: ItemPlan(0, 4), "positive"),
    (lambda: ItemPlan(4, -1), "positive"),
    (lambda: ItemPlan(4, 4, arms=("live", "prefil")), "valid: live, prefill"),
    (lambda: ItemPlan(4, 4, arms=("chunked:0",)), "unknown arm"),
    (lambda: parse_transplant("live->prefill"), "RECIPIENT<-DONOR"),
    (lambda: parse_transplant("live<-prefill:layers=3-1"), "valid"),
    (lambda: Stack("flash", "bf16"), "valid: sdpa, eager, triton"),
    (lambda: Stack("sdpa", "int8"), "valid: bf16, fp16, fp32"),
])
def test_bad_input_is_refused_with_the_valid_names(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def test_context_overflow_is_refused_before_any_compute():
    model = tiny()
    with pytest.raises(ProtocolError, match="exceeds the model's context of 1024"):
        run_item(model, Stack("sdpa", "fp32"), PROMPT, ItemPlan(1000, 100))


def test_stack_restores_threads_and_attention_on_exit():
    model = tiny()
    module = model.cast(torch.float32)
    threads, impl = torch.get_num_threads(), module.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with Stack("eager", "fp32", threads=1).activate(model) as inside:
            assert torch.get_num_threads() == 1
            assert inside.config._attn_implementation == "eager"
            raise RuntimeError("boom")
    assert torch.get_num_threads() == threads
    assert module.config._attn_implementation == impl


def test_casts_come_from_the_fp32_master():
    model = tiny()
    bf16 = model.cast(torch.bfloat16)
    assert model.cast(torch.bfloat16) is bf16
    for (name, p32), (_, p16) in zip(model.master.named_parameters(), bf16.named_parameters()):
        assert torch.equal(p32.to(torch.bfloat16), p16), name


FINGERPRINT_SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)   # as in the test session (tests/conftest.py)
sys.path.insert(0, 'tests/support')
from kvfid.stacks.stack import Stack
from kvfid.protocol.protocol import ItemPlan, run_item
from protocol_fixtures import PROMPT, tiny
r = run_item(tiny(), Stack('sdpa', 'bf16'), PROMPT, ItemPlan(6, 6, arms=('live', 'prefill')))
print(json.dumps({k: [a.cache_sha, a.logits_sha, a.suffix_sha]
                  for k, a in r.arms.items()} | {'P': r.prefix_sha}))
"""


def test_fingerprints_are_stable_across_processes():
    """A fresh process (its own hash seed, its own model build) against this one, where other
    tests may have run first: every fingerprint the same."""
    there = subprocess.run([sys.executable, "-c", FINGERPRINT_SCRIPT], capture_output=True,
                           text=True, check=True).stdout
    here = run_item(tiny(), Stack("sdpa", "bf16"), PROMPT,
                    ItemPlan(6, 6, arms=("live", "prefill")))
    assert json.loads(there) == ({k: [a.cache_sha, a.logits_sha, a.suffix_sha]
                                  for k, a in here.arms.items()} | {"P": here.prefix_sha})


def test_our_calls_raise_no_warnings_on_this_transformers():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_item(tiny(), Stack("sdpa", "bf16"), PROMPT,
                 ItemPlan(4, 4, arms=("live", "prefill", "batched:2", "chunked:2",
                                      "cobatched:3+decode")))
    assert [str(w.message) for w in caught] == []


def test_transplant_parsing_takes_chunked_and_batched_donors():
    spec = parse_transplant("live<-chunked:16")
    assert (spec.recipient, spec.donor, spec.selection.label) == ("live", "chunked:16", "all")
    spec = parse_transplant("batched:2<-chunked:4:layers=0-2+values")
    assert (spec.recipient, spec.donor) == ("batched:2", "chunked:4")
    assert spec.selection.label == "layers=0-2+values"


def test_divergent_only_transplants_skip_exact_rows():
    plan = ItemPlan(6, 6, arms=("live", "incremental"),
                    transplants=(parse_transplant("live<-incremental"),),
                    transplant_rows="divergent")
    record = run_item(tiny(), Stack("sdpa", "fp32"), PROMPT, plan)
    assert record.arms["live"].suffix == record.arms["incremental"].suffix
    assert record.transplants == ()


def test_decoding_a_suffix_leaves_the_boundary_state_untouched():
    from kvfid.protocol.protocol import decode_suffix

    model = tiny()
    prompt = model.codec.prompt_ids(PROMPT.prompt)
    with Stack("sdpa", "bf16").activate(model) as module:
        live = run_live(module, prompt, 6, 2, model.codec.eos_ids)
        before = (kv.sha_cache(live.state), kv.sha_tensor(live.state.logits))
        decode_suffix(Runner(module), live.state, 8, model.codec.eos_ids)
    assert (kv.sha_cache(live.state), kv.sha_tensor(live.state.logits)) == before


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_faithful_stack_makes_every_construction_bit_exact_and_a_variant_twin_does_not(dtype):
    """The product's claim, end to end through the protocol, with its negative control: the same
    plan on the deliberately shape-variant attention (with the same batch-invariant mode), which
    must differ on any CPU. Stock SDPA's result is machine-dependent, so it is not asserted. The
    faithful stack is the native one (the same tiling contract as the Triton kernel, at CPU
    speed): this tests the protocol; the Triton kernel's model-level runs are in test_kernel_hf
    and test_ragged."""
    plan = ItemPlan(16, 3, arms=("live", "prefill", "chunked:4", "batched:2"))
    model = tiny("tiny-qwen2")
    exact = run_item(model, Stack("native", dtype, True, threads=1), PROMPT, plan)
    for c in exact.comparisons:
        assert c.cache.bit_exact and c.logits.equal, (c.b, c.cache.layers)
    twin = run_item(model, Stack("twin", dtype, True, threads=1), PROMPT, plan)
    for arm in ("prefill", "chunked:4", "batched:2"):
        assert not twin.against_live(arm).cache.bit_exact, arm


def test_a_record_survives_its_json_round_trip_and_other_schemas_are_refused():
    plan = ItemPlan(6, 5, arms=("live", "prefill", "incremental", "batched:2", "cobatched:3"),
                    replicas=("prefill",), transplants=(parse_transplant("live<-prefill:keys"),))
    item = run_item(tiny(), Stack("sdpa", "bf16"), PROMPT, plan)
    # the comparisons come typed from the states' own functions, not converted from dicts
    assert all(isinstance(c.cache, record.CacheDiff) and isinstance(c.logits, record.LogitsDiff)
               and isinstance(c.suffix, record.SuffixDiff) for c in item.comparisons)
    text = item.to_json()
    assert record_read.from_json(text) == item
    # A schema-3 record written while CacheDiff still held its constant `d_rel_aggregation`
    # sentence reads back as the same record; records written now no longer carry it.
    assert "d_rel_aggregation" not in text
    earlier = json.loads(text)
    for c in earlier["comparisons"]:
        c["cache"]["d_rel_aggregation"] = ("Frobenius norm over every compared part of every "
                                           "layer, concatenated")
    assert record_read.from_json(json.dumps(earlier)) == item
    assert record_read.from_json(item.to_json(indent=1)) == item
    data = json.loads(text)
    assert (data["schema"], data["kind"]) == (record.SCHEMA_VERSION, "item")
    with pytest.raises(record.RecordRefused, match="record schema 99 is not this kvfid's"):
        record_read.from_json(json.dumps({**data, "schema": 99}))
    with pytest.raises(record.RecordRefused, match="unknown record kind"):
        record_read.from_json(json.dumps({**data, "kind": "nonsense"}))
    with pytest.raises(record.RecordRefused, match="no field"):
        record_read.from_json(json.dumps({**data, "extra": 1}))
    placed = dataclasses.replace(item, environment={"key": "cpu-x", "versions": {"torch": "2"}})
    assert record_read.from_json(placed.to_json()) == placed
    # A changed field is a different record: the round trip is not vacuous.
    changed = dataclasses.replace(item, B=item.B + 1)
    assert record_read.from_json(changed.to_json()) != item


def test_an_untagged_schema_2_record_reads_as_a_typed_record():
    """What ledgers of schema 1-2 stored: a plain dict, replicas as comparisons with a primed
    label, crossing cells under "stack|construction" keys."""
    plan = ItemPlan(4, 3, arms=("live", "prefill"), replicas=("prefill",))
    item = run_item(tiny(), Stack("sdpa", "fp32"), PROMPT, plan)
    old = json.loads(item.to_json())
    for name in ("schema", "kind", "warmup_s", "crossing", "replicas", "environment"):
        del old[name]
    replica = json.loads(item.to_json())["replicas"][0]
    old["comparisons"].append({**replica["comparison"], "b": "prefill'",
                               "replica_fingerprints": replica["fingerprints"]})
    for comparison in old["comparisons"]:   # schema 1-2 had no difference kinds
        comparison.pop("difference", None)
        comparison["cache"]["d_rel_aggregation"] = "Frobenius norm over every layer, concatenated"
    unkinded = lambda c: dataclasses.replace(c, difference=None)
    assert record_read.from_json(json.dumps(old)) == dataclasses.replace(
        item, warmup_s=0.0, comparisons=tuple(map(unkinded, item.comparisons)),
        replicas=tuple(dataclasses.replace(r, comparison=unkinded(r.comparison))
                       for r in item.replicas))

    crossing = run_crossing(tiny(), PROMPT, Stack("sdpa", "fp32"), [Stack("sdpa", "fp32")], 4, 3)
    old = json.loads(crossing.to_json())
    old["cells"] = {f"{c['stack']}|{c['construction']}": {
        **c["fingerprints"], "suffix": c["suffix"],
        "same_as_reference_live": c["same_as_reference_live"],
        "forward_calls": c["forward_calls"], "wall_s": c["wall_s"]} for c in old["cells"]}
    old["comparisons"] = [{**{k: v for k, v in w["comparison"].items() if k != "difference"},
                           "stack": w["stack"]} for w in old.pop("within")]
    del old["schema"], old["kind"]
    assert record_read.from_json(json.dumps(old)) == dataclasses.replace(crossing, within=tuple(
        dataclasses.replace(w, comparison=unkinded(w.comparison)) for w in crossing.within))
