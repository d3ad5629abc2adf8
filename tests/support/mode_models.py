"""Tiny random-weight MoE and hybrid-recurrent models, and the two bitwise checks run on them.

The models are tests/support/families.py's (the tests' one builder): Qwen3-MoE, gpt-oss, DeepSeek-V3
(MLA + MoE) and Qwen3-Next (Gated DeltaNet + full attention + MoE), with eager attention, so the
batch-invariant mode reaches every matmul and softmax. Measured at the transformers level (a
DynamicCache), not through kvfid's boundary state:

* `prefill_vs_incremental`: the prefix in one call against one token at a time (the first token
  alone, as live decoding starts), comparing the last position's logits and every tensor the
  cache holds (keys, values, conv and recurrent states), bit by bit;
* `batch1_vs_batch2`: the prefix alone against the same prefix twice in one batch (row 0).
"""

from __future__ import annotations

import torch

import families

FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next")
# Qwen3-Next as the recurrence and blame tests read it: three linear layers, then a full one.
_CONFIG = {"qwen3_next": dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])}


def build(family: str, *, dtype: torch.dtype = torch.bfloat16,
          experts: str | None = None) -> torch.nn.Module:
    """families' `family` model (spelt with underscores) in `dtype`, eager attention, eval mode,
    CPU; `experts` picks transformers' experts_implementation (None: its default)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    model = families.model(family.replace("_", "-"), dtype=dtype, experts=experts,
                           **_CONFIG.get(family, {}))
    model.set_attn_implementation("eager")
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

    from kvfid.protocol.decode import cache_keyword

    assert sum(steps) == ids.shape[1]
    cache, start, logits = DynamicCache(config=model.config), 0, None
    keyword = cache_keyword(model)   # `cache`, or `past_key_values` before 5.2x
    for n in steps:
        out = model(input_ids=ids[:, start:start + n], **{keyword: cache}, use_cache=True)
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
