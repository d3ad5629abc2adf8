"""kvfid.kernels.hf: the "kvfid_triton" attention implementation inside transformers models.

Logits against stock SDPA (tolerance), caches bitwise equal across constructions (prefill, one token
at a time, chunks) under the batch-invariant mode, the variant twin that differs, and refusals.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise_equal, bits_equal, cache_keyword, device, tiny_model
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from kvfid.stacks import twins
from kvfid.kernels import hf, hf_native as native, triton_runs_on
from kvfid.kernels.invariant.mode import set_batch_invariant_mode

LENGTH = 17  # more than one query tile (16), not a multiple of it
# The models of the bitwise tests under the mode: every matmul, norm and softmax of the mode's
# Triton implementation runs in the interpreter, whose cost grows with widths and KV heads, and
# the constructions' claim needs neither (2 query heads over 1 KV head is still GQA).
NARROW = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)


def narrow_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """`tiny_model(kind)` at half its width and heads (NARROW), fp32, eval mode, on `device()`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    torch.manual_seed(seed)
    return model_cls(config_cls(**NARROW)).eval().to(device())


def token_ids(batch=1, length=LENGTH, seed=0):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device())


def build_cache(model, ids, chunk: int):
    """Feed `ids` in chunks of `chunk` tokens into a fresh DynamicCache; return (cache, logits)."""
    cache = DynamicCache(config=model.config)
    logits = [model(ids[:, s:s + chunk], **{cache_keyword(model): cache}).logits
              for s in range(0, ids.shape[1], chunk)]
    return cache, torch.cat(logits, dim=1)


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    entry = cache.layers[layer] if hasattr(cache, "layers") else None
    return (entry.keys, entry.values) if entry is not None else (cache.key_cache[layer], cache.value_cache[layer])


# ---- registration ------------------------------------------------------------------------------

def test_register_is_idempotent_and_fills_both_interfaces():
    assert hf.register() == hf.register() == "kvfid_triton"
    assert AttentionInterface()["kvfid_triton"] is hf.kvfid_triton_attention
    assert AttentionMaskInterface()["kvfid_triton"] is hf.kvfid_triton_mask


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_match_sdpa(kind):
    model, ids = tiny_model(kind), token_ids(batch=2)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids).logits  # reference: stock SDPA
        model.set_attn_implementation(hf.register())
        out = model(ids).logits  # the Triton kernel
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)  # compare (fp32)


# ---- fidelity: the cache of a prefill is the cache of any other construction -------------------

# Qwen2's ops are Llama's and the QKV projections' bias (the mode's addmm), so Llama is not run
# again under the mode's Triton ops; it is the model of the control below.
@pytest.mark.parametrize("kind,impl", [("qwen2", "triton"), ("qwen2", "rowwise"), ("llama", "rowwise")])
def test_cache_bitwise_equal_across_constructions_under_the_mode(kind, impl):
    model, ids = narrow_model(kind), token_ids()
    model.set_attn_implementation(hf.register())
    with torch.no_grad(), set_batch_invariant_mode(impl=impl):
        built = {chunk: build_cache(model, ids, chunk) for chunk in (LENGTH, 1, 7)}  # prefill, incremental-1, chunked:7
    prefill_cache, prefill_logits = built[LENGTH]
    for chunk in (1, 7):
        cache, logits = built[chunk]
        for layer in range(model.config.num_hidden_layers):
            for name, a, b in zip("KV", layer_kv(cache, layer), layer_kv(prefill_cache, layer)):
                assert_bitwise_equal(a, b, f"{kind}/{impl} chunk {chunk}: layer {layer} {name}")
        assert_bitwise_equal(logits, prefill_logits, f"{kind}/{impl} chunk {chunk}: logits")


@pytest.mark.parametrize("impl", ["triton", "rowwise"])
def test_control_a_variant_attention_under_the_mode_is_caught(impl):
    """Twin of the cache test: the same constructions and check, with a deliberately shape-variant
    attention (split-KV count from the query length) in place of the kernel, give caches that
    differ from the prefill cache, on any CPU. Six tokens: the twin splits differently from the
    second decode step on, and the tile edges that LENGTH crosses are the kernel's, not the twin's
    (under the mode's Triton ops, each of the twin's splits is an interpreted kernel)."""
    if impl == "triton" and not triton_runs_on(torch.device("cpu")):
        pytest.skip("the CPU twin needs the Triton interpreter")
    model, ids = narrow_model("llama"), token_ids(length=6)
    model.set_attn_implementation(twins.register_hf())
    with torch.no_grad(), set_batch_invariant_mode(impl=impl):
        prefill, _ = build_cache(model, ids, ids.shape[1])
        incremental, _ = build_cache(model, ids, 1)
    layers = range(model.config.num_hidden_layers)
    assert any(not bits_equal(a, b) for layer in layers
               for a, b in zip(layer_kv(prefill, layer), layer_kv(incremental, layer)))


