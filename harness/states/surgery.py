"""Transplant surgery: a new boundary state from a recipient (prefix and boundary logits kept)
and a selection of a donor's layer states.

A selection names layers [A, B), parts (`keys`, `values`, `recurrent`, `conv`; default all) and
positions (absolute, half-open; `prompt` / `generated`). Positions apply to the parts with a
position axis (K/V, of a full layer or of the positions a window holds); a recurrent or conv
state has no positions, so with a position range it moves only when the selection names it.
A layer that holds no state and reads another layer's K/V (`shared:J`) is transplanted through
its owner J: selecting it moves J's state. Held parts (an indexer's keys, compressor buffers, a
model cache's own per-layer state) move with `all`; `indexer_keys` has positions like k and v.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvfid.states.cache import BoundaryState, bits
from kvfid.states.layers import POSITIONAL, RECURRENT

_WORDS = {"keys": "k", "values": "v", "recurrent": "recurrent", "conv": "conv"}


@dataclass(frozen=True)
class Selection:
    """Which part of a donor's state a transplant takes: layers [lo, hi), parts, positions.
    `keys` / `values` are the K/V switches of earlier kvfid; `parts` names recurrent parts."""

    layers: tuple[int, int] | None = None
    keys: bool = True
    values: bool = True
    positions: str | tuple[int, int] | None = None   # "prompt" | "generated" | (lo, hi)
    parts: tuple[str, ...] | None = None             # None: every part (as keys/values say)

    def takes(self, name: str) -> bool:
        """Whether part `name` (k, v, recurrent, conv, recurrent.1, ...) is selected."""
        base = name.split(".")[0]
        if self.parts is not None:
            return base in self.parts
        if base in POSITIONAL:   # an indexer's keys move with the keys
            return self.values if base == "v" else self.keys
        return self.keys and self.values and self.positions is None

    @property
    def label(self) -> str:
        parts = []
        if self.layers:
            parts.append(f"layers={self.layers[0]}-{self.layers[1]}")
        if self.parts is not None:
            parts += [word for word, name in _WORDS.items() if name in self.parts]
        elif not (self.keys and self.values):
            parts.append("keys" if self.keys else "values")
        if self.positions is not None:
            p = self.positions
            parts.append(f"positions={p if isinstance(p, str) else f'{p[0]}-{p[1]}'}")
        return "+".join(parts) or "all"


SELECTION_HELP = ("all | keys | values | recurrent | conv | layers=A-B | "
                  "positions=prompt|generated|A-B, joined with '+' (ranges are half-open: A "
                  "included, B not; positions select K/V only)")


def parse_selection(text: str) -> Selection:
    """`all`, `keys`, `values`, `recurrent`, `conv`, `layers=0-4`, `positions=generated`, joined
    by '+'."""
    kwargs: dict = {}
    named: list[str] = []
    for part in filter(None, (text or "all").split("+")):
        if part == "all":
            continue
        if part in _WORDS:
            named.append(_WORDS[part])
            continue
        match = re.fullmatch(r"(layers|positions)=(\d+)-(\d+)", part)
        if match and int(match[2]) < int(match[3]):
            kwargs[match[1]] = (int(match[2]), int(match[3]))
        elif part in ("positions=prompt", "positions=generated"):
            kwargs["positions"] = part.split("=")[1]
        else:
            raise ValueError(f"bad transplant selection {part!r}; valid: {SELECTION_HELP}")
    if named and set(named) <= set(POSITIONAL) and len(named) == 1:
        kwargs["keys"], kwargs["values"] = named == ["k"], named == ["v"]   # the old spelling
    elif named:
        kwargs["parts"] = tuple(n for n in (*POSITIONAL, *RECURRENT) if n in named)
    return Selection(**kwargs)


def transplant(recipient, donor, selection: Selection, prompt_length: int):
    """The recipient with the selected part of the donor's state put in place of its own."""
    if recipient.prefix != donor.prefix:
        raise ValueError("transplant needs recipient and donor over the same prefix")
    n_layers, length = len(recipient.layers), len(recipient.prefix)
    lo, hi = selection.layers or (0, n_layers)
    if not 0 <= lo < hi <= n_layers:
        raise ValueError(f"layer range {lo}-{hi} outside 0-{n_layers}")
    named = {None: (0, length), "prompt": (0, prompt_length), "generated": (prompt_length, length)}
    p_lo, p_hi = named.get(selection.positions, selection.positions)
    if not 0 <= p_lo <= p_hi <= length:
        raise ValueError(f"position range {p_lo}-{p_hi} outside 0-{length}")

    layers = list(recipient.layers)
    selected = set(range(lo, hi))
    # A layer that reads another layer's K/V (`shared:J`) moves through its owner J.
    selected |= {recipient.layers[i].owner for i in selected} - {None}
    for index in sorted(selected):
        own, other = recipient.layers[index], donor.layers[index]
        if own.cache_class != other.cache_class or own.span != other.span:
            raise ValueError(f"layer {index}: the donor's {other.kind} state does not fit the "
                             f"recipient's {own.kind} state")
        moved = {}
        for name, tensor in own.parts.items():
            if not selection.takes(name):
                continue
            if name not in POSITIONAL:
                moved[name] = other.parts[name].clone()
                continue
            a, b = max(p_lo, own.start) - own.start, min(p_hi, own.span[1]) - own.start
            out = tensor.clone()
            if a < b:   # along the position axis: [1, H, T, D] (k, v) or [1, T, D] (indexer)
                out.narrow(-2, a, b - a).copy_(other.parts[name].narrow(-2, a, b - a))
            moved[name] = out
        layers[index] = own.replace(**moved)
    return BoundaryState(recipient.prefix, logits=recipient.logits, layers=tuple(layers))


def perturb(state, layer: int, part: str, index: tuple[int, ...] = None):
    """A copy of `state` with the lowest bit of one element of one part flipped (a test's and a
    negative control's way to make two states differ in exactly one known place)."""
    tensor = state.layers[layer].parts[part].clone()
    flat = bits(tensor).view(-1)
    flat[0 if index is None else int(torch.tensor(index) @ torch.tensor(tensor.stride()))] ^= 1
    layers = list(state.layers)
    layers[layer] = layers[layer].replace(**{part: tensor})
    return BoundaryState(state.prefix, logits=state.logits, layers=tuple(layers))
