"""Rounding or functional: the kind of a difference between two states over one prefix.

Two constructions that compute the same function differ only by rounding: a few ULP, a relative
drift `d_rel` near the dtype's machine epsilon, and in fp32 agreement to fp32 rounding. Two that
compute different functions (a model whose prefill and decode paths disagree, a decode step run
at the wrong position) differ far above that, in fp32 too. In fp32 (and fp64) the scale decides.
Below fp32 a functional difference can hide under the dtype's own rounding (a bf16 epsilon is
2^-7), so there the kind is `unsettled` until the same comparison in fp32 settles it (`settle`):
rounding when fp32 agrees to fp32 rounding, functional when fp32 differs far above it.

The measure is the larger of the state's `d_rel` (over every compared part, concatenated) and
the boundary logits' (kvfid.states.cache.compare_states, compare_logits).
"""

from __future__ import annotations

import torch

from kvfid.records.record import Difference

ROUNDING = "rounding"
FUNCTIONAL = "functional"
UNSETTLED = "unsettled"
DIFFERENCE_KINDS = (ROUNDING, FUNCTIONAL, UNSETTLED)

# A rounding difference in fp32 stays within this many epsilons of d_rel (2^-13 = 1.2e-4); the
# measurements behind the bound, rounding and functional, are in docs/hazards.md.
ROUNDING_EPSILONS = 1024


def epsilon(dtype: torch.dtype) -> float:
    """The dtype's machine epsilon (the gap above 1.0)."""
    return float(torch.finfo(dtype).eps)


def kind_of(d_rel: float, dtype: torch.dtype) -> str:
    """The kind of a difference of relative drift `d_rel` (> 0) between states of `dtype`."""
    if torch.finfo(dtype).bits < 32:
        return UNSETTLED
    return ROUNDING if d_rel <= ROUNDING_EPSILONS * epsilon(dtype) else FUNCTIONAL


def settle(kind: str, in_fp32: str | None) -> str:
    """An unsettled kind given what the same comparison is in fp32 (`None`: bit-exact there)."""
    if kind != UNSETTLED:
        return kind
    if in_fp32 is None or in_fp32 == ROUNDING:
        return ROUNDING
    return FUNCTIONAL if in_fp32 == FUNCTIONAL else UNSETTLED


def describe(kind: str) -> str:
    """What a kind means, in a report's words (never a functional difference as numerics)."""
    return {ROUNDING: "rounding: the same function, rounded differently",
            FUNCTIONAL: "functional: the two paths compute different functions (the model's "
                        "code or kvfid's), not numerics",
            UNSETTLED: "unsettled: below fp32, at a scale rounding could reach; the same "
                       "comparison in fp32 settles it"}[kind]


def difference(cache, logits, dtype: torch.dtype):
    """The `Difference` of a compared pair (kvfid.records.record.CacheDiff and LogitsDiff, the
    latter None where absent) whose states are `dtype`; None where nothing measured differs."""
    d_rel = max(cache.d_rel if cache is not None else 0.0,
                logits.d_rel if logits is not None else 0.0)
    if d_rel == 0.0:
        return None
    name = str(dtype).removeprefix("torch.")
    return Difference(kind_of(d_rel, dtype), d_rel, epsilon(dtype), name)


def state_dtype(state) -> torch.dtype:
    """The coarsest floating dtype a boundary state holds (its logits included): the precision
    it was computed in, where a layer keeps some parts wider (a recurrent state in fp32)."""
    floats = [part.dtype for layer in state.layers for part in layer.parts.values()
              if part.is_floating_point()]
    if state.logits is not None and state.logits.is_floating_point():
        floats.append(state.logits.dtype)
    return max(floats, key=epsilon)
