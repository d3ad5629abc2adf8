"""The engines kvfid drives, by name: the one place that lists them. Adding an engine is one
module (its `ENGINE`, a kvfid.engines.seam.Engine) and one line in `ENGINES`. An engine's module
is imported when it is first asked for (the engines import their own libraries lazily too, so
`kvfid --help` and the other commands load neither vLLM nor torch from here)."""

from __future__ import annotations

import importlib

from kvfid.engines.seam import Engine
from kvfid.errors import BadInput

# name -> "module:attribute" of its Engine
ENGINES: dict[str, str] = {
    "vllm": "kvfid.engines.vllm_engine:ENGINE",
    "transformers": "kvfid.engines.transformers_engine:ENGINE",
}

_REGISTERED: dict[str, Engine] = {}


def register_engine(engine: Engine) -> None:
    """An engine made elsewhere (a stand-in in a test, a user's), under its own name."""
    _REGISTERED[engine.name] = engine


def unregister_engine(name: str) -> None:
    _REGISTERED.pop(name, None)


def engine_names() -> list[str]:
    return [*ENGINES, *(n for n in _REGISTERED if n not in ENGINES)]


def engine_for(name: str) -> Engine:
    """The engine called `name`, or BadInput (exit 2) naming the ones there are."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in ENGINES:
        raise BadInput(f"--engine {name!r}: one of {', '.join(engine_names())}")
    module, _, attribute = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attribute)
