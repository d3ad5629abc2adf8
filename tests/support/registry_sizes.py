"""The registry walk's tiny sizes: every causal-LM family of transformers' registry built small
from its own config class (tests/support/registry_walk.py measures them).

A family is shrunk by overriding the size fields its config has (`TINY`: hidden size, layers,
heads, vocabulary, experts, state sizes and scan chunks, ...) in the config and in each of its
sub-configs (a multimodal model's text, vision and audio towers); its layers are cut to one of
each distinct layer type, in the order the full model first has them (a hybrid keeps a
recurrent and an attention layer, layer 0 being whatever the full model's layer 0 is), with
every per-layer list cut alike; an MLA config gets as many K/V heads as query heads. What
these generic rules cannot size, `FAMILY` sets per family. A config that rejects the sizes, or
a model that transformers' own forward cannot run from them, is not built, with the first line
of the error (`first_line`).
"""

from __future__ import annotations

import torch

TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            bos_token_id=256, eos_token_id=257, pad_token_id=257, tie_word_embeddings=False,
            moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32,
            kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
            v_head_dim=32, sliding_window=8, initializer_range=0.08, n_group=1, topk_group=1,
            vocab_size_per_layer_input=260, hidden_size_per_layer_input=16,
            is_decoder=True,   # a BERT-like ForCausalLM is a decoder only so (else bidirectional)
            n_input_layers=1, n_output_layers=0,   # a looped model: one input layer, one looped
            # state-space and linear-attention layers: small states, short scan chunks (a chunked
            # scan pads to its chunk, and a 256-token chunk would cost most of the walk)
            mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_expand=1,
            mamba_chunk_size=8, chunk_size=8, ssm_state_size=16, state_size=16, expand=1,
            mamba_num_heads=4, mamba_head_dim=16, mamba_headdim=16, n_mamba_heads=4, n_groups=1,
            mamba_n_groups=1, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=16,
            linear_num_heads=4, block_size=8, lru_width=64,
            # vision and audio towers of a multimodal config: small images, few patches
            image_size=32, patch_size=8, num_channels=3, embed_dim=64, projection_dim=64,
            vision_output_dim=64, out_hidden_size=64, text_hidden_size=64,
            # the decoder of an encoder-decoder family, and configs that name sizes their own way
            d_model=64, decoder_layers=2, encoder_layers=1, decoder_attention_heads=4,
            encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128)

# Sizes the generic rules leave wrong, per model_type (applied to the text config).
FAMILY = {
    "mamba2": dict(num_heads=4),
    "bamba": dict(attn_layer_indices=[1]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "zamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2),
    "zaya": dict(num_experts_per_tok=1),
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, laurel_rank=8,
                         intermediate_size=[128] * 4,
                         layer_types=["sliding_attention", "full_attention"] * 2,
                         activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0]),
    "kolibri1_1": dict(index_num_heads=2, index_layers=[1], kv_source_layers=[0, 1],
                       mlp_only_layers=[0], mlp_only_intermediate_size=128, index_topk=8,
                       index_pool_size=64, index_compression=2, index_num_local_tokens=4,
                       index_num_sink_tokens=1),
    "dots3_note_text": dict(index_head_dim=32, index_n_heads=2, index_topk=8,
                            shared_experts_intermediate_size=32, qk_nope_head_dim=8,
                            qk_rope_head_dim=8),
    "cohere_compass_text": dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                           indexer_budget=8, indexer_compress_ratio=2, hc_lowrank=16,
                           ple_embed_dim=64, ngram_vocab_size_base=1024, heads_per_ngram=2,
                           split_ngram_parts=4, make_ngram_vocab_size_divisible_by=8),
    "xlnet": dict(n_head=4, d_head=16, d_inner=128, n_layer=2),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "gemma4_unified_assistant": dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0),
    "blt": dict(encoder_hash_byte_group_vocab=1024),
    "xlstm": dict(num_heads=4, qk_dim_factor=1.0),
    "xmod": dict(default_language="en_XX"),
    "prophetnet": dict(num_encoder_layers=1, num_decoder_layers=2),
    "musicgen_decoder": dict(num_codebooks=1),
    "musicgen_melody_decoder": dict(num_codebooks=1),
    "reformer": dict(is_decoder=True, attn_layers=["local", "lsh"], axial_pos_shape=[16, 32],
                     axial_pos_embds_dim=[32, 32], num_hashes=1),
}

# Fields some configs refuse to be given (read-only properties, fields they do not support).
_UNSET = {"falcon": ("head_dim",), "xlstm": ("v_head_dim", "qk_head_dim"),
          "prophetnet": ("num_hidden_layers",), "xlnet": ("max_position_embeddings",)}
# Per-layer lists: cut alike when the layers are cut.
_LAYER_TYPES = ("layer_types", "layers_block_type", "block_types")


