"""Boundary states: snapshots of every layer's state, fingerprints, bitwise/ULP/relative
comparisons (transplant surgery: kvfid.states.surgery).

A `BoundaryState` owns its tensors (cloned out of a live cache), so later decoding never changes
it. It is a list of layer states (kvfid.states.layers): K/V over the whole prefix, a window's
K/V over the positions it holds, an MLA layer's latent, a recurrent layer's recurrent and conv
states. Comparisons are bitwise first: `equal` / `n_diff` compare raw bit patterns (-0.0 is not
+0.0, NaN payloads count), so they always agree with the SHA-256 fingerprints. ULP distance is
measured in the storage dtype and counts through zero (a tiny value that changes sign is many
ULPs away), so beside it stands `max_abs_rel`, max |a - b| over max |a|, which does not explode
there. `d_rel` is ||a - b||_F / ||a||_F in fp64. No verdict over a partial state: a part one side
holds and the other does not (or holds over other positions) is listed as `uncompared` and the
comparison is not bit-exact. Each comparison returns its record (kvfid.records.record: TensorDiff,
CacheDiff, LogitsDiff, SuffixDiff), the type the ledger stores.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from kvfid.errors import Unavailable
from kvfid.records.record import CacheDiff, LayerDiff, LogitsDiff, SuffixDiff, TensorDiff
from kvfid.states.layers import (POSITIONAL, LayerState, cache_tensors, empty_cache, read_cache,
                                     restore_cache)


class CacheOverwritten(Unavailable):
    """A cache layer holding more positions than the tokens fed to it: the model wrote it more
    than once per token (a layer run twice in one forward), which kvfid does not compare (exit 3)."""


def check_written_once(cache, fed: int) -> None:
    """CacheOverwritten when a layer of `cache` has taken more positions than the `fed` tokens
    (padding included): refused after the call that wrote it, before the next call, whose
    attention mask (as generate builds it, over the positions fed) no longer fits the cache."""
    for index, layer in enumerate(getattr(cache, "layers", ())):
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or not keys.numel():
            continue
        seen = int(getattr(layer, "cumulative_length", keys.shape[-2]))   # a window holds fewer
        if seen > fed:
            raise CacheOverwritten(
                f"cache layer {index} ({type(layer).__name__}) took {seen} positions after {fed} "
                "tokens were fed: the model writes it more than once per token (a layer run "
                "twice in one forward); kvfid compares a layer's state per position and does "
                "not serve that")


@dataclass(frozen=True, init=False)
class BoundaryState:
    """Every layer's state at the boundary prefix, plus the boundary logits [V]. Built from
    `layers` (LayerState), or from per-layer keys and values over all of the prefix."""

    prefix: tuple[int, ...]
    layers: tuple[LayerState, ...]
    logits: torch.Tensor              # [V], the model's output dtype

    def __init__(self, prefix, keys=(), values=(), logits=None, *, layers=None) -> None:
        if layers is None:
            layers = tuple(LayerState("full", {"k": k, "v": v}) for k, v in zip(keys, values))
        object.__setattr__(self, "prefix", tuple(prefix))
        object.__setattr__(self, "layers", tuple(layers))
        object.__setattr__(self, "logits", logits)

    @property
    def keys(self) -> tuple[torch.Tensor, ...]:
        """The k part of every layer that has one (per layer [1, H_kv, held, D])."""
        return tuple(layer.parts["k"] for layer in self.layers if "k" in layer.parts)

    @property
    def values(self) -> tuple[torch.Tensor, ...]:
        return tuple(layer.parts["v"] for layer in self.layers if "v" in layer.parts)

    @property
    def length(self) -> int:
        """The boundary's length: the end of the positions the layers cover."""
        return max((layer.span[1] for layer in self.layers if layer.span), default=len(self.prefix))

    def to_cache(self, module: torch.nn.Module):
        """A fresh dynamic cache over this state (each layer gets its own copies)."""
        cache = empty_cache(module)
        restore_cache(cache, self.layers)
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
    """Whether every batch row of a dynamic cache (every tensor of every layer) and of logits
    [rows, V] has row 0's bits."""
    tensors = cache_tensors(cache) + [logits]
    return all(bool((bits(t) == bits(t[:1])).all()) for t in tensors)


