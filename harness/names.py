"""The names the command line offers (dtypes, backends, models, constructions, cases), in a module
that imports nothing heavy: `kvfid --help` lists them without loading torch.

The modules that implement them build their registries from these names, so each is spelled once.
"""

from __future__ import annotations

from pathlib import Path

DTYPE_NAMES = ("bf16", "fp16", "fp32")

# The built-in attention backends and what each is (kvfid.stacks.backends registers them).
BACKENDS = {
    "sdpa": "PyTorch scaled_dot_product_attention",
    "eager": "transformers' eager matmul + softmax",
    "triton": "kvfid Triton batch-invariant attention",
    "native": "kvfid batch-invariant attention in plain PyTorch (the same tiling contract, CPU speed)",
    "twin": "deliberately shape-variant attention (negative control)",
}

# The model presets (kvfid.inputs.models builds one loader per name), then any local folder.
PRESET_NAMES = ("tiny-llama", "tiny-qwen2", "tiny-mistral", "smollm2-135m", "qwen2.5-0.5b-shape",
                "llama-3.2-1b-shape", "smollm2-135m-shape")
MODEL_NAMES = (*PRESET_NAMES, "hf:<folder>")

CONSTRUCTION_HELP = ("live, prefill, incremental, incremental-1, chunked:N, batched:N (N >= 1), "
                     "cobatched:N, cobatched:N+decode (N >= 2), cached:K (K tokens, a fraction "
                     "or `prompt`), spec:k[+all|+none|+ngram|+rateR] (k >= 1 drafts), "
                     "spec:tree:WxD or spec:tree:P1,P2,.. (a draft tree by its nodes' parents)"
                     "[+rateR]; any but live @tpN (built at TP size N, e.g. prefill@tp1)")

# The verdicts of `kvfid repro` (kvfid.diagnoses.repro.verdict).
BIT_EXACT, DIVERGES = "bit-exact", "diverges"
VERDICT_HELP = (f"{BIT_EXACT}: every arm compared with live (the --constructions; not replicas, "
                f"transplants or the crossing) has live's boundary prefix, a bit-identical KV cache and the "
                f"identical suffix; {DIVERGES}: at least one arm does not.")

# The shipped case files: package data in an installed kvfid (kvfid/cases), cases/ in a checkout.
_PACKAGE = Path(__file__).resolve().parent
CASES = _PACKAGE / "cases" if (_PACKAGE / "cases").is_dir() else _PACKAGE.parent / "cases"


def case_names() -> list[str]:
    """The cases shipped in cases/, by name (`kvfid run smoke` is cases/smoke.toml)."""
    return sorted(p.stem for p in CASES.glob("*.toml"))
