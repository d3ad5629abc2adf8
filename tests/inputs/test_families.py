"""Every decoder family of issue 17 (tests/support/families.py: tiny random weights from transformers'
config classes): no internal error on sdpa, eager or triton; eager with the batch-invariant mode
bit-exact live~prefill where it is today; window and recurrent states transplanted, fingerprinted
and compared part by part; unknown layer states refused before compute."""

import pytest
import torch

from kvfid.errors import KvfidError
from kvfid.states import cache as kv
from kvfid.states import surgery
from kvfid.records import record as rec
from kvfid.records.plain import from_plain
from kvfid.states.surgery import parse_selection, perturb
from families import FAMILIES, build

B, S = 10, 3            # B crosses the windows (8 positions) of the window families
PROMPT = "Hi there"

# The chunked-scan control (eager/bf16+bi+scan, live vs prefill): Qwen3-Next's linear-attention
# layer builds the prefill state by a chunked scan and the decode state by the recurrent step (two
# algorithms), so it differs first in the recurrent state; `+bi` steps it and is bit-exact.
SCAN_DIFFERS = {"qwen3-next": (0, "recurrent")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: build(family, root / family) for family in FAMILIES}


def _repro(folder, backend, dtype="bf16", batch_invariant=False, b=B, s=S,
           arms="live,prefill", transplants=(), faithful_recurrence=None):
    from kvfid.diagnoses import repro
    from kvfid.protocol.constructions import parse_constructions, parse_transplant

    from kvfid.stacks.stack import Stack

    stack = Stack(backend, dtype, batch_invariant, faithful_recurrence=faithful_recurrence)
    prepared = repro.prepare(f"hf:{folder}", stack, PROMPT, None, None, b, s,
                             parse_constructions(arms),
                             transplants=tuple(map(parse_transplant, transplants)),
                             ignore_eos=True)
    return repro.measure(prepared)


def test_every_family_is_described_from_its_config_alone(folders):
    from transformers import AutoConfig

    from kvfid.stacks.serving import describe_layers

    seen = {}
    for family, folder in folders.items():
        infos = describe_layers(AutoConfig.from_pretrained(folder))
        seen[family] = ({i.kind for i in infos}, {m for i in infos for m in i.mechanisms})
    assert seen["gemma3"][0] == {"window", "full"} and "sliding_window" in seen["gemma3"][1]
    assert seen["mistral-sw"][0] == {"window"}
    assert {"softcap", "sliding_window"} <= seen["gemma2"][1]
    assert {"sinks", "sliding_window"} <= seen["gpt-oss"][1]
    assert seen["deepseek-v3"] == ({"latent"}, {"split_head_dims"})
    assert seen["qwen3-next"] == ({"recurrent", "full"}, {"recurrent"})
    for family in ("qwen3-moe", "olmo2", "smollm3"):
        assert seen[family] == ({"full"}, set())


@pytest.mark.parametrize("family", FAMILIES)
def test_no_internal_error_on_sdpa_and_eager_with_the_mode_bit_exact_where_it_is(folders, family):
    try:
        record = _repro(folders[family], "sdpa")
        assert record.status == "ok"
    except KvfidError as err:       # refused before compute: one line, exit 3
        assert err.exit_code == 3 and "\n" not in str(err)
    record = _repro(folders[family], "eager", batch_invariant=True)
    assert record.status == "ok"
    cache = record.against_live("prefill").cache
    assert not cache.uncompared
    assert cache.bit_exact and record.against_live("prefill").logits.equal
    assert record.against_live("prefill").suffix.identical   # decoded from to_cache
    if family in SCAN_DIFFERS:
        scan = _repro(folders[family], "eager", batch_invariant=True, faithful_recurrence=False)
        cache = scan.against_live("prefill").cache
        assert not cache.bit_exact
        assert (cache.first_bad_layer, cache.first_bad_kv) == SCAN_DIFFERS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_serves_or_refuses_in_one_line_before_compute(folders, family):
    from kvfid.stacks.serving import describe_layers
    from kvfid.inputs.models import load_model
    from kvfid.kernels.hf import SERVES

    mechanisms = {m for i in describe_layers(load_model(f"hf:{folders[family]}"))
                  for m in i.mechanisms} - {"recurrent"} - SERVES
    if mechanisms:
        with pytest.raises(KvfidError) as refused:
            _repro(folders[family], "triton", batch_invariant=True, b=2, s=1)
        assert refused.value.exit_code == 3 and "\n" not in str(refused.value)
        assert any(m in str(refused.value) for m in mechanisms)
    elif family in ("olmo2", "qwen3-next"):   # the interpreter is slow: the smallest ones
        record = _repro(folders[family], "triton", "fp32", True, b=3, s=1)
        assert record.status == "ok" and not record.against_live("prefill").cache.uncompared


