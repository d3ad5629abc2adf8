"""kvfid.kernels.hf with the mechanisms of 2025-26 decoders, on tiny random-weight models built from
transformers' config classes: sliding windows over a window cache (Mistral), softcap and windows
(Gemma 2), sinks and windows (gpt-oss), q/k head dim != v head dim (DeepSeek-V3 MLA).

Logits against transformers' eager attention (tolerance), and for the window cache every
construction's cache and logits bitwise equal to the prefill's under the batch-invariant mode.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise_equal, cache_keyword, device
from transformers import DynamicCache

from kvfid.kernels import hf
from kvfid.kernels.invariant.mode import set_batch_invariant_mode

LENGTH = 21
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def build(kind: str) -> torch.nn.Module:
    import transformers as tf

    if kind == "mistral":  # 2 query heads over 1 KV head: the window tests decode in the interpreter
        config = tf.MistralConfig(**{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1},
                                  sliding_window=6)
        cls = tf.MistralForCausalLM
    elif kind == "gemma2":
        config = tf.Gemma2Config(**COMMON, head_dim=32, sliding_window=6, attn_logit_softcapping=5.0,
                                 final_logit_softcapping=None, query_pre_attn_scalar=32)
        cls = tf.Gemma2ForCausalLM
    elif kind == "gpt_oss":
        config = tf.GptOssConfig(**COMMON, head_dim=16, sliding_window=6, num_local_experts=4,
                                 num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
        cls = tf.GptOssForCausalLM
    else:
        config = tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, q_lora_rank=None,
                                     kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                     v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                                     n_group=1, topk_group=1, first_k_dense_replace=1,
                                     moe_intermediate_size=32)
        cls = tf.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval().to(device())
    if kind == "gpt_oss":  # random sinks of a visible size
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 1.0)
    return model


def token_ids(length=LENGTH):
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0)).to(device())


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gpt_oss", "deepseek_v3"])
def test_logits_match_eager(kind):
    model, ids = build(kind), token_ids()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(ids).logits
        model.set_attn_implementation(hf.register())
        out = model(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def build_cache(model, ids, chunk):
    cache = DynamicCache(config=model.config)
    logits = [model(ids[:, s:s + chunk], **{cache_keyword(model): cache}).logits
              for s in range(0, ids.shape[1], chunk)]
    return cache, torch.cat(logits, dim=1)


def test_window_cache_bitwise_equal_across_constructions_under_the_mode():
    """Mistral's window cache keeps 5 keys: decode and chunks see only those (key_start > 0),
    the prefill sees all; the caches and every position's logits are the same bits."""
    model, ids = build("mistral"), token_ids()
    model.set_attn_implementation(hf.register())
    with torch.no_grad(), set_batch_invariant_mode(impl="rowwise"):
        built = {chunk: build_cache(model, ids, chunk) for chunk in (LENGTH, 1, 4)}
    prefill_cache, prefill_logits = built[LENGTH]
    assert prefill_cache.layers[0].keys.shape[2] < LENGTH  # a window cache: it dropped keys
    for chunk in (1, 4):
        cache, logits = built[chunk]
        for layer in range(2):
            for name in ("keys", "values"):
                assert_bitwise_equal(getattr(cache.layers[layer], name),
                                     getattr(prefill_cache.layers[layer], name), f"chunk {chunk} {name}")
        assert_bitwise_equal(logits, prefill_logits, f"chunk {chunk}: logits")


def test_padded_batch_with_a_window_matches_eager():
    """Left padding through the window mask (transformers' own-position ids, as generate builds
    them): the real positions' logits match eager's."""
    model = build("mistral")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1)).to(device())
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(ids, attention_mask=mask, position_ids=positions).logits
        model.set_attn_implementation(hf.register())
        out = model(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)
