"""A stack's model is the model users load: kvfid's copy at a dtype equals transformers'
`from_pretrained(folder, dtype=...)` bit for bit (parameters, buffers and their dtypes, logits),
for random presets, a family with an fp32-kept module, and SmolLM2. The twin shows why:
`module.to(dtype)` (kvfid's earlier cast) rounds the rotary frequencies and is another model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from families import build
from kvfid.inputs import models
from kvfid.inputs.models import load_model

IDS = torch.tensor([[256, 258, *b"Omar saves 27 dollars every week.", 259]])


def loaded(folder, dtype) -> torch.nn.Module:
    """The reference: transformers' own loading of the folder at `dtype`."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def differences(ours: torch.nn.Module, theirs: torch.nn.Module) -> list[str]:
    """Every parameter or buffer whose name, dtype or bits differ, and the logits."""
    found = []
    for kind in ("named_parameters", "named_buffers"):
        a, b = dict(getattr(ours, kind)()), dict(getattr(theirs, kind)())
        found += [f"{kind}: {name} only on one side" for name in a.keys() ^ b.keys()]
        for name in a.keys() & b.keys():
            if a[name].dtype != b[name].dtype:
                found.append(f"{name}: {a[name].dtype} vs {b[name].dtype}")
            elif not torch.equal(a[name], b[name]):
                found.append(f"{name}: max |diff| {(a[name].float() - b[name].float()).abs().max()}")
    with torch.no_grad():
        la, lb = ours(IDS[:, :ours.config.max_position_embeddings]).logits, theirs(IDS).logits
    if not torch.equal(la, lb):
        found.append(f"logits: max |diff| {(la.float() - lb.float()).abs().max().item()}")
    return found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_a_preset_at_a_dtype_is_the_model_transformers_loads(name, dtype, tmp_path):
    model = load_model(name)
    model.master.save_pretrained(tmp_path)
    assert differences(model.cast(dtype), loaded(tmp_path, dtype)) == []
    rotary = dict(model.cast(dtype).named_buffers())["model.rotary_emb.inv_freq"]
    assert rotary.dtype == torch.float32   # as transformers keeps it


def test_module_to_dtype_is_not_that_model(tmp_path):
    """The negative control: the plain cast rounds `inv_freq` to bf16, and the logits move."""
    model = load_model("tiny-llama")
    model.master.save_pretrained(tmp_path)
    plain = models.loaded_at(model.master, torch.float32).to(torch.bfloat16)
    found = differences(plain, loaded(tmp_path, torch.bfloat16))
    assert any(line.startswith("model.rotary_emb.inv_freq: torch.bfloat16") for line in found)
    assert any(line.startswith("logits:") for line in found), found


def test_a_module_transformers_keeps_in_fp32_stays_fp32(tmp_path):
    """DeepSeek-V3 keeps its router (`gate.weight`, `e_score_correction_bias`) in fp32 at bf16
    (`_keep_in_fp32_modules_strict`); the copy follows transformers' dtype plan, not `.to()`."""
    folder = build("deepseek-v3", tmp_path / "ds")
    model = load_model(f"hf:{folder}")
    ours = model.cast(torch.bfloat16)
    assert differences(ours, loaded(folder, torch.bfloat16)) == []
    strict = type(ours)._keep_in_fp32_modules_strict      # 5.24: the bias and gate.weight
    tensors = [*ours.named_parameters(), *ours.named_buffers()]
    kept = {name for name, t in tensors if t.dtype == torch.float32 and "rotary_emb" not in name}
    assert kept and all(any(entry in name for entry in strict) for name in kept), (kept, strict)


@pytest.mark.slow
def test_smollm2_bf16_is_from_pretrained_bit_for_bit(smollm2_conversion):
    """The session's conversion is published first: loaded here, not converted again."""
    model = load_model("smollm2-135m")
    folder = models.converted_folder(models.smollm2_gguf_path())
    assert differences(model.cast(torch.bfloat16), loaded(folder, torch.bfloat16)) == []