def _live(folder, steps=B):
    from kvfid.inputs.models import load_model
    from kvfid.protocol.protocol import run_live

    model = load_model(f"hf:{folder}")
    module = model.cast(torch.float32)
    module.set_attn_implementation("eager")
    with torch.inference_mode():
        arm = run_live(module, model.codec.prompt_ids(PROMPT), steps, 6, frozenset())
    return module, arm


def _noisy(state, layers, parts):
    """A donor: `state` with the given parts of the given layers replaced by large noise."""
    g = torch.Generator().manual_seed(0)
    out = list(state.layers)
    for index in layers:
        out[index] = out[index].replace(**{p: torch.randn(out[index].parts[p].shape, generator=g)
                                           .to(out[index].parts[p].dtype) * 4 for p in parts})
    return kv.BoundaryState(state.prefix, logits=state.logits, layers=tuple(out))


@pytest.mark.parametrize("family,layers,selection,parts", [
    ("gemma3", (0, 1, 2), "layers=0-3", ("k", "v")),                    # the sliding layers
    ("qwen3-next", (0,), "layers=0-1+recurrent+conv", ("recurrent", "conv")),
])
def test_a_transplanted_window_or_recurrent_state_makes_the_suffix_follow_the_donor(
        folders, family, layers, selection, parts):
    from kvfid.protocol.protocol import decode_suffix
    from kvfid.protocol.decode import Runner

    module, live = _live(folders[family])
    kinds = {live.state.layers[i].kind for i in layers}
    assert kinds <= {"window", "recurrent"} and kinds
    if "window" in kinds:   # the window holds only its last positions, at their absolute place
        assert live.state.layers[0].span == (len(live.state.prefix) - 7, len(live.state.prefix))
    donor = _noisy(live.state, layers, parts)
    with torch.inference_mode():
        own = decode_suffix(Runner(module), live.state, 6, frozenset())
        theirs = decode_suffix(Runner(module), donor, 6, frozenset())
        moved = decode_suffix(Runner(module), surgery.transplant(live.state, donor,
                                                            parse_selection(selection), 2), 6,
                              frozenset())
    assert own.tokens == live.suffix.tokens     # to_cache restores the state the live run had
    assert theirs.tokens != own.tokens          # the donor's suffix differs...
    assert moved.tokens == theirs.tokens        # ...and the transplanted state follows it


def test_fingerprints_and_comparisons_cover_the_conv_part(folders):
    module, live = _live(folders["qwen3-next"], steps=3)
    state = live.state
    assert set(state.layers[0].parts) == {"recurrent", "conv"}
    assert set(state.layers[1].parts) == {"k", "v"}
    bent = perturb(state, 0, "conv")
    assert kv.sha_cache(bent) != kv.sha_cache(state)
    diff = kv.compare_states(state, bent)
    assert not diff.bit_exact and (diff.first_bad_layer, diff.first_bad_kv) == (0, "conv")
    assert diff.n_diff == 1 and diff.first_position is None   # a conv state has no positions
    record = from_plain(rec.CacheDiff, rec.as_plain(diff))   # through the JSON the ledger stores
    assert record == diff
    assert record.layers[0].parts["conv"].n_diff == 1 and record.layers[0].kind == "recurrent"
    assert kv.compare_states(state, perturb(state, 0, "recurrent")).first_bad_kv == "recurrent"


def test_a_state_over_other_positions_is_not_compared_as_equal(folders):
    _, live = _live(folders["mistral-sw"], steps=3)
    state = live.state
    layer = state.layers[0]
    shifted = layer.__class__(layer.kind, layer.parts, layer.start + 1, layer.cache_class)
    other = kv.BoundaryState(state.prefix, logits=state.logits,
                             layers=(shifted,) + state.layers[1:])
    diff = kv.compare_states(state, other)
    assert not diff.bit_exact and diff.n_diff == 0
    assert any("layer 0 part k: positions" in u for u in diff.uncompared)


