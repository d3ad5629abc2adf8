"""Small shared pieces for the protocol tests: cached tiny models and a prompt item."""

from __future__ import annotations

import contextlib
import functools

from kvfid.inputs.items import Item
from kvfid.inputs.models import load_model

PROMPT = Item(id="t0", prompt="What is 17*23?", answer="391")


@functools.lru_cache(maxsize=None)
def tiny(name: str = "tiny-llama"):
    """One load per preset per test session (random weights from a fixed seed)."""
    return load_model(name)


_FAMILIES = {"tiny-llama": ("llama", 1), "tiny-qwen2": ("qwen2", 2), "tiny-mistral": ("mistral", 3)}


@functools.lru_cache(maxsize=None)
def small(name: str = "tiny-llama", layers: int = 2):
    """Preset `name` (its family, seed, byte codec and width) at `layers` layers (2: half its
    depth), 2 query heads over 1 KV head (still GQA), head dim 32. For tests whose claim does not
    need the preset's size: the Triton interpreter and torch.compile cost grows with layers x KV
    heads. Loaded once per session, like `tiny`."""
    from kvfid.inputs import models

    family, seed = _FAMILIES[name]
    config = {**models._TINY, "num_hidden_layers": layers, "num_attention_heads": 2,
              "num_key_value_heads": 1}
    if family == "mistral":
        config["sliding_window"] = None
    suffix = "small" if layers == 2 else f"small-{layers}l"
    return models._random_model(f"{name}-{suffix}", family, config, seed=seed)


@contextlib.contextmanager
def fp32_live(name: str, B: int = 8, S: int = 4):
    """Inside the sdpa/fp32 stack of tiny model `name`: (model, module, prompt, live arm, P, the
    boundary logits of one no-cache forward over P) — what a construction's state must give."""
    import torch

    from kvfid.stacks.stack import Stack
    from kvfid.protocol.decode import Runner
    from kvfid.protocol.protocol import run_live

    model = tiny(name)
    prompt = model.codec.prompt_ids(PROMPT.prompt)
    with Stack("sdpa", "fp32").activate(model) as module:
        live = run_live(module, prompt, B, S, model.codec.eos_ids)
        prefix = list(live.state.prefix)
        full = Runner(module).full_logits(torch.tensor([prefix]))[0, -1]   # [V]
        yield model, module, prompt, live, prefix, full
