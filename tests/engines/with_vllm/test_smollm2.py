"""The one SmolLM2 check: kvfid's converted folder loads in vLLM as a trained model (a folder
without `architectures` and with the tied head only under lm_head.weight loaded silently with
uniform logits, every logprob log 1/49152 = -10.80)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make install-vllm`, then `make test-vllm`")

from kvfid.engines import vllm_llm as engine  # noqa: E402
from kvfid.engines.seam import EngineConfig  # noqa: E402
from kvfid.inputs.models import load_model  # noqa: E402


def test_the_converted_smollm2_folder_generates_in_vllm():
    """vLLM's first greedy token is among transformers' top 5 (fp32) and its logprob within 0.3
    of transformers' (a tolerance: bf16 against fp32, a correctness check, not a fidelity one)."""
    import torch

    model = load_model("smollm2-135m")
    prompt = model.codec.prompt_ids("What is the capital of France?")
    with engine.engine(EngineConfig("smollm2-135m", "bf16", len(prompt) + 16)) as llm:
        [(ids, logprobs)] = engine.generate(llm, [prompt], 8)
    uniform = -math.log(49152)
    assert len(ids) == len(logprobs) > 0
    assert max(logprobs) > uniform + 5, logprobs     # greedy tokens far likelier than uniform
    with torch.no_grad():
        logits = model.master(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1]
    reference = torch.log_softmax(logits.double(), -1)
    assert ids[0] in torch.topk(reference, 5).indices.tolist()
    assert abs(float(reference[ids[0]]) - logprobs[0]) < 0.3