def test_a_cache_layer_kvfid_does_not_know_is_refused_before_compute(monkeypatch):
    from transformers import MistralConfig
    from transformers import cache_utils as cu

    from kvfid.stacks.stack import Stack, check_supports

    class PagedLayer(cu.DynamicLayer):   # holds a list of pages: not a state kvfid can read whole
        def __init__(self, **kwargs):
            super().__init__()
            self.pages = []

    class StepLayer(cu.LinearAttentionLayer):   # a recurrent class's subclass: read only in part
        pass

    config = MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    for name, cls, said in (("paged_attention", PagedLayer, "holds pages \\(list\\)"),
                            ("step_attention", StepLayer, "StepLayer holds a state")):
        monkeypatch.setitem(cu.DYNAMIC_LAYER_TYPE_MAPPING, name, cls)
        config.layer_types = ["full_attention", name]
        with pytest.raises(KvfidError, match=f"layer 1 \\({name}\\).*{said}") as refused:
            check_supports(Stack("eager", "fp32"), config, 16)
        assert refused.value.exit_code == 3


def test_old_layer_records_still_read():
    old = {"layer": 0, "k": {"equal": True}, "v": {"equal": False, "n_diff": 2}}
    layer = from_plain(rec.LayerDiff, old)
    assert layer.kind == "full" and layer.parts == {} and layer.v.n_diff == 2


def test_the_models_command_lists_layer_types_and_stacks(folders):
    from click.testing import CliRunner

    from kvfid.cli import main

    result = CliRunner().invoke(main, ["models", f"hf:{folders['gpt-oss']}", "--length", "40"])
    assert result.exit_code == 0, result.output
    assert "state window, window 8; mechanisms: sliding_window, sinks" in result.output
    assert "triton  served" in result.output and "eager   served" in result.output
    assert "twin    no: sinks" in result.output
    refused = CliRunner().invoke(main, ["repro", "--model", f"hf:{folders['gpt-oss']}",
                                        "--backend", "sdpa", "--prompt", "hi", "-B", "2",
                                        "-S", "1"])
    assert refused.exit_code == 3
    assert len([line for line in refused.output.splitlines() if line.startswith("error:")]) == 1


def test_window_states_compare_like_for_like_across_chunks_and_co_batches(folders):
    arms = "live,chunked:4,cobatched:3"
    exact = _repro(folders["mistral-sw"], "eager", batch_invariant=True, s=2, arms=arms)
    for arm in ("chunked:4", "cobatched:3"):
        cache = exact.against_live(arm).cache
        assert cache.bit_exact and not cache.uncompared
        end = exact.prompt_length + B        # the window (8) holds the last 7 positions
        assert cache.layers[0].kind == "window" and cache.layers[0].span == (end - 7, end)
    control = _repro(folders["mistral-sw"], "twin", "fp32", s=2, arms=arms)   # variant by design
    for arm in ("chunked:4", "cobatched:3"):
        cache = control.against_live(arm).cache
        assert not cache.bit_exact and cache.first_position >= cache.layers[0].span[0]


def test_a_hybrid_layer_keeps_both_its_states_through_to_cache(tmp_path):
    """Falcon-H1's layers hold a state-space state and K/V at once: every part is read, put back
    (the suffix decoded from the restored state is live's own) and compared."""
    from families import build as build_extra

    module, live = _live(build_extra("falcon-h1", tmp_path / "falcon-h1"), steps=4)
    layer = live.state.layers[0]
    assert layer.kind == "recurrent+full" and set(layer.parts) == {"k", "v", "recurrent", "conv"}
    from kvfid.protocol.decode import Runner
    from kvfid.protocol.protocol import decode_suffix

    with torch.inference_mode():
        again = decode_suffix(Runner(module), live.state, 6, frozenset())
    assert again.tokens == live.suffix.tokens
    assert kv.compare_states(live.state, perturb(live.state, 1, "conv")).first_bad_kv == "conv"
