"""Tiny random-weight models of the decoder families of issue 17, built from transformers' own
config classes (no hub): the tests' one builder of such models. `model` returns one in memory
(tests/support/mode_models.py measures it at the transformers level); `build` saves it with
`save_pretrained` into a folder loadable as `hf:<folder>`.

Every model is small (hidden <= 256, 2-4 layers, the byte codec's 260-token vocabulary) and
seeded. Windows are small (8 positions) so a short run crosses them; where a family mixes local
and global layers the layer pattern puts both kinds in few layers.

    from families import FAMILIES, build
    folder = build("gemma3", tmp_path / "gemma3")      # then load_model(f"hf:{folder}")
"""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 8
_VOCAB = 260                      # kvfid.inputs.codecs.ByteCodec.vocab_size
_BOS, _EOS = 256, 257

_COMMON = dict(vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               bos_token_id=_BOS, eos_token_id=_EOS, pad_token_id=_EOS,
               tie_word_embeddings=False, initializer_range=0.08)


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    types = ["sliding_attention"] * 3 + ["full_attention"]      # 5:1-like, both kinds in 4 layers
    return Gemma3ForCausalLM, Gemma3TextConfig(**_COMMON, num_hidden_layers=4,
                                               sliding_window=WINDOW, layer_types=types,
                                               query_pre_attn_scalar=16)


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM, MistralConfig(**_COMMON, num_hidden_layers=2,
                                             sliding_window=WINDOW)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    types = ["sliding_attention", "full_attention"]
    return Gemma2ForCausalLM, Gemma2Config(**_COMMON, num_hidden_layers=2, sliding_window=WINDOW,
                                           layer_types=types, attn_logit_softcapping=50.0,
                                           final_logit_softcapping=30.0,
                                           query_pre_attn_scalar=16)


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM
    types = ["sliding_attention", "full_attention"]
    return GptOssForCausalLM, GptOssConfig(**_COMMON, num_hidden_layers=2, sliding_window=WINDOW,
                                           layer_types=types, num_local_experts=4,
                                           num_experts_per_tok=2)


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    return DeepseekV3ForCausalLM, DeepseekV3Config(
        **{**common, "num_key_value_heads": 4}, num_hidden_layers=2, moe_intermediate_size=32,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32)


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    types = ["linear_attention", "full_attention"]
    return Qwen3NextForCausalLM, Qwen3NextConfig(
        **_COMMON, num_hidden_layers=2, layer_types=types, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(**_COMMON, num_hidden_layers=2,
                                               moe_intermediate_size=32, num_experts=4,
                                               num_experts_per_tok=2, decoder_sparse_step=1)


def _olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM
    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    return Olmo2ForCausalLM, Olmo2Config(**common, num_hidden_layers=2)


def _smollm3():
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    return SmolLM3ForCausalLM, SmolLM3Config(**_COMMON, num_hidden_layers=4,
                                             no_rope_layer_interval=2)   # every 2nd layer: NoPE


def _llama4():
    """Not a family of issue 17's table: Llama 4's text model, block-local (chunked) layers with
    RoPE beside global NoPE layers, MoE on every other layer; chunks of WINDOW positions."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    return Llama4ForCausalLM, Llama4TextConfig(
        **_COMMON, intermediate_size_mlp=128, num_hidden_layers=2, no_rope_layer_interval=2,
        attention_chunk_size=WINDOW, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=2)


def _falcon_h1():
    """Not a family of the issue's table: hybrid layers (Mamba-2 state-space + attention in one
    layer, transformers' LinearAttentionAndFullAttentionLayer)."""
    from transformers import FalconH1Config, FalconH1ForCausalLM
    return FalconH1ForCausalLM, FalconH1Config(
        **_COMMON, num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8)


def _bamba():
    """Issue 45's Mamba-2 hybrid: layer 0 Mamba-2, layer 1 attention; its forward numbers a
    call's own tokens from 0 when given no position_ids."""
    from transformers import BambaConfig, BambaForCausalLM
    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    return BambaForCausalLM, BambaConfig(
        **common, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1,
        mamba_chunk_size=WINDOW)

# --------------------------------------------------------------------------- issue 27's families

def _gemma4():
    """Sliding and full layers with different head dims, K = V on the full layers, per-layer
    input embeddings; the last two layers reuse the K/V of the last layer of their type."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    types = ["sliding_attention", "full_attention"] * 2
    return Gemma4ForCausalLM, Gemma4TextConfig(
        **_COMMON, num_hidden_layers=4, sliding_window=WINDOW, layer_types=types,
        num_kv_shared_layers=2, global_head_dim=32, attention_k_eq_v=True,
        num_global_key_value_heads=1, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=_VOCAB)


def _deepseek_v32():
    """MLA with a lightning indexer choosing `index_topk` keys per query."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
    return DeepseekV32ForCausalLM, DeepseekV32Config(
        **{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=2, moe_intermediate_size=32,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, index_topk=WINDOW, index_head_dim=32, index_n_heads=2)


def _deepseek_v4():
    """Sliding, compressed-sparse and heavily compressed layers; hyper-connections."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    common = {k: v for k, v in _COMMON.items() if k not in ("intermediate_size", "head_dim",
                                                             "num_key_value_heads")}
    return DeepseekV4ForCausalLM, DeepseekV4Config(
        **common, num_hidden_layers=3, moe_intermediate_size=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, head_dim=32, q_lora_rank=32,
        num_key_value_heads=1, sliding_window=WINDOW, o_groups=2, o_lora_rank=32,
        index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2, num_nextn_predict_layers=0,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4})


def _minimax():
    """Lightning (linear) attention alternating with full attention, in its own cache class."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM
    return MiniMaxForCausalLM, MiniMaxConfig(**_COMMON, num_hidden_layers=2, num_local_experts=4,
                                             num_experts_per_tok=2, block_size=WINDOW)


def _nemotron_h():
    """Mamba-2, MoE, attention and MLP blocks as separate layers (stateless ones: no cache)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM
    return NemotronHForCausalLM, NemotronHConfig(
        **_COMMON, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        num_hidden_layers=4, ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
        conv_kernel=4, expand=1, chunk_size=WINDOW, n_routed_experts=4, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, num_experts_per_tok=2, use_mamba_kernels=False)


def _qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    return Qwen3_5ForCausalLM, Qwen3_5TextConfig(
        **_COMMON, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4)


def _kimi_linear():
    """Kimi Delta Attention (KDA) beside MLA."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    return KimiLinearForCausalLM, KimiLinearConfig(
        **{**common, "num_key_value_heads": 4}, num_hidden_layers=2, moe_intermediate_size=32,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"], linear_head_dim=16,
        linear_num_heads=4, linear_conv_kernel_dim=4)


def _olmo_hybrid():
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM
    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    return OlmoHybridForCausalLM, OlmoHybridConfig(
        **common, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4)


def _granite_4h():
    """Granite 4.0-H: Mamba-2 layers beside attention."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    return GraniteMoeHybridForCausalLM, GraniteMoeHybridConfig(
        **common, num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1,
        mamba_chunk_size=WINDOW, num_local_experts=4, num_experts_per_tok=2)


NEWEST = {"gemma4": _gemma4, "deepseek-v32": _deepseek_v32, "deepseek-v4": _deepseek_v4,
          "minimax": _minimax, "nemotron-h": _nemotron_h, "qwen3.5": _qwen3_5,
          "kimi-linear": _kimi_linear, "olmo-hybrid": _olmo_hybrid, "granite-4h": _granite_4h}

_BUILDERS = {"gemma3": _gemma3, "mistral-sw": _mistral, "gemma2": _gemma2, "gpt-oss": _gpt_oss,
             "deepseek-v3": _deepseek_v3, "qwen3-next": _qwen3_next, "qwen3-moe": _qwen3_moe,
             "olmo2": _olmo2, "smollm3": _smollm3}

FAMILIES = tuple(_BUILDERS)
EXTRA = {"falcon-h1": _falcon_h1, "llama4": _llama4}   # built by `build` too, not in FAMILIES
POSITIONS = {"bamba": _bamba}       # issue 45's; built by `build` too (seeded after the others)
NEWEST_FAMILIES = tuple(NEWEST)     # issue 27's; built by `build` too
SEED = 17


def model(family: str, *, dtype: torch.dtype = torch.float32, experts: str | None = None,
          **config) -> torch.nn.Module:
    """A seeded random-weight model of `family` (initialised in fp32, then cast to `dtype`), eval
    mode, CPU; `experts` picks transformers' experts_implementation (None: its default); `config`
    sets fields of the family's config (e.g. more layers)."""
    builders = {**_BUILDERS, **EXTRA, **NEWEST, **POSITIONS}
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(builders)}")
    model_cls, family_config = builders[family]()
    for name, value in config.items():
        setattr(family_config, name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + list(builders).index(family))
        module = model_cls(family_config).to(torch.float32).eval()
    if experts is not None:
        module.set_experts_implementation(experts)
    return module.to(dtype)


def build(family: str, folder) -> Path:
    """Save a seeded random-weight model of `family` (fp32) into `folder`; returns the folder.
    Loaded with `load_model(f"hf:{folder}")` (no tokenizer is saved: the byte codec is used)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model(family).save_pretrained(folder)
    return folder
