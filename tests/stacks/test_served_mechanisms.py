"""Mechanisms our kernels serve rather than refuse, on tiny random-weight models of the families
that have them (tests/support/families.py):

* Llama 4's chunked (block-local) layers (`llama4`, chunks of 8). Its attention call carries no
  position ids: each query's place in its chunk and its row's padding are read from the chunked
  mask (kvfid.kernels.hf_masks.chunk_visibility) and the query is computed in its chunk's
  coordinates;
* DeepSeek-V3.2's sparse indexer (`deepseek-v32`, top 8): the keys it selects arrive as
  `indices` beside the causal mask, and each query is computed over the keys it both may see and
  was given.

Tested for each: the visibility the kernel gets equals the pattern of the absolute positions the
test fed (and the selection), at every call of a left-padded batch fed as a prefill, chunks and
decode steps; the kernel's output there against the fp64 reference (kvfid.kernels.attention.
reference) per dtype, and a control that the check sees the chunks or the selection; the faithful
stacks bit-exact live ~ prefill, chunked, batched and co-batched (every position: each compared
state holds every position's K/V or latent), and the twin (variant by construction) caught by
the same comparison; for chunks, masks that cannot be read refused in one line."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close_to_ref, cache_keyword
from families import WINDOW, build, model as family_model

from kvfid.kernels import KernelRefusal, hf, hf_native
from kvfid.kernels.hf_masks import chunk_visibility
from kvfid.kernels.attention.reference import attention_ref, visible

CHUNK = WINDOW          # tests/support/families.py's llama4: attention_chunk_size
TOP_K = WINDOW          # tests/support/families.py's deepseek-v32: index_topk
PAD = 3                 # row 0 of the driven batch is left-padded by this many
SCHEDULE = (11, 3, 3) + (1,) * 8   # a prefill across a chunk edge, two chunks, decode steps


def _recorded(kernel: str, calls: list):
    """A registered attention: the kernel behind kvfid's factory, recording each call (its layer,
    mask and `indices`; q, k, v, the keywords the kernel got, its output)."""
    if kernel == "native":
        from kvfid.kernels.attention.native import attention_into
        serves = hf_native.SERVES
    else:
        from kvfid.kernels.attention.kernel import attention_into
        serves = hf.SERVES

    def recording(out, q, k, v, **kwargs):
        attention_into(out, q, k, v, **kwargs)
        calls[-1].update(q=q, k=k, v=v, kwargs=kwargs, out=out.clone())
        return out

    attention = hf.make_attention(f"kvfid_rec_{kernel}", recording, serves)

    def layer_call(module, query, key, value, mask, scaling=None, dropout=0.0, **kwargs):
        calls.append({"layer": module.layer_idx, "indices": kwargs.get("indices"), "mask": mask})
        return attention(module, query, key, value, mask, scaling, dropout, **kwargs)

    return hf.register_kernel(f"kvfid_rec_{kernel}", layer_call)


def _drive(family: str, kernel: str, dtype: torch.dtype) -> list[dict]:
    """Layer 0's calls of a 2-row batch (row 0 left-padded) fed by SCHEDULE, each with the
    absolute position of its held key 0."""
    from transformers import DynamicCache

    module = family_model(family, dtype=dtype)
    calls: list = []
    module.set_attn_implementation(_recorded(kernel, calls))
    total = sum(SCHEDULE)
    ids = torch.randint(0, 256, (2, total), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, total, dtype=torch.long)
    mask[0, :PAD] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)   # as generate counts a padded row
    cache, seen, out = DynamicCache(config=module.config), 0, []
    with torch.no_grad():
        for size in SCHEDULE:
            calls.clear()
            module(input_ids=ids[:, seen:seen + size], attention_mask=mask[:, :seen + size],
                   position_ids=positions[:, seen:seen + size], use_cache=True,
                   **{cache_keyword(module): cache})
            seen += size
            for call in calls:
                if call["layer"] == 0:   # llama4: chunked; deepseek-v32: indexed
                    call["key_start"] = seen - call["k"].shape[2]
                    out.append(call)
    return out


@pytest.mark.parametrize("kernel,dtype", [("native", torch.float32), ("native", torch.bfloat16),
                                          ("native", torch.float16), ("triton", torch.float32)],
                         ids=["native-fp32", "native-bf16", "native-fp16", "triton-fp32"])
def test_each_call_sees_its_chunk_as_the_positions_state_it_and_matches_the_reference(kernel, dtype):
    pads = torch.tensor([PAD, 0])
    calls = _drive("llama4", kernel, dtype)
    assert len(calls) == len(SCHEDULE)
    chunked_away = 0
    for call in calls:
        q, k, v, kwargs = call["q"], call["k"], call["v"], call["kwargs"]
        q_len, kv_len = q.shape[2], k.shape[2]
        pattern = visible(call["key_start"] - pads, q_len, kv_len, None, CHUNK)   # [B, q, kv]
        assert kwargs["chunk"] is None and torch.equal(kwargs["visibility"].cpu(), pattern), \
            (call["key_start"], q_len, kv_len)   # read from the mask alone, exactly
        # had the call carried position ids (as generate counts a padded row), the same pattern
        seen = call["key_start"] + kv_len
        own = (torch.arange(seen - q_len, seen)[None] - pads[:, None]).clamp(min=0)
        assert torch.equal(chunk_visibility("probe", call["mask"], own, 2, q_len, kv_len, None,
                                            CHUNK), pattern)
        ref = attention_ref(q.double(), k.double(), v.double(), scale=kwargs["scale"],
                            first_valid=pads, key_start=call["key_start"], chunk=CHUNK)
        assert_close_to_ref(call["out"], ref, dtype)
        causal = attention_ref(q.double(), k.double(), v.double(), scale=kwargs["scale"],
                               first_valid=pads, key_start=call["key_start"])
        try:   # the control: a call whose queries' chunks hide keys tells the two apart
            assert_close_to_ref(call["out"], causal, dtype)
        except AssertionError:
            chunked_away += 1
    assert call["key_start"] > 0          # the window cache had slid: held key 0 is not position 0
    assert chunked_away >= len(SCHEDULE) // 2


def _chosen(indices: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """[B, q, kv] bool: the keys an indexer's top-k `indices` [B, q, k] name."""
    chosen = torch.zeros(indices.shape[0], q_len, kv_len, dtype=torch.bool)
    return chosen.scatter(-1, indices.long().cpu(), True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_each_call_sees_the_keys_its_indexer_chose_and_matches_the_reference(dtype):
    """On the native kernel (Triton's visibility kernel takes the same selections in
    tests/attention/test_kernel_attention_selection.py)."""
    pads = torch.tensor([PAD, 0])
    calls = _drive("deepseek-v32", "native", dtype)
    assert len(calls) == len(SCHEDULE)
    selective = skipping_itself = 0
    for call in calls:
        q, k, v, kwargs = call["q"], call["k"], call["v"], call["kwargs"]
        q_len, kv_len = q.shape[2], k.shape[2]
        assert call["key_start"] == 0 and call["indices"].shape[-1] == min(TOP_K, kv_len)
        pattern = visible(-pads, q_len, kv_len) & _chosen(call["indices"], q_len, kv_len)
        assert torch.equal(kwargs["visibility"].cpu(), pattern), (q_len, kv_len)
        own = torch.arange(q_len)
        skipping_itself += int((pattern.any(-1) & ~pattern[:, own, own + kv_len - q_len]).sum())
        ref = attention_ref(q.double(), k.double(), v.double(), scale=kwargs["scale"],
                            visibility=pattern)
        assert_close_to_ref(call["out"], ref, dtype)
        dense = attention_ref(q.double(), k.double(), v.double(), scale=kwargs["scale"],
                              first_valid=pads)
        try:   # the control: once more keys are visible than selected, the two differ
            assert_close_to_ref(call["out"], dense, dtype)
        except AssertionError:
            selective += 1
    assert skipping_itself > 0            # some queries were not given their own key
    assert selective == len(SCHEDULE)


def _repro(folder, stack: str, arms: str, boundary: int = 8):
    from kvfid.diagnoses import repro
    from kvfid.protocol.constructions import parse_constructions
    from kvfid.stacks.stack import Stack, parse_stack

    parsed = parse_stack(stack)
    prepared = repro.prepare(f"hf:{folder}", Stack(parsed.backend, parsed.dtype,
                                                   parsed.batch_invariant),
                             "Hi there", None, None, boundary, 1, parse_constructions(arms),
                             ignore_eos=True)
    return repro.measure(prepared)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    return {family: build(family, root / family) for family in ("llama4", "deepseek-v32")}


@pytest.mark.parametrize("family,stack,arms", [
    ("llama4", "native/bf16+bi", "live,prefill,chunked:3,batched:2,cobatched:4"),
    ("llama4", "triton/fp32+bi", "live,prefill,chunked:3,cobatched:2"),
    ("deepseek-v32", "native/bf16+bi", "live,prefill,chunked:3,batched:2,cobatched:4")])
def test_the_faithful_stacks_are_bit_exact(folders, family, stack, arms):
    """The prompt (11 tokens) crosses chunk edge 8, the live steps edge 16 and the indexer's top 8;
    llama4's layer 1 and deepseek-v32's latents hold every position, so each position's attention
    output is compared (and deepseek-v32's selection, a part of its state)."""
    record = _repro(folders[family], stack, arms)
    assert len(record.prefix) > 2 * CHUNK
    for arm in arms.split(",")[1:]:
        cache = record.against_live(arm).cache
        assert cache.bit_exact and not cache.uncompared, (arm, cache.first_bad_layer,
                                                          cache.first_bad_kv)


@pytest.mark.parametrize("family", ["llama4", "deepseek-v32"])
def test_control_the_twin_is_caught_by_the_same_comparison(folders, family):
    cache = _repro(folders[family], "twin/fp32", "live,prefill").against_live("prefill").cache
    assert not cache.bit_exact and not cache.uncompared


def test_the_twin_takes_the_selection_too():
    """The control computes the model's function: it narrows the mask to `indices` as eager
    narrows it (ignoring them, its logits differed from eager's by 2.09 on this model)."""
    from kvfid.stacks import twins

    module = family_model("deepseek-v32")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        module.set_attn_implementation("eager")
        eager = module(ids).logits
        module.set_attn_implementation(twins.register_hf())
        twin = module(ids).logits
    assert_close_to_ref(twin, eager, torch.float32)


def test_only_the_indexers_stay_hooked_for_their_selections():
    """recorded_selections keeps the hook of a module whose output is key indices (each call's
    selection recorded: a prefill's 11 positions, then a step's one) and drops every other's after
    its first call; the control: the attentions were hooked at first."""
    from transformers import DynamicCache

    from kvfid.states.selection import ATTRIBUTE, recorded_selections

    module = family_model("deepseek-v32")
    hooked = [m for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    indexers = [m for m in hooked if type(m).__name__.endswith("Indexer")]
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with recorded_selections(module), torch.no_grad():
        assert all(m._forward_hooks for m in hooked) and len(indexers) < len(hooked)
        cache = DynamicCache(config=module.config)
        module(ids[:, :11], use_cache=True, **{cache_keyword(module): cache})
        module(ids[:, 11:], use_cache=True, **{cache_keyword(module): cache})
        assert [bool(m._forward_hooks) for m in hooked] == [m in indexers for m in hooked]
    assert not any(m._forward_hooks for m in hooked)
    assert [getattr(layer, ATTRIBUTE).shape[1] for layer in cache.layers] == [12] * len(indexers)


def test_the_serving_table_says_what_the_kernels_do(folders):
    from kvfid.stacks.backends import builtin_backends
    from kvfid.stacks.serving import serving_table

    rows = serving_table(f"hf:{folders['llama4']}", builtin_backends())["layers"]
    chunked = next(r for r in rows if r["layer_type"] == "chunked_attention")
    assert chunked["mechanisms"] == ["chunked_attention"] and chunked["window"] == CHUNK
    (indexed,) = serving_table(f"hf:{folders['deepseek-v32']}", builtin_backends())["layers"]
    assert "sparse_indexer" in indexed["mechanisms"]
    for row in (chunked, indexed):
        assert row["stacks"]["native"] is None and row["stacks"]["triton"] is None


# ---- what cannot be read is refused, in one line -------------------------------------------------

class _ChunkedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from types import SimpleNamespace
        self.layer_idx = 0
        self.config = SimpleNamespace(layer_types=["chunked_attention"], attention_chunk_size=CHUNK)


def _call(mask, kv_len, q_len=1, **kwargs):
    calls = []

    def recording(out, q, k, v, **kw):
        calls.append(kw)
        return out.zero_()

    attention = hf.make_attention("probe", recording, hf_native.SERVES)
    q, k = torch.zeros(1, 2, q_len, 16), torch.zeros(1, 1, kv_len, 16)
    attention(_ChunkedLayer(), q, k, k, mask, **kwargs)
    return calls[-1]


def test_a_mask_that_is_no_chunk_pattern_is_refused_and_positions_still_serve():
    with pytest.raises(KernelRefusal, match="no position_ids.*chunks of 8") as refused:
        _call(None, CHUNK + 1)   # plain causal over more keys than a chunk: which keys?
    assert "\n" not in str(refused.value)
    packed = torch.tril(torch.ones(1, 1, 6, 6, dtype=torch.bool))
    packed[..., 4:, 1:4] = False   # a packed branch: no chunk's pattern
    with pytest.raises(KernelRefusal, match="no position_ids.*chunks of 8"):
        _call(packed, 6, q_len=6)
    # the same call with position ids (a window cache at 13..21): the chunks from the positions
    placed = _call(None, CHUNK + 1, position_ids=torch.tensor([[21]]))
    assert torch.equal(placed["visibility"], visible(torch.tensor([13]), 1, CHUNK + 1, None, CHUNK))