# ---- masks and refusals ------------------------------------------------------------------------

def test_mask_function_returns_none_exactly_for_the_plain_causal_pattern():
    common = dict(batch_size=2, kv_offset=0, device=device())
    for q_length, kv_length in ((5, 5), (3, 12), (1, 9)):  # prefill, chunk, decode
        assert hf.kvfid_triton_mask(q_length=q_length, kv_length=kv_length, q_offset=kv_length - q_length,
                                    **common) is None
    padding = torch.ones(2, 9, dtype=torch.bool, device=device())
    padding[0, :2] = False
    mask = hf.kvfid_triton_mask(q_length=9, kv_length=9, q_offset=0, attention_mask=padding, **common)
    assert mask is not None and mask.shape == (2, 1, 9, 9)


def test_left_padding_is_read_from_the_mask_and_other_masks_are_not():
    common = dict(batch_size=3, kv_offset=0, device=device())
    padding = torch.ones(3, 9, dtype=torch.bool, device=device())
    padding[0, :2] = False
    padding[2, :9] = False  # a row with no valid key yet (a chunk of pure padding)
    for q_length in (9, 4, 1):  # prefill, chunk, decode
        mask = hf.kvfid_triton_mask(q_length=q_length, kv_length=9, q_offset=9 - q_length,
                                    attention_mask=padding, **common)
        assert hf.left_padding(mask, q_length, 9).tolist() == [2, 0, 9]
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        assert hf.left_padding(additive, q_length, 9).tolist() == [2, 0, 9]
    right = torch.ones(3, 9, dtype=torch.bool, device=device())
    right[0, -2:] = False
    mask = hf.kvfid_triton_mask(q_length=9, kv_length=9, q_offset=0, attention_mask=right, **common)
    assert hf.left_padding(mask, 9, 9) is None
    holes = padding.clone()
    holes[1, 4] = False
    mask = hf.kvfid_triton_mask(q_length=9, kv_length=9, q_offset=0, attention_mask=holes, **common)
    assert hf.left_padding(mask, 9, 9) is None


def test_left_padding_runs_and_right_padding_is_refused():
    model = tiny_model("llama")
    model.set_attn_implementation(hf.register())
    ids = token_ids(batch=2, length=8)
    left, right = torch.ones_like(ids), torch.ones_like(ids)
    left[0, :3] = 0
    right[0, -3:] = 0
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids))  # an all-ones mask is fine
        model(ids, attention_mask=left)
        with pytest.raises(ValueError, match="a query does not see itself"):
            model(ids, attention_mask=right)


def test_sliding_window_is_served_and_needs_positions():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=0)
    model.set_attn_implementation(hf.register())
    with torch.no_grad():
        model(token_ids(length=13))  # a window shorter than the keys
    q = torch.zeros(1, 2, 4, 16, device=device())
    with pytest.raises(ValueError, match="needs position_ids"):
        hf.kvfid_triton_attention(torch.nn.Module(), q, q, q, None, sliding_window=2)


def test_custom_masks_are_refused_before_compute():
    q = torch.zeros(1, 2, 4, 16, device=device())
    module = torch.nn.Module()
    custom = torch.ones(1, 1, 4, 4, dtype=torch.bool, device=device())  # bidirectional
    with pytest.raises(ValueError, match="kvfid_triton: visibility mask: a query sees a later key"):
        hf.kvfid_triton_attention(module, q, q, q, custom)
    ragged = torch.tensor([0.0, -1.0, 2.0, 0.0]).expand(1, 1, 4, 4)  # neither bool nor 0 / -inf
    with pytest.raises(ValueError, match="neither the plain causal pattern"):
        hf.kvfid_triton_attention(module, q, q, q, ragged)
    assert hf.SERVES == {"sliding_window", "chunked_attention", "softcap", "sinks", "split_head_dims",
                         "visibility", "sparse_indexer"}


# ---- the kernel-agnostic factory: what a kernel is told --------------------------------------

def _recording_kernel(calls):
    def attention_into(out, q, k, v, **kwargs):
        calls.append(kwargs)
        out.zero_()
        return out
    return attention_into


def _call(attention, q_len, kv_len, mask=None, position_ids=None, batch=1, v_dim=16, **kwargs):
    q = torch.zeros(batch, 2, q_len, 16)
    k = torch.zeros(batch, 1, kv_len, 16)
    return attention(torch.nn.Module(), q, k, torch.zeros(batch, 1, kv_len, v_dim), mask,
                     position_ids=position_ids, **kwargs)