def snapshot(cache, prefix, logits: torch.Tensor, row: int = 0, pad: int = 0,
             config=None) -> BoundaryState:
    """Clone row `row` of a dynamic cache and its boundary logits [rows, V] into a state; a
    left-padded row drops its first `pad` positions, so the state covers exactly the prefix
    (a full layer all of it, a window layer its last positions). `config`: the model's, which
    tells an MLA layer's latent from K/V."""
    layers = read_cache(cache, config, row, pad)
    state = BoundaryState(prefix, logits=logits[row].clone(), layers=layers)
    for index, layer in enumerate(layers):
        span = layer.span
        if span is not None and span[1] > len(state.prefix) and not pad:
            raise CacheOverwritten(
                f"cache layer {index} ({layer.kind}) holds positions up to {span[1] - 1} after "
                f"{len(state.prefix)} tokens were fed: the model writes it more than once per "
                "token (a layer run twice in one forward); kvfid compares a layer's state per "
                "position and does not serve that")
        if span is not None and (span[1] != len(state.prefix) or
                                 (layer.kind.endswith("full") or layer.kind == "latent")
                                 and span[0] != 0):
            raise AssertionError(f"layer {index} ({layer.kind}) covers positions "
                                 f"{span[0]}-{span[1]}, prefix has {len(state.prefix)}")
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
    """SHA-256 over every layer's keys then values (dtype and shape included), then its other
    parts (recurrent, conv) each tagged with its name. The parts' bytes come to the host in one
    copy (one sync on a GPU, not one per part); the digest is that of the parts hashed in turn."""
    parts = [(name, t) for layer in state.layers for name, t in layer.parts.items()]
    flat = _host_bytes([t for _, t in parts])
    h, at = hashlib.sha256(), 0
    for (name, t), size in zip(parts, (t.numel() * t.element_size() for _, t in parts)):
        tag = "" if name in POSITIONAL else f"{name}:"
        h.update(f"{tag}{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(flat[at:at + size])
        at += size
    return h.hexdigest()


def _host_bytes(tensors: list[torch.Tensor]) -> memoryview:
    """The raw bytes of `tensors`, one after another, copied to the host at once."""
    if not tensors:
        return memoryview(b"")
    raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    if not raw:
        return memoryview(b"")
    by_device: dict = {}
    for r in raw:   # parts on several devices (a model split over GPUs): one copy from each
        by_device.setdefault(r.device, []).append(r)
    if len(by_device) > 1:
        return memoryview(b"".join(_bytes(r) for r in raw))
    return memoryview(torch.cat(raw).cpu().numpy()).cast("B")


# --------------------------------------------------------------------------- comparisons

def ulp_ordered(t: torch.Tensor) -> torch.Tensor:
    """Map floats to integers whose difference counts ULPs (sign-magnitude -> linear; -0.0 and
    +0.0 both map to 0, so the distance counts through zero)."""
    i = bits(t).to(torch.int64)
    magnitude = i & ((1 << (torch.finfo(t.dtype).bits - 1)) - 1)
    return torch.where(i < 0, -magnitude, magnitude)


def tensor_diff(a: torch.Tensor, b: torch.Tensor, start: int | None = 0) -> TensorDiff:
    """Bitwise comparison of two same-shape tensors: `equal` and `n_diff` over raw bits; max
    |diff|, max ULP (through zero), `max_abs_rel` = max |diff| / max |a|, `d_rel`, and the first
    absolute position with a differing bit for a part whose dim -2 is positions (K/V [1, H, T, D],
    an indexer's keys [1, T, D]) and whose first position is `start` (`start=None`: a part
    without a position axis, first_position stays None)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    differs = bits(a) != bits(b)
    n_diff = int(differs.sum())
    if not n_diff:
        return SAME
    a64, b64 = a.double(), b.double()
    norm = float(torch.linalg.vector_norm(a64))
    max_abs = float((a64 - b64).abs().max())
    # an integer part (selected key indices) has no ULPs
    max_ulp = int((ulp_ordered(a) - ulp_ordered(b)).abs().max()) if a.is_floating_point() else 0
    scale = float(a64.abs().max())
    first = None
    if start is not None:
        positions = differs.movedim(-2, 0).flatten(1).any(dim=1)   # [T]
        first = start + int(positions.nonzero()[0, 0])
    return TensorDiff(
        equal=False, n_diff=n_diff, max_abs=max_abs, max_ulp=max_ulp,
        max_abs_rel=max_abs / scale if scale else (0.0 if max_abs == 0 else float("inf")),
        d_rel=float(torch.linalg.vector_norm(a64 - b64)) / norm if norm else float("inf"),
        first_position=first)


def _uncomparable(index: int, name: str, a: LayerState, b: LayerState) -> str | None:
    """Why part `name` of layer `index` cannot be compared bit for bit (None: it can)."""
    ta, tb = a.parts.get(name), b.parts.get(name)
    if ta is None or tb is None:
        return f"layer {index} part {name}: held by only one side"
    if name in POSITIONAL and a.span != b.span:
        return (f"layer {index} part {name}: positions {a.span[0]}-{a.span[1]} against "
                f"{b.span[0]}-{b.span[1]}")
    if ta.shape != tb.shape or ta.dtype != tb.dtype:
        return (f"layer {index} part {name}: {ta.dtype}{tuple(ta.shape)} against "
                f"{tb.dtype}{tuple(tb.shape)}")
    return None


# tensor_diff's result for two tensors with the same bits.
SAME = TensorDiff()


def _parts_equal(a: BoundaryState, b: BoundaryState) -> dict:
    """(layer, part) -> whether the two sides' bits are equal, for every comparable part, decided
    on the device and read back at once (one sync on a GPU, not one per part)."""
    keys, flags = [], []
    for index, (la, lb) in enumerate(zip(a.layers, b.layers)):
        for name in la.parts:
            if _uncomparable(index, name, la, lb) is None:
                keys.append((index, name))
                flags.append(torch.equal(bits(la.parts[name]), bits(lb.parts[name]))
                             if la.parts[name].device != lb.parts[name].device else
                             (bits(la.parts[name]) == bits(lb.parts[name])).all())
    if not flags:
        return {}
    found = [bool(f) for f in flags] if any(isinstance(f, bool) for f in flags) else \
        torch.stack(flags).tolist()
    return dict(zip(keys, found))


def compare_states(a: BoundaryState, b: BoundaryState) -> CacheDiff:
    """Per layer and part (k, v, recurrent, conv, held parts), plus over the concatenated
    inventory; `a` is the reference for d_rel. An integer part (a selection of key indices)
    counts in `n_diff` and the verdict, not in |diff|, ULP or d_rel. A part that cannot be
    compared is listed in `uncompared` and makes the comparison not bit-exact."""
    if a.prefix != b.prefix:
        raise ValueError("states cover different prefixes; compare only states over the same P")
    layers, uncompared, pairs, bad = [], [], [], []
    measured, counted = [], []   # float parts (|diff|, ULP, d_rel); integer parts (n_diff only)
    if len(a.layers) != len(b.layers):
        uncompared.append(f"{len(a.layers)} layers against {len(b.layers)}")
    equal = _parts_equal(a, b)
    for index, (la, lb) in enumerate(zip(a.layers, b.layers)):
        found: dict[str, TensorDiff] = {}
        missing = []
        for name in dict.fromkeys([*la.parts, *lb.parts]):
            reason = _uncomparable(index, name, la, lb)
            if reason:
                missing.append(reason)
                continue
            positional = name in POSITIONAL
            diff = (SAME if equal.get((index, name)) else
                    tensor_diff(la.parts[name], lb.parts[name], la.start if positional else None))
            found[name] = diff
            if la.parts[name].is_floating_point():   # an index part is counted, not measured
                pairs.append((la.parts[name], lb.parts[name]))
                measured.append(diff)
            else:
                counted.append(diff)
            if not diff.equal:
                bad.append((index, name, diff))
        if la.kind != lb.kind:
            missing.append(f"layer {index}: a {la.kind} state against a {lb.kind} one")
        uncompared += missing
        # k and v are the record's own fields (a layer without them keeps the defaults); every
        # other part goes by name
        layers.append(LayerDiff(index, found.get("k", TensorDiff()), found.get("v", TensorDiff()),
                                la.kind, la.span,
                                {n: d for n, d in found.items() if n not in ("k", "v")},
                                tuple(missing)))
    d_rel = 0.0
    if bad and pairs:   # over the concatenated inventory; worth the fp64 copy when something differs
        flat_a = torch.cat([x.flatten().double() for x, _ in pairs])
        flat_b = torch.cat([y.flatten().double() for _, y in pairs])
        norm = float(torch.linalg.vector_norm(flat_a))
        d_rel = float(torch.linalg.vector_norm(flat_a - flat_b)) / norm if norm else float("inf")
    return CacheDiff(
        bit_exact=not bad and not uncompared,
        first_bad_layer=bad[0][0] if bad else None,
        first_bad_kv=bad[0][1] if bad else None,
        bad_layers=tuple(sorted({layer for layer, _, _ in bad})),
        n_diff=sum(d.n_diff for d in measured + counted),
        max_abs=max((d.max_abs for d in measured), default=0.0),
        max_ulp=max((d.max_ulp for d in measured), default=0),
        max_abs_rel=max((d.max_abs_rel for d in measured), default=0.0),
        d_rel=d_rel,
        first_position=min((d.first_position for _, _, d in bad
                            if d.first_position is not None), default=None),
        layers=tuple(layers),
        uncompared=tuple(uncompared))


def top2(logits: torch.Tensor) -> tuple[int, float]:
    """Greedy token and its margin (top-1 minus top-2 logit, in fp32) for logits [V]; both read
    back in one copy (exact in fp64: a token id, an fp32 difference)."""
    values, indices = torch.topk(logits.float(), 2)
    token, margin = torch.stack([indices[0].double(), (values[0] - values[1]).double()]).tolist()
    return int(token), margin


def compare_logits(a: torch.Tensor, b: torch.Tensor) -> LogitsDiff:
    """Boundary logits [V]: bitwise equality, max abs difference, d_rel, argmax agreement,
    margins."""
    ta, ma = top2(a)
    tb, mb = top2(b)
    a64, b64 = a.double(), b.double()
    norm = float(torch.linalg.vector_norm(a64))
    drift = float(torch.linalg.vector_norm(a64 - b64))
    return LogitsDiff(equal=bits_equal(a, b), max_abs=float((a64 - b64).abs().max()),
                      d_rel=drift / norm if norm else (0.0 if drift == 0 else float("inf")),
                      argmax_a=ta, argmax_b=tb, argmax_agree=ta == tb, margin_a=ma, margin_b=mb)


def compare_suffixes(a, b, margins_a, margins_b) -> SuffixDiff:
    """Two greedy suffixes: identical?, first divergence, common prefix, margins there."""
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    identical = list(a) == list(b)
    first = None if identical else common
    return SuffixDiff(
        identical=identical, first_divergence=first, common_prefix=common, len_a=len(a),
        len_b=len(b),
        margin_a_at_divergence=(margins_a[first] if first is not None and first < len(margins_a)
                                else None),
        margin_b_at_divergence=(margins_b[first] if first is not None and first < len(margins_b)
                                else None))
