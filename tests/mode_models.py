"""Tiny random-weight MoE and hybrid-recurrent models, and the two bitwise checks run on them.

Built from transformers' own config classes (no hub): Qwen3-MoE, gpt-oss, DeepSeek-V3 (MLA + MoE)
and Qwen3-Next (Gated DeltaNet + full attention + MoE), hidden 64-128, 2-4 layers, seeded.
Measured at the transformers level (a DynamicCache), not through kvfid's boundary state:

* `prefill_vs_incremental`: the prefix in one call against one token at a time (the first token
  alone, as live decoding starts), comparing the last position's logits and every tensor the
  cache holds (keys, values, conv and recurrent states), bit by bit;
* `batch1_vs_batch2`: the prefix alone against the same prefix twice in one batch (row 0).
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next")


def build(family: str, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          experts: str | None = None) -> torch.nn.Module:
    """A tiny `family` model in `dtype`, eval mode, CPU; `experts` picks transformers'
    experts_implementation (None: its default)."""
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, head_dim=16)
    if family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                                   num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    elif family == "gpt_oss":
        config = tf.GptOssConfig(**common, intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                                 num_experts_per_tok=2, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"])
    elif family == "deepseek_v3":
        common.pop("head_dim")
        common["num_key_value_heads"] = 4  # MLA: one latent serves every head
        config = tf.DeepseekV3Config(**common, intermediate_size=128, moe_intermediate_size=32,
                                     num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8,
                                     num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                     q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
                                     qk_rope_head_dim=16, v_head_dim=32)
    elif family == "qwen3_next":
        config = tf.Qwen3NextConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, num_hidden_layers=4,
                                    num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=16,
                                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                    layer_types=["linear_attention", "linear_attention",
                                                 "linear_attention", "full_attention"])
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def prompt(length: int, *, seed: int = 1, batch: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))
    return ids.expand(batch, length).contiguous()  # [batch, length]


def cache_tensors(cache) -> dict[str, torch.Tensor]:
    """Every tensor a DynamicCache holds, by `layer.part` (keys, values, conv, recurrent)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        for part in ("keys", "values"):
            t = getattr(layer, part, None)
            if isinstance(t, torch.Tensor) and t.numel():
                out[f"{i}.{part}"] = t
        for part, states in (("conv", getattr(layer, "conv_states", {})),
                             ("recurrent", getattr(layer, "recurrent_states", {}))):
            for idx, t in (states or {}).items():
                if isinstance(t, torch.Tensor):
                    out[f"{i}.{part}{idx or ''}"] = t
    return out


@torch.no_grad()
def run(model, ids: torch.Tensor, steps: list[int]):
    """Forward `ids` [B, T] in consecutive calls of the given lengths, one DynamicCache: (logits
    of the last position [B, V], the cache's tensors)."""
    from transformers import DynamicCache

    assert sum(steps) == ids.shape[1]
    cache, start, logits = DynamicCache(config=model.config), 0, None
    for n in steps:
        out = model(input_ids=ids[:, start:start + n], cache=cache, use_cache=True)
        logits, start = out.logits[:, -1], start + n
    return logits, {k: v.clone() for k, v in cache_tensors(cache).items()}


def differing(a: tuple, b: tuple, row: int | None = None) -> list[str]:
    """Names of the parts (`logits`, cache tensors) whose bits differ; `row` compares one batch row
    of b against a."""
    pick = (lambda t: t) if row is None else (lambda t: t[row:row + 1])
    names = [] if torch.equal(a[0], pick(b[0])) else ["logits"]
    assert a[1].keys() == b[1].keys(), (sorted(a[1]), sorted(b[1]))
    return names + [k for k in a[1] if not torch.equal(a[1][k], pick(b[1][k]))]


def prefill_vs_incremental(model, length: int = 12) -> list[str]:
    ids = prompt(length)
    return differing(run(model, ids, [length]), run(model, ids, [1] * length))


def batch1_vs_batch2(model, length: int = 12) -> list[str]:
    return differing(run(model, prompt(length), [length]), run(model, prompt(length, batch=2), [length]), row=0)