def first_line(err: BaseException) -> str:
    """`Type: the first line of the message` (at most 160 characters of it; a first line that
    only announces the next, ending in a colon, with the next)."""
    text = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    first = " ".join(text[:2]) if len(text) > 1 and text[0].endswith(":") else (text or [""])[0]
    return f"{type(err).__name__}: {first[:160]}"


def _has(config, name: str) -> bool:
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except Exception:   # noqa: BLE001 -- a per-layer field of a heterogeneous config exists
        return True
    return True


def _layer_plan(defaults, sizes: dict) -> dict:
    """The layers cut to one of each distinct type, in the order the full model first has them
    (at least two), with every per-layer list of the full model cut alike, and the per-layer
    sizes of a heterogeneous config set from `sizes` (else TINY)."""
    layers = getattr(defaults, "num_hidden_layers", None)
    kinds = next((getattr(defaults, f) for f in _LAYER_TYPES
                  if isinstance(getattr(defaults, f, None), list)), None)
    if not isinstance(layers, int) or layers < 2:
        return {}
    first = {}
    for index, kind in enumerate(kinds if kinds and len(kinds) == layers else ()):
        first.setdefault(str(kind), index)
    keep = sorted(first.values()) if len(first) > 1 else [0, 1]
    plan = {"num_hidden_layers": len(keep)}
    for name, value in vars(defaults).items():
        if name.startswith("_"):
            continue
        if isinstance(value, list) and len(value) == layers:
            plan[name] = [value[i] for i in keep]
    if getattr(defaults, "is_heterogeneous", False):   # per-layer sizes, kept layers' re-indexed
        from transformers.integrations.heterogeneity.configuration_utils import (
            _get_explicit_per_layer_overrides)

        plan["per_layer_config"] = {
            keep.index(i): _mla({k: sizes.get(k, TINY.get(k, v)) for k, v in overrides.items()})
            for i, overrides in _get_explicit_per_layer_overrides(defaults).items() if i in keep}
    return plan


def _mla(fields: dict) -> dict:
    """An MLA layer's sizes with as many K/V heads as query heads."""
    if "kv_lora_rank" in fields and "num_key_value_heads" in fields:
        fields["num_key_value_heads"] = fields.get("num_attention_heads", 4)
    return fields


def _sized(config, family: str | None) -> dict:
    """The fields to set on `config` (one config, not its sub-configs); `family`: the registry's
    model type where `config` is its text (or decoder) config."""
    fields = _mla({k: v for k, v in TINY.items() if _has(config, k)})
    kinds = (getattr(config, "model_type", None), family)
    for kind in kinds:
        fields.update({k: v for k, v in FAMILY.get(kind, {}).items() if _has(config, k)})
    own = {k: v for kind in kinds for k, v in FAMILY.get(kind, {}).items() if _has(config, k)}
    fields = {**fields, **_layer_plan(config, fields), **own}
    return {k: v for k, v in fields.items() if not any(k in _UNSET.get(kind, ()) for kind in kinds)}


def config_for(model_type: str, model_cls=None):
    """The tiny config of `model_type` (of the config class `model_cls` takes, where that is a
    text config inside a composite one): its class with the sizes set, sub-configs included."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    own = getattr(model_cls, "config_class", None)
    if isinstance(own, type) and own is not config_cls and getattr(own, "model_type", ""):
        config_cls = own
    try:
        defaults = config_cls()
    except Exception:   # noqa: BLE001 -- defaults that do not validate: the family's fields first
        defaults = config_cls(**FAMILY.get(model_type, {}))
    subs = {name: value for name, value in vars(defaults).items()
            if hasattr(value, "to_dict")
            and name not in ("generation_config", "quantization_config")}
    fields = {k: v for k, v in _sized(defaults, model_type).items() if k not in subs}
    for name, sub in subs.items():
        text = name in ("text_config", "decoder", "decoder_config")
        fields[name] = {**sub.to_dict(), **_sized(sub, model_type if text else None),
                        **FAMILY.get(model_type, {}).get(name, {})}
    return config_cls(**fields)


def tiny_module(model_type: str, model_cls, limit: int = 20_000_000):
    """A seeded fp32 random-weight module of `model_type` at its tiny sizes, checked to be tiny
    and to run transformers' own prefill and decode step (raises if not)."""
    config = config_for(model_type, model_cls)
    with torch.device("meta"):   # counted before any memory is spent on it
        shape = model_cls(config)
    if getattr(shape.config, "is_encoder_decoder", False):   # a decoder of one is not refused
        raise ValueError("an encoder-decoder model")
    size = sum(p.numel() for p in shape.parameters())
    if size > limit:
        raise ValueError(f"not tiny with these fields ({size / 1e6:.0f}M parameters)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = model_cls(config).to(torch.float32).eval()
    ids = torch.tensor([[3, 4, 5]])
    try:   # transformers' own prefill and one decode step, before kvfid touches it
        with torch.no_grad():
            cache = module(input_ids=ids, use_cache=True).get("past_key_values")
            module(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    except Exception as err:   # noqa: BLE001
        raise ValueError(f"transformers' own forward fails: {first_line(err)}") from None
    return module
