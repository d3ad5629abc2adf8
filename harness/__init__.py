"""kvfid: is a rebuilt KV state the live state? Per kernel, precision and stack.

The package's one piece of import-time set-up lives here: without CUDA, kvfid's Triton kernels
run in Triton's interpreter, and TRITON_INTERPRET must be set before they are decorated. Importing
`kvfid` loads nothing heavy (`kvfid --help` starts without torch): a finder placed first on
`sys.meta_path` makes that choice at the first import of triton (by kvfid's kernels, or by
transformers loading a model), then steps aside. A user's own TRITON_INTERPRET is kept.

The Python API (kvfid.api; docs/api.md) is reached from here by name, loaded on first use:
`kvfid.repro(...)`, `kvfid.compare_states(a, b)`, `kvfid.replay(...)`, `kvfid.Stack`, ...
"""

from __future__ import annotations

import os
import sys


def _select_interpreter() -> None:
    """TRITON_INTERPRET=1 where torch sees no CUDA device, unless the variable is already set."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


class _BeforeTriton:
    """A meta path finder that finds nothing: at the first import of triton it selects the
    interpreter, then removes itself (torch, which it imports for that, does not import triton)."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _select_interpreter()
        return None


if "triton" in sys.modules:       # triton came first: kvfid's kernels are not decorated yet
    _select_interpreter()
elif not any(isinstance(finder, _BeforeTriton) for finder in sys.meta_path):
    sys.meta_path.insert(0, _BeforeTriton())


# The public names, each with its one-line purpose in docs/api.md (tests/commands/test_api.py holds both).
__all__ = ["Stack", "Model", "load_model", "repro", "ReproOutcome", "read_state",
           "compare_states", "CacheDiff", "BoundaryState", "replay", "ReplayResult",
           "batch_invariant_mode", "set_batch_invariant_mode", "faithful_recurrence",
           "cache_keyword", "Construction", "parse_construction", "TransplantSpec",
           "__version__"]


def __getattr__(name: str):
    """A public name, from kvfid.api on first use (so `import kvfid` stays light)."""
    if name == "__version__":
        from importlib import metadata

        try:
            return metadata.version("kvfid")
        except metadata.PackageNotFoundError:   # a source tree on PYTHONPATH, not installed
            return "unknown"
    if name in __all__:
        from kvfid import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvfid' has no attribute {name!r}")
