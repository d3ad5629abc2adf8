"""The three gaps of a replay with an engine reference, in kvfid's figures and RL frameworks' names.

A rollout's tokens come with the logprobs the engine sampled them with; a trainer re-scores the
same tokens. The gap a trainer logs (engine vs re-scoring) is two gaps in series, reported apart:

- `engine~step-by-step`: the engine's logprobs against transformers' step-by-step generation on
  the replay's stack (what changing the stack, the engine's kernels included, does);
- `step-by-step~C`: the generator's reference against the re-scoring construction C on the same
  stack (what rebuilding the state does: `replay.mismatch`);
- `engine~C`: the engine against the re-scoring (what the trainer sees).

Each is a `PickedGap`: tokens whose fp32 logprob bits differ, then the figures RL frameworks log,
under their names: mean |delta logprob| (slime `train_rollout_logprob_abs_diff`), the K3
estimator of KL(sampler || trainer) (r - 1 - log r per token, averaged), and the importance ratio
r = exp(logp_trainer - logp_sampler) (min, mean, max; what truncated importance sampling clips).
All computed in fp64 from the fp32 logprobs (the engine's as the file gives them).
"""

from __future__ import annotations

import math
import statistics

import torch

from kvfid.states.cache import bits
from kvfid.records.replay_record import PickedGap

STEP = "step-by-step"
ENGINE = "engine"

# The figure's name in kvfid, and what RL frameworks call it (shown beside each figure).
FRAMEWORK_NAMES = {
    "mean_abs": "slime train_rollout_logprob_abs_diff",
    "k3_mean": "K3 KL(sampler || trainer)",
    "ratio": "importance ratio p_trainer/p_sampler (TIS/MIS)",
}


def gap(reference: torch.Tensor, other: torch.Tensor) -> PickedGap:
    """`other`'s picked logprobs against `reference`'s (1-D, one per token, same tokens)."""
    if reference.shape != other.shape or reference.dim() != 1 or not len(reference):
        raise ValueError(f"gap: two 1-D logprob vectors of one length; got {tuple(reference.shape)} "
                         f"and {tuple(other.shape)}")
    differs = bits(reference.float()) != bits(other.float())
    log_ratio = other.double() - reference.double()
    delta, ratio = log_ratio.abs(), log_ratio.exp()
    k3 = torch.expm1(log_ratio) - log_ratio   # >= 0; the K3 estimator of KL(reference || other)
    n = int(differs.sum())
    return PickedGap(tokens=len(delta), differ=n, fraction=n / len(delta),
                     max_abs=float(delta.max()), mean_abs=float(delta.mean()),
                     k3_mean=float(k3.mean()), ratio_min=float(ratio.min()),
                     ratio_mean=float(ratio.mean()), ratio_max=float(ratio.max()),
                     first_position=int(differs.nonzero()[0, 0]) if n else None,
                     abs_deltas=tuple(float(d) for d in delta))

DECADES = tuple(range(-9, 1))   # |delta| bins: 0 exactly, then [1e-9, 1e-8) ... [1, inf)


def delta_decades(deltas: list[float]) -> list[tuple[str, int]]:
    """|delta logprob| counted by decade: ("0", n exact), ("<1e-9", n), ("1e-9", n) for
    [1e-9, 1e-8), ..., ("1e0", n) for [1, inf). Every token falls in exactly one bin."""
    counts = {"0": 0, "<1e-9": 0, **{f"1e{d}": 0 for d in DECADES}}
    for d in deltas:
        if d == 0:
            counts["0"] += 1
        elif d < 10.0 ** DECADES[0]:
            counts["<1e-9"] += 1
        else:
            exponent = min(DECADES[-1], math.floor(math.log10(d)))
            # log10 rounds: 1e-5 * (1 - eps) may land in the 1e-5 bin; the bound decides.
            exponent -= d < 10.0 ** exponent
            counts[f"1e{max(DECADES[0], exponent)}"] += 1
    return list(counts.items())


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def engine_logprobs(logprobs) -> torch.Tensor:
    """The file's engine logprobs as fp64 (compared in fp32 bits, subtracted in fp64)."""
    return torch.tensor(list(logprobs), dtype=torch.float64)


def aggregate_gaps(rows: list[dict]) -> dict:
    """Over trajectories (plain PickedGap dicts): token-weighted means, extremes, items exact."""
    tokens = sum(r["tokens"] for r in rows)
    deltas = [d for r in rows for d in r["abs_deltas"]]
    weighted = lambda key: sum(r[key] * r["tokens"] for r in rows) / tokens if tokens else 0.0
    differ = sum(r["differ"] for r in rows)
    firsts = [r["first_position"] for r in rows if r["first_position"] is not None]
    return {"items": len(rows), "items_exact": sum(r["differ"] == 0 for r in rows),
            "tokens": tokens, "differ": differ, "fraction": differ / tokens if tokens else 0.0,
            "max_abs": max(deltas, default=0.0),
            "mean_abs": statistics.fmean(deltas) if deltas else 0.0,
            "p99_abs": _quantile(deltas, 0.99), "k3_mean": weighted("k3_mean"),
            "ratio_min": min((r["ratio_min"] for r in rows), default=1.0),
            "ratio_mean": weighted("ratio_mean"),
            "ratio_max": max((r["ratio_max"] for r in rows), default=1.0),
            "first_position_median": statistics.median(firsts) if firsts else None,
            "abs_delta_decades": delta_decades(deltas)}


def three_gaps(result: dict) -> dict[str, dict[str, dict]]:
    """Per construction C: {engine~step-by-step, step-by-step~C, engine~C} -> aggregate, from a
    `replay` result that had an engine reference (empty without one)."""
    engine = result.get("engine_aggregate")
    if not engine:
        return {}
    return {c: {f"{ENGINE}~{STEP}": engine[STEP], f"{STEP}~{c}": result["aggregate"][c],
                f"{ENGINE}~{c}": engine[c]} for c in result["aggregate"]}


def render_gaps(result: dict) -> list[str]:
    """The three gaps side by side, one line each, per construction (nothing without logprobs)."""
    table = three_gaps(result)
    if not table:
        return []
    lines = [f"three gaps (engine: the file's logprobs; mean |dlogp| is "
             f"{FRAMEWORK_NAMES['mean_abs']}; K3 is {FRAMEWORK_NAMES['k3_mean']}; ratio is the "
             f"{FRAMEWORK_NAMES['ratio']})",
             f"  {'gap':<28} {'tokens differ':>15} {'max |dlogp|':>12} {'mean |dlogp|':>13} "
             f"{'K3 KL':>10}  ratio min / mean / max"]
    rows = {}
    for gaps in table.values():
        rows.update(gaps)          # engine~step-by-step once, then two rows per construction
    for name, a in rows.items():
        k3 = a.get("k3_mean")
        ratio = ("-" if a.get("ratio_min") is None else
                 f"{a['ratio_min']:.6g} / {a['ratio_mean']:.6g} / {a['ratio_max']:.6g}")
        lines.append(f"  {name:<28} {a['differ']:>7}/{a['tokens']:<7} {a['max_abs']:>12.4g} "
                     f"{a['mean_abs']:>13.4g} {'-' if k3 is None else format(k3, '10.4g'):>10}"
                     f"  {ratio}")
    return lines
