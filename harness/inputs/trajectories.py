"""Supplied trajectories: the JSONL file `kvfid replay` and a replay case read, checked line by line.

One line per trajectory: `{"id"?, "prompt_ids": [...] | "prompt": "...", "tokens": [...],
"logprobs"?: [...]}`. `logprobs`, when present, is what the engine that sampled the tokens
reported for each continuation token (its sampler's log-probability of the token it picked, one
per token): the **engine reference** that the replay's three gaps are measured against. A file
has them on every line or on none; a count that does not match the tokens, or a value that is not
a finite number, is refused with the line number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvfid.errors import BadInput
from kvfid.inputs import items
from kvfid.inputs.models import load_model


@dataclass(frozen=True)
class Trajectory:
    """A prompt (token ids, chat template applied), its recorded continuation and, when the
    file carries them, the engine's logprob of each continuation token."""

    id: str
    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None


def load_trajectories(path: str | Path, codec=None) -> list[Trajectory]:
    """Read the JSONL trajectories (a text prompt needs `codec` for its chat template). Raises
    ValueError naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the trajectories ({err})") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            where = f"{path}:{number}"
            try:
                rows.append((where, number, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not JSON ({err.msg})") from None
    if not rows:
        raise ValueError(f"{path}: no trajectories")
    return _checked(rows, codec)


def trajectories_from_rows(rows, codec=None) -> list[Trajectory]:
    """Trajectories given in memory: each a Trajectory or a dict as a line of the JSONL file
    (`prompt_ids` or `prompt`, `tokens`, optional `id` and `logprobs`). Raises ValueError naming
    the row."""
    given = [(f"row {n}", n, r) for n, r in enumerate(rows)]
    if not given:
        raise ValueError("no trajectories")
    return _checked(given, codec)


def _checked(rows: list[tuple], codec) -> list[Trajectory]:
    """Each (where, number, row) read and checked; an engine reference on every row or none."""
    out, with_logprobs = [], None
    for where, number, row in rows:
        t = row if isinstance(row, Trajectory) else _trajectory(row, where, number, codec)
        if with_logprobs is None:
            with_logprobs = t.logprobs is not None
        elif with_logprobs != (t.logprobs is not None):
            raise ValueError(f"{where}: logprobs on some lines and not on others; an engine "
                             "reference is given for every trajectory or for none")
        out.append(t)
    return out


def _trajectory(row, where: str, number: int, codec) -> Trajectory:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with prompt_ids or prompt, and tokens")
    if "prompt_ids" in row:
        prompt = _ids(row["prompt_ids"], where, "prompt_ids")
    elif isinstance(row.get("prompt"), str) and row["prompt"] and codec is not None:
        prompt = tuple(codec.prompt_ids(row["prompt"]))
    else:
        raise ValueError(f"{where}: needs prompt_ids (a non-empty list of token ids) or a "
                         "non-empty prompt text")
    tokens = _ids(row.get("tokens"), where, "tokens")
    logprobs = row.get("logprobs")
    return Trajectory(str(row.get("id", f"line-{number}")), prompt, tokens,
                      None if logprobs is None else _logprobs(logprobs, len(tokens), where))


def _ids(value, where: str, key: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ValueError(f"{where}: {key} must be a non-empty list of token ids (integers >= 0)")
    return tuple(value)


def _logprobs(value, count: int, where: str) -> tuple[float, ...]:
    """One finite number per continuation token (JSON has no NaN, but Python's reader takes it)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: logprobs must be a list of numbers, one per token")
    if len(value) != count:
        raise ValueError(f"{where}: {len(value)} logprobs for {count} tokens; one per token")
    for position, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where}: logprobs[{position}] = {v!r} is not a finite number")
    return tuple(float(v) for v in value)


def check_fits(trajectories: list[Trajectory], vocab_size: int, context_length: int) -> None:
    """Refuse token ids outside the vocabulary and trajectories longer than the context."""
    for t in trajectories:
        if max(t.prompt_ids + t.tokens) >= vocab_size:
            raise ValueError(f"trajectory {t.id}: a token id >= the vocabulary size {vocab_size}")
        if len(t.prompt_ids) + len(t.tokens) > context_length:
            raise ValueError(f"trajectory {t.id}: {len(t.prompt_ids) + len(t.tokens)} tokens exceed "
                             f"the context of {context_length}")


def as_row(t: Trajectory, **extra) -> dict:
    """The JSONL row of a trajectory (what `kvfid rollouts` writes), with extra provenance."""
    row = {"id": t.id, "prompt_ids": list(t.prompt_ids), "tokens": list(t.tokens)}
    if t.logprobs is not None:
        row["logprobs"] = list(t.logprobs)
    return {**row, **extra}


def items_and_codec(model_name: str, item_set: str, count: int):
    """The first `count` items of `item_set` (BadInput naming --item-set) and the model's codec:
    what every engine-side sampler starts from."""
    try:
        chosen = items.load_item_set(item_set, count)
    except ValueError as err:
        raise BadInput(f"--item-set {item_set}: {err}") from None
    return chosen, load_model(model_name).codec
