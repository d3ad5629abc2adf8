"""Boundary states: KV snapshots, fingerprints, bitwise/ULP/relative comparisons, transplants.

A `BoundaryState` owns its tensors (cloned out of a live cache), so later decoding never changes
it. Comparisons are bitwise first: `equal` / `n_diff` compare raw bit patterns (-0.0 is not +0.0,
NaN payloads count), so they always agree with the SHA-256 fingerprints. ULP distance is measured
in the storage dtype and counts through zero (a tiny value that changes sign is many ULPs away),
so beside it stands `max_abs_rel`, max |a - b| over max |a|, which does not explode there. `d_rel`
is ||a - b||_F / ||a||_F in fp64. Transplant surgery builds a new state from a recipient (prefix and
boundary logits kept) and a selection of a donor's cache.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class BoundaryState:
    """KV cache over all of the boundary prefix plus the boundary logits."""

    prefix: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]    # per layer [1, H_kv, |P|, D]
    values: tuple[torch.Tensor, ...]  # per layer [1, H_kv, |P|, D]
    logits: torch.Tensor              # [V], the model's output dtype

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]

    def to_cache(self, module: torch.nn.Module):
        """A fresh dynamic cache over this state. No copy is made here: a cache's `update` copies
        what it is given into its own storage and never writes into its arguments."""
        from harness.protocol.decode import new_cache

        cache = new_cache(module)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k, v, layer)
        return cache


_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of t, as integers of the same width (contiguous)."""
    t = t.contiguous()
    return t.view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Identical shape, dtype and bits (-0.0 is not +0.0; NaN payloads count)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def rows_identical(cache, logits: torch.Tensor) -> bool:
    """Whether every batch row of a dynamic cache and of logits [rows, V] has row 0's bits."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)] + [logits]
    return all(bool((bits(t) == bits(t[:1])).all()) for t in tensors)


def snapshot(cache, prefix, logits: torch.Tensor, row: int = 0, pad: int = 0) -> BoundaryState:
    """Clone row `row` of a dynamic cache and its boundary logits [rows, V] into a state; a
    left-padded row drops its first `pad` positions, so the state covers exactly the prefix."""
    keys = tuple(layer.keys[row:row + 1, :, pad:].clone() for layer in cache.layers)  # [1, H, |P|, D]
    values = tuple(layer.values[row:row + 1, :, pad:].clone() for layer in cache.layers)
    state = BoundaryState(tuple(prefix), keys, values, logits[row].clone())
    if state.length != len(state.prefix):
        raise AssertionError(f"cache covers {state.length} positions, prefix has "
                             f"{len(state.prefix)}")
    return state


# --------------------------------------------------------------------------- fingerprints

def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def sha_ids(ids) -> str:
    return hashlib.sha256(np.asarray(list(ids), dtype="<i8").tobytes()).hexdigest()


def sha_tensor(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(_bytes(t))
    return h.hexdigest()


def sha_cache(state: BoundaryState) -> str:
    """SHA-256 over every layer's keys then values (dtype and shape included)."""
    h = hashlib.sha256()
    for k, v in zip(state.keys, state.values):
        for t in (k, v):
            h.update(f"{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(_bytes(t))
    return h.hexdigest()


# --------------------------------------------------------------------------- comparisons

def ulp_ordered(t: torch.Tensor) -> torch.Tensor:
    """Map floats to integers whose difference counts ULPs (sign-magnitude -> linear; -0.0 and
    +0.0 both map to 0, so the distance counts through zero)."""
    i = bits(t).to(torch.int64)
    magnitude = i & ((1 << (torch.finfo(t.dtype).bits - 1)) - 1)
    return torch.where(i < 0, -magnitude, magnitude)


def tensor_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Bitwise comparison of two same-shape tensors [1, H, T, D] (T = positions): `equal` and
    `n_diff` over raw bits; max |diff|, max ULP (through zero), `max_abs_rel` = max |diff| / max
    |a|, `d_rel`, and the first position with a differing bit."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    differs = bits(a) != bits(b)
    n_diff = int(differs.sum())
    out = {"equal": n_diff == 0, "n_diff": n_diff, "max_abs": 0.0, "max_ulp": 0, "max_abs_rel": 0.0,
           "d_rel": 0.0, "first_position": None}
    if n_diff:
        a64, b64 = a.double(), b.double()
        norm = float(torch.linalg.vector_norm(a64))
        out["max_abs"] = float((a64 - b64).abs().max())
        out["max_ulp"] = int((ulp_ordered(a) - ulp_ordered(b)).abs().max())
        scale = float(a64.abs().max())
        out["max_abs_rel"] = out["max_abs"] / scale if scale else (0.0 if out["max_abs"] == 0 else float("inf"))
        out["d_rel"] = float(torch.linalg.vector_norm(a64 - b64)) / norm if norm else float("inf")
        positions = differs.flatten(0, 1).any(dim=0).any(dim=-1)   # [T]
        out["first_position"] = int(positions.nonzero()[0, 0])
    return out


def compare_states(a: BoundaryState, b: BoundaryState) -> dict:
    """Per layer and K/V, plus over the concatenated inventory; `a` is the reference for d_rel."""
    if a.prefix != b.prefix:
        raise ValueError("states cover different prefixes; compare only states over the same P")
    layers = []
    for index, (ka, va, kb, vb) in enumerate(zip(a.keys, a.values, b.keys, b.values)):
        layers.append({"layer": index, "k": tensor_diff(ka, kb), "v": tensor_diff(va, vb)})
    bad = [(entry["layer"], kv) for entry in layers for kv in ("k", "v") if not entry[kv]["equal"]]
    d_rel = 0.0
    if bad:   # over the concatenated inventory; only worth the fp64 copy when something differs
        flat_a = torch.cat([t.flatten().double() for pair in zip(a.keys, a.values) for t in pair])
        flat_b = torch.cat([t.flatten().double() for pair in zip(b.keys, b.values) for t in pair])
        norm = float(torch.linalg.vector_norm(flat_a))
        d_rel = float(torch.linalg.vector_norm(flat_a - flat_b)) / norm if norm else float("inf")
    return {
        "bit_exact": not bad,
        "first_bad_layer": bad[0][0] if bad else None,
        "first_bad_kv": bad[0][1] if bad else None,
        "bad_layers": sorted({layer for layer, _ in bad}),
        "n_diff": sum(e[kv]["n_diff"] for e in layers for kv in ("k", "v")),
        "max_abs": max(e[kv]["max_abs"] for e in layers for kv in ("k", "v")),
        "max_ulp": max(e[kv]["max_ulp"] for e in layers for kv in ("k", "v")),
        "max_abs_rel": max(e[kv]["max_abs_rel"] for e in layers for kv in ("k", "v")),
        "d_rel": d_rel,
        "d_rel_aggregation": "Frobenius norm over all layers' K and V concatenated",
        "first_position": min((e[kv]["first_position"] for e in layers for kv in ("k", "v")
                               if e[kv]["first_position"] is not None), default=None),
        "layers": layers,
    }


def compare_logits(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Boundary logits [V]: bitwise equality, max abs difference, argmax agreement, margins."""
    from harness.protocol.decode import top2

    ta, ma = top2(a)
    tb, mb = top2(b)
    return {"equal": bits_equal(a, b),
            "max_abs": float((a.double() - b.double()).abs().max()),
            "argmax_a": ta, "argmax_b": tb, "argmax_agree": ta == tb,
            "margin_a": ma, "margin_b": mb}


def compare_suffixes(a, b, margins_a, margins_b) -> dict:
    """Two greedy suffixes: identical?, first divergence, common prefix, margins there."""
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    identical = list(a) == list(b)
    first = None if identical else common
    return {"identical": identical, "first_divergence": first, "common_prefix": common,
            "len_a": len(a), "len_b": len(b),
            "margin_a_at_divergence": (margins_a[first] if first is not None
                                       and first < len(margins_a) else None),
            "margin_b_at_divergence": (margins_b[first] if first is not None
                                       and first < len(margins_b) else None)}


# --------------------------------------------------------------------------- transplants

@dataclass(frozen=True)
class Selection:
    """Which part of a donor's cache a transplant takes: layers [lo, hi), K and/or V, positions."""

    layers: tuple[int, int] | None = None
    keys: bool = True
    values: bool = True
    positions: str | tuple[int, int] | None = None   # "prompt" | "generated" | (lo, hi)

    @property
    def label(self) -> str:
        parts = []
        if self.layers:
            parts.append(f"layers={self.layers[0]}-{self.layers[1]}")
        if not (self.keys and self.values):
            parts.append("keys" if self.keys else "values")
        if self.positions is not None:
            p = self.positions
            parts.append(f"positions={p if isinstance(p, str) else f'{p[0]}-{p[1]}'}")
        return "+".join(parts) or "all"


SELECTION_HELP = ("all | keys | values | layers=A-B | positions=prompt|generated|A-B, "
                  "joined with '+' (ranges are half-open: A included, B not)")


def parse_selection(text: str) -> Selection:
    """`all`, `keys`, `values`, `layers=0-4`, `positions=generated`, joined by '+'."""
    kwargs: dict = {}
    for part in filter(None, (text or "all").split("+")):
        if part == "all":
            continue
        if part in ("keys", "values"):
            kwargs["keys"], kwargs["values"] = part == "keys", part == "values"
            continue
        match = re.fullmatch(r"(layers|positions)=(\d+)-(\d+)", part)
        if match and int(match[2]) < int(match[3]):
            kwargs[match[1]] = (int(match[2]), int(match[3]))
        elif part in ("positions=prompt", "positions=generated"):
            kwargs["positions"] = part.split("=")[1]
        else:
            raise ValueError(f"bad transplant selection {part!r}; valid: {SELECTION_HELP}")
    return Selection(**kwargs)


def transplant(recipient: BoundaryState, donor: BoundaryState, selection: Selection,
               prompt_length: int) -> BoundaryState:
    """The recipient with the selected part of the donor's cache put in place of its own."""
    if recipient.prefix != donor.prefix:
        raise ValueError("transplant needs recipient and donor over the same prefix")
    n_layers, length = len(recipient.keys), recipient.length
    lo, hi = selection.layers or (0, n_layers)
    if not 0 <= lo < hi <= n_layers:
        raise ValueError(f"layer range {lo}-{hi} outside 0-{n_layers}")
    named = {None: (0, length), "prompt": (0, prompt_length), "generated": (prompt_length, length)}
    p_lo, p_hi = named.get(selection.positions, selection.positions)
    if not 0 <= p_lo <= p_hi <= length:
        raise ValueError(f"position range {p_lo}-{p_hi} outside 0-{length}")

    def mix(own: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        out = own.clone()
        out[:, :, p_lo:p_hi] = other[:, :, p_lo:p_hi]   # [1, H_kv, T, D] along T
        return out

    keys, values = list(recipient.keys), list(recipient.values)
    for layer in range(lo, hi):
        if selection.keys:
            keys[layer] = mix(recipient.keys[layer], donor.keys[layer])
        if selection.values:
            values[layer] = mix(recipient.values[layer], donor.values[layer])
    return BoundaryState(recipient.prefix, tuple(keys), tuple(values), recipient.logits)
