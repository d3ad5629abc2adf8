"""Tiny random-weight models of the decoder families of issue 17, built from transformers' own
config classes (no hub): the tests' one builder of such models. `model` returns one in memory
(tests/mode_models.py measures it at the transformers level); `build` saves it with
`save_pretrained` into a folder loadable as `hf:<folder>`.

Every model is small (hidden <= 256, 2-4 layers, the byte codec's 260-token vocabulary) and
seeded. Windows are small (8 positions) so a short run crosses them; where a family mixes local
and global layers the layer pattern puts both kinds in few layers.

    from tests.families import FAMILIES, build
    folder = build("gemma3", tmp_path / "gemma3")      # then load_model(f"hf:{folder}")
"""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 8
_VOCAB = 260                      # harness.protocol.models.ByteCodec.vocab_size
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


def _falcon_h1():
    """Not a family of the issue's table: hybrid layers (Mamba-2 state-space + attention in one
    layer, transformers' LinearAttentionAndFullAttentionLayer)."""
    from transformers import FalconH1Config, FalconH1ForCausalLM
    return FalconH1ForCausalLM, FalconH1Config(
        **_COMMON, num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8)


_BUILDERS = {"gemma3": _gemma3, "mistral-sw": _mistral, "gemma2": _gemma2, "gpt-oss": _gpt_oss,
             "deepseek-v3": _deepseek_v3, "qwen3-next": _qwen3_next, "qwen3-moe": _qwen3_moe,
             "olmo2": _olmo2, "smollm3": _smollm3}

FAMILIES = tuple(_BUILDERS)
EXTRA = {"falcon-h1": _falcon_h1}   # built by `build` too, not in FAMILIES
SEED = 17


def model(family: str, *, dtype: torch.dtype = torch.float32, experts: str | None = None,
          **config) -> torch.nn.Module:
    """A seeded random-weight model of `family` (initialised in fp32, then cast to `dtype`), eval
    mode, CPU; `experts` picks transformers' experts_implementation (None: its default); `config`
    sets fields of the family's config (e.g. more layers)."""
    builders = {**_BUILDERS, **EXTRA}
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
