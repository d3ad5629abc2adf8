"""The bitwise comparisons of two of an engine's constructions on the same tokens: their logprobs
(fp32 bits, as engines return them) and their engine states (each layer's K and V, compared by
kvfid.states.cache.compare_states). Engine-agnostic: every engine's check uses these."""

from __future__ import annotations

import torch

from kvfid.records.engine import EngineKV, EngineRow
from kvfid.states.cache import BoundaryState, compare_states
from kvfid.states.layers import LayerState


def compare_logprobs(construction: str, a: list[list[float | None]], b: list[list[float | None]],
                     **extra) -> EngineRow:
    """Bitwise over paired logprob lists (each pair compared over its common length; a None, a
    position an engine's cache served, is not compared)."""

    tokens = differ = exact = 0
    worst = 0.0
    for x, y in zip(a, b):
        pairs = [(u, v) for u, v in zip(x, y) if u is not None and v is not None]
        n = len(pairs)
        if n == 0:
            continue
        tx = torch.tensor([u for u, _ in pairs], dtype=torch.float32)
        ty = torch.tensor([v for _, v in pairs], dtype=torch.float32)
        d = int((tx.view(torch.int32) != ty.view(torch.int32)).sum())
        tokens, differ, exact = tokens + n, differ + d, exact + (d == 0)
        worst = max(worst, float((tx.double() - ty.double()).abs().max()))
    return EngineRow(construction, tokens, differ, worst, exact, len(a), **extra)


def trimmed(state, length: int):
    """The state over its first `length` positions (every other part, a scale, kept)."""

    return BoundaryState(state.prefix[:length], layers=[
        layer.replace(k=layer.parts["k"][:, :, :length], v=layer.parts["v"][:, :, :length])
        for layer in state.layers])


def dequantized(state):
    """A state stored as fp8 with scales (parts `k_scale`, `v_scale`) as the values it stands for,
    fp32(stored) * scale; None for a state stored in the values' own dtype."""
    if not any("k_scale" in layer.parts for layer in state.layers):
        return None
    return BoundaryState(state.prefix, layers=[
        LayerState(layer.kind, {part: layer.parts[part].float() * layer.parts[f"{part}_scale"]
                                if f"{part}_scale" in layer.parts else layer.parts[part]
                                for part in ("k", "v")}, layer.start)
        for layer in state.layers])


def compare_kv(a: list, b: list, lengths: list[int] | None = None) -> tuple:
    """A row's engine states compared in their stored format (`compare_rows`) and, where they are
    stored as fp8, dequantized too: (stored, dequantized or None)."""
    stored = compare_rows(a, b, lengths)
    values = [dequantized(x) for x in a], [dequantized(y) for y in b]
    if any(x is None for x in values[0] + values[1]):
        return stored, None
    return stored, compare_rows(*values, lengths)


def compare_rows(a: list, b: list, lengths: list[int] | None = None) -> EngineKV:
    """One KV row: pairs of engine states compared over their common positions (or `lengths`)."""

    lengths = lengths or [min(len(x.prefix), len(y.prefix)) for x, y in zip(a, b)]
    diffs = [compare_states(trimmed(x, n), trimmed(y, n)) for x, y, n in zip(a, b, lengths)]
    per_layer: dict[int, list[float]] = {}
    for diff in diffs:
        for layer in diff.layers:
            per_layer.setdefault(layer.layer, []).append(max(layer.k.d_rel, layer.v.d_rel))
    return EngineKV(
        items=len(a), items_exact=sum(d.bit_exact for d in diffs),
        first_bad_layer=min((d.first_bad_layer for d in diffs if d.first_bad_layer is not None),
                            default=None),
        first_position=min((d.first_position for d in diffs if d.first_position is not None),
                           default=None),
        n_diff=sum(d.n_diff for d in diffs), max_abs=max((d.max_abs for d in diffs), default=0.0),
        max_ulp=max((d.max_ulp for d in diffs), default=0),
        d_rel=max((d.d_rel for d in diffs), default=0.0), positions=sum(lengths[:len(diffs)]),
        d_rel_per_layer=tuple(max(per_layer[i]) for i in sorted(per_layer)),
        d_rel_aggregation="per item over every layer's K and V concatenated, then the worst "
                          "item; per layer: the worst of K and V, worst item")
