"""Small shared pieces for the protocol tests: a cached tiny model and a prompt item."""

from __future__ import annotations

import functools

from harness.protocol.items import Item
from harness.protocol.models import load_model

PROMPT = Item(id="t0", prompt="What is 17*23?", answer="391")


@functools.lru_cache(maxsize=None)
def tiny(name: str = "tiny-llama"):
    """One load per preset per test session (random weights from a fixed seed)."""
    return load_model(name)
