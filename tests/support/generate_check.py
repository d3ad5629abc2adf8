"""kvfid's live arm against transformers' `generate` on the same stack: the same tokens and the
same logits, bit for bit, at every step (the live arm is what `generate` does).

`live_against_generate` runs the live arm (kvfid.protocol.protocol.run_live: the prompt, then
greedy tokens fed back one at a time, EOS ignored) with a forward hook keeping each call's
last-position logits, then `model.generate(do_sample=False, output_logits=True,
return_dict_in_generate=True)` for as many new tokens, on the same stack (its dtype, attention
backend and batch-invariant mode), and compares the two with `torch.equal`.
"""

from __future__ import annotations

import torch

from registry_sizes import first_line


def _greedy_generate(module, prompt: list[int], steps: int):
    """`generate`'s greedy tokens and per-step logits (fp32, as it keeps them), EOS ignored."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=steps, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    ids = torch.tensor([prompt], device=next(module.parameters()).device)
    own = module.generation_config   # its EOS and forced tokens would stop or steer greedy
    module.generation_config = GenerationConfig()
    try:
        out = module.generate(ids, generation_config=config)
    finally:
        module.generation_config = own
    return out.sequences[0, len(prompt):].tolist(), [row[0] for row in out.logits]


def live_against_generate(model, stack: str, boundary: int = 4, suffix: int = 2) -> str:
    """`bit-exact`, `differs (...)` at the first step that differs, or `refused (exit N): ...`."""
    from kvfid.errors import KvfidError
    from kvfid.protocol.protocol import run_live
    from kvfid.stacks.stack import check_supports, parse_stack

    prompt = model.codec.prompt_ids("Hi")
    try:
        parsed = parse_stack(stack)
        check_supports(parsed, model, len(prompt) + boundary + suffix)
        with parsed.activate(model) as module:
            kept = []
            hook = module.register_forward_hook(
                lambda _m, _a, out: kept.append(out.logits[0, -1].float()))
            try:
                live = run_live(module, prompt, boundary, suffix, frozenset())
            finally:
                hook.remove()
            tokens = live.generated.tokens + live.suffix.tokens
            try:
                theirs, their_logits = _greedy_generate(module, prompt, len(tokens))
            except Exception as err:   # noqa: BLE001 -- the model's own generate, not kvfid
                return f"refused: generate itself fails on token ids: {first_line(err)}"
    except KvfidError as err:
        return f"refused (exit {err.exit_code}): {str(err)[:200]}"
    for step, (a, b) in enumerate(zip(kept, their_logits)):
        if not torch.equal(a, b.to(a.device)):
            return (f"differs (step {step}: logits max |diff| "
                    f"{float((a.double() - b.double()).abs().max()):.2e})")
    if tokens != theirs or len(kept) != len(their_logits):
        return f"differs (tokens {tokens} against generate's {theirs})"
    return "bit-exact"
