"""Every decoder family transformers registers for causal LM, built tiny where its config class
allows, one short `repro` each on sdpa and native+bi: bit-exact, differs, refused (and why), or
could not be built (and why). Not collected by pytest; run as

    PYTHONPATH=$PWD python -m tests.registry_walk [--only NAME,...] [--json OUT]

A family is shrunk by overriding the size fields its config has (hidden size, layers, heads,
vocabulary, experts, ...) with tiny values; a config that rejects them, or a model that cannot be
built or saved from them, is listed as not built, with the first line of the error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

_TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             bos_token_id=256, eos_token_id=257, pad_token_id=257, tie_word_embeddings=False,
             moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32,
             kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
             v_head_dim=32, sliding_window=8, initializer_range=0.08,
             vocab_size_per_layer_input=260, hidden_size_per_layer_input=16)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"


def _has(config, name: str) -> bool:
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except Exception:   # noqa: BLE001 -- a per-layer field of a heterogeneous config exists
        return True
    return True


def registry() -> dict[str, str]:
    """model_type -> causal-LM class name, from transformers' own mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny(model_type: str, folder: Path) -> Path:
    """A seeded tiny random-weight model of `model_type` saved in `folder` (raises if not)."""
    import transformers
    from transformers import AutoConfig

    config_cls = type(AutoConfig.for_model(model_type))
    defaults = config_cls()
    fields = {k: v for k, v in _TINY.items() if _has(defaults, k)}
    config = config_cls(**fields)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("an encoder-decoder model")
    model_cls = getattr(transformers, registry()[model_type])
    with torch.device("meta"):   # counted before any memory is spent on it
        size = sum(p.numel() for p in model_cls(config).parameters())
    if size > 20_000_000:
        raise ValueError(f"not tiny with these fields ({size / 1e6:.0f}M parameters)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = model_cls(config).to(torch.float32).eval()
    ids = torch.tensor([[3, 4, 5]])
    try:   # transformers' own prefill and one decode step, before kvfid touches it
        with torch.no_grad():
            cache = module(input_ids=ids, use_cache=True).get("past_key_values")
            module(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    except Exception as err:   # noqa: BLE001
        raise ValueError(f"transformers' own forward fails: {_first_line(err)}") from None
    module.save_pretrained(folder)
    return folder


def one(folder: Path, stack: str) -> str:
    """One short repro: `bit-exact`, `differs (layer L part)`, `refused: ...`, `error: ...`."""
    from harness.errors import KvfidError
    from harness.stacks.stack import parse_stack
    from harness.diagnoses import repro

    parsed = parse_stack(stack)
    try:
        prepared = repro.prepare(f"hf:{folder}", "Hi", None, None, parsed.backend, parsed.dtype,
                                 parsed.batch_invariant, "cpu", None, 4, 1, "live,prefill", "",
                                 [], "", ignore_eos=True)
        cache = repro.measure(prepared).against_live("prefill").cache
    except KvfidError as err:
        return f"refused (exit {err.exit_code}): {str(err)[:200]}"
    except Exception as err:   # noqa: BLE001 -- the walk lists every outcome, internal ones too
        return f"INTERNAL {_first_line(err)}"
    if cache.bit_exact:
        return "bit-exact"
    return f"differs (layer {cache.first_bad_layer} {cache.first_bad_kv})"


def walk(only=None, stacks=("sdpa/fp32", "native/fp32+bi")) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as root:
        for model_type in sorted(registry()):
            if only and model_type not in only:
                continue
            start, row = time.perf_counter(), {"family": model_type}
            try:
                folder = tiny(model_type, Path(root) / model_type)
            except Exception as err:   # noqa: BLE001
                row["built"] = f"not built: {_first_line(err)}"
            else:
                row["built"] = "built"
                row.update({stack: one(folder, stack) for stack in stacks})
            row["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args(argv)
    rows = walk(set(args.only.split(",")) if args.only else None)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    internal = [r["family"] for r in rows if any("INTERNAL" in str(v) for v in r.values())]
    print(f"{len(rows)} families; internal errors: {', '.join(internal) or 'none'}", file=sys.stderr)
    return 1 if internal else 0


if __name__ == "__main__":
    raise SystemExit(main())