def test_factory_places_held_keys_from_position_ids_and_padding_from_the_mask():
    calls = []
    serving = hf.make_attention("probe", _recording_kernel(calls), frozenset({"sliding_window"}))
    # a window cache holding the last 7 keys of 20: held key 0 is absolute position 13
    out, _ = _call(serving, 1, 7, position_ids=torch.tensor([[19]]), sliding_window=4)
    assert out.shape == (1, 1, 2, 16)
    assert (calls[-1]["key_start"], calls[-1]["window"], calls[-1]["first_valid"]) == (13, 4, None)
    # left padding: own positions (as generate and kvfid's co-batches count them) ...
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[0, :2] = False
    mask = hf.kvfid_mask(batch_size=2, q_length=6, kv_length=6, q_offset=0, kv_offset=0,
                         attention_mask=padding, device=torch.device("cpu"))
    own = (padding.long().cumsum(-1) - 1).clamp(min=0)
    _call(serving, 6, 6, mask, own, batch=2)
    assert calls[-1]["key_start"] == 0 and calls[-1]["first_valid"].tolist() == [2, 0]
    # ... or one padded-absolute range for every row (a plain forward with a mask): the same
    _call(serving, 6, 6, mask, torch.arange(6)[None], batch=2)
    assert calls[-1]["key_start"] == 0 and calls[-1]["first_valid"].tolist() == [2, 0]


def test_factory_refuses_what_the_kernel_does_not_serve_before_calling_it():
    calls = []
    bare = hf.make_attention("bare", _recording_kernel(calls), frozenset())
    for kwargs, match in (({"sliding_window": 4}, "sliding-window"), ({"softcap": 30.0}, "softcapping"),
                          ({"s_aux": torch.zeros(2)}, "sinks"), ({"v_dim": 8}, "head dims")):
        with pytest.raises(ValueError, match=match):
            _call(bare, 1, 7, position_ids=torch.tensor([[6]]), **kwargs)
    _call(bare, 1, 7, position_ids=torch.tensor([[6]]), sliding_window=7)  # covers every key
    assert len(calls) == 1 and calls[0]["window"] is None


def test_factory_refuses_an_unknown_option_naming_the_allowed_ones():
    calls = []
    probe = hf.make_attention("probe", _recording_kernel(calls), frozenset(),
                              options=frozenset({"align_own"}))
    # a kernel option given as a keyword (how the ragged twin's align_own=False was once dropped)
    for keyword in ("align_own", "align_onw"):
        with pytest.raises(ValueError, match=rf"probe: keyword '{keyword}' looks like a kernel "
                                             r"option; give it in kernel_options \(allowed: align_own\)$"):
            _call(probe, 1, 7, position_ids=torch.tensor([[6]]), **{keyword: False})
    # a misspelt kernel option
    with pytest.raises(ValueError, match=r"probe: unknown kernel option 'align_onw'; allowed: align_own$"):
        _call(probe, 1, 7, position_ids=torch.tensor([[6]]), kernel_options={"align_onw": False})
    assert calls == []
    _call(probe, 1, 7, position_ids=torch.tensor([[6]]), use_cache=True,
          kernel_options={"align_own": False})
    assert calls[-1]["align_own"] is False
    _call(probe, 1, 7, position_ids=torch.tensor([[6]]), some_new_family_keyword=1)
    assert len(calls) == 2     # transformers' own keywords (a new family's too) pass through
    for attention in (hf.kvfid_triton_attention, native.kvfid_native_attention):
        with pytest.raises(ValueError, match="keyword 'confg' looks like a kernel option"):
            _call(attention, 1, 7, position_ids=torch.tensor([[6]]), confg=None)


def test_factory_refuses_a_misspelt_kernel_options_keyword():
    calls = []
    probe = hf.make_attention("probe", _recording_kernel(calls), frozenset(),
                              options=frozenset({"align_own"}))
    # a near miss of the keyword itself would pass through as a transformers keyword, dropped
    for keyword in ("kernel_optons", "kernel_option", "kernels_options"):
        with pytest.raises(ValueError, match=rf"probe: keyword '{keyword}' looks like a misspelling "
                                             r"of kernel_options \(allowed in it: align_own\)$"):
            _call(probe, 1, 7, position_ids=torch.tensor([[6]]), **{keyword: {"align_own": False}})
    assert calls == []
    # control: spelt right, the option reaches the kernel; a keyword unlike it passes through
    _call(probe, 1, 7, position_ids=torch.tensor([[6]]), kernel_options={"align_own": False},
          cache_position=None)
    assert len(calls) == 1 and calls[0]["align_own"] is False
    for attention in (hf.kvfid_triton_attention, native.kvfid_native_attention):
        with pytest.raises(ValueError, match="keyword 'kernel_optons' looks like a misspelling"):
            _call(attention, 1, 7, position_ids=torch.tensor([[6]]), kernel_optons={"config": None})
