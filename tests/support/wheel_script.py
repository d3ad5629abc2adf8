"""Run by tests/project/test_wheel.py inside a fresh venv where kvfid's wheel is installed, in a folder
with no checkout around: the CLI's and the API's results, one JSON object on stdout.

It uses what a user has: the `kvfid` command, `import kvfid`, the case files shipped inside the
package. Usage: python wheel_script.py (no arguments; the test compares with the checkout's)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

REPRO = ["--model", "tiny-llama", "--prompt", "What is 2+2?", "--backend", "native", "--dtype",
         "bf16", "--batch-invariant", "--threads", "1", "-B", "6", "-S", "4", "--ignore-eos",
         "--arms", "live,prefill,chunked:3"]
REPLAY_STACK = ("native", "fp32", True, 1)      # backend, dtype, batch-invariant, threads
REPLAY_ROWS = 2         # the shipped rollouts' first trajectories (each SmolLM2 replay costs)


def arms_of(record: dict) -> dict:
    return {label: arm["cache_sha"] for label, arm in record["arms"].items()}


def main() -> None:
    import torch

    import kvfid

    out = {"kvfid": str(Path(kvfid.__file__).parent), "version": kvfid.__version__,
           "torch": torch.__version__}
    command = str(Path(sys.executable).parent / "kvfid")
    out["cli_version"] = subprocess.run([command, "--version"], capture_output=True, text=True,
                                        check=True).stdout.strip()
    shown = subprocess.run([command, "repro", *REPRO, "--format", "json"], capture_output=True,
                           text=True)
    record = json.loads(shown.stdout)
    out["cli_repro"] = {"exit": shown.returncode, "verdict": record["verdict"],
                        "arms": arms_of(record)}
    outcome = kvfid.repro("tiny-llama", "What is 2+2?", stack="native/bf16+bi@t1", boundary=6,
                          suffix=4, ignore_eos=True, arms=["live", "prefill", "chunked:3"])
    out["api_repro"] = {"verdict": outcome.verdict, "arms": arms_of(outcome.to_json())}

    model = kvfid.load_model("tiny-llama")
    ids = torch.tensor([model.codec.prompt_ids("Hello")])
    with kvfid.Stack.parse("native/fp32+bi@t1").activate(model) as module:
        key = kvfid.cache_keyword(module)
        caches = [kvfid.read_state(c, module.config) for c in _two_caches(module, ids, key)]
    exact = kvfid.compare_states(*caches).bit_exact
    caches[1].layers[1].parts["v"][0, 0, 3, 0] += 1.0
    changed = kvfid.compare_states(*caches)
    out["compare_states"] = [exact, changed.bit_exact, changed.first_bad_layer,
                             changed.first_bad_kv, changed.first_position]

    rollouts = resources.files("kvfid") / "cases" / "rollouts-smollm2.jsonl"
    rows = [json.loads(line) for line in rollouts.read_text().splitlines()[:REPLAY_ROWS]]
    backend, dtype, bi, threads = REPLAY_STACK
    result = kvfid.replay(rows, "smollm2-135m",
                          stack=kvfid.Stack(backend, dtype, bi, threads=threads),
                          constructions=["prefill"])
    out["api_replay"] = [m.differ for m in result.mismatch("prefill")]

    a, b = torch.randn(7, 64), torch.randn(64, 32)
    with kvfid.batch_invariant_mode(impl="rowwise"):
        out["mode"] = torch.equal((a @ b)[:1], a[:1] @ b)
    print(json.dumps(out))


def _two_caches(module, ids, key):
    """A prefill's cache and one token at a time's, over the same ids."""
    from transformers import DynamicCache

    prefill, stepped = DynamicCache(config=module.config), DynamicCache(config=module.config)
    module(input_ids=ids, **{key: prefill})
    for t in range(ids.shape[1]):
        module(input_ids=ids[:, t:t + 1], **{key: stepped})
    return prefill, stepped


if __name__ == "__main__":
    main()
