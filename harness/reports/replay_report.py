"""The run report's Replay section: replayed trajectories per stack and construction.

Per (stack, construction): tokens whose logprob bits differ from step-by-step generation, max,
mean and p99 |delta logprob|, mean KL, items exact and the median first differing position
(kvfid.runs.aggregate `replay`), then the |delta logprob| distribution by decade: a bar figure
in the HTML, its numbers as a table everywhere. A cell with no differing token says so in words:
that sentence is the claim the issue asks the report to make, so it appears only when true.
"""

from __future__ import annotations

import shlex

from kvfid.reports.document import number
from kvfid.reports.figures import svg_bars

EXACT = "exactly zero: every logprob bit-identical to generation"


def replay_rows(replay: dict) -> tuple[list[str], list[list[str]]]:
    """One row per (stack, construction): the headline of a replay run."""
    head = ["stack", "construction", "tokens differ", "max |Δ logprob|", "mean |Δ logprob|",
            "p99 |Δ logprob|", "mean KL", "items exact", "first differing (median)"]
    rows = [[stack, c, f"{a['differ']}/{a['tokens']}", number(a["max_abs"]),
             number(a["mean_abs"]), number(a["p99_abs"]), number(a["kl_mean"]),
             f"{a['items_exact']}/{a['items']}", number(a["first_position_median"])]
            for stack, cons in replay.items() for c, a in cons.items()]
    return head, rows


def verdicts(replay: dict) -> list[str]:
    """The sentence per (stack, construction): exactly zero, or how many tokens differ."""
    return [f"{stack} {c}: " + (EXACT if a["differ"] == 0 else
                                f"{a['differ']} of {a['tokens']} tokens differ "
                                f"({100 * a['fraction']:.1f}%)")
            for stack, cons in replay.items() for c, a in cons.items()]


def engine_rows(engine: dict) -> tuple[list[str], list[list[str]]]:
    """One row per (stack, gap): the three gaps of an engine reference (replay_gaps)."""
    head = ["stack", "gap", "tokens differ", "max |Δ logprob|",
            "mean |Δ logprob| (slime train_rollout_logprob_abs_diff)", "K3 KL",
            "importance ratio min / mean / max", "items exact"]
    rows = [[stack, name, f"{a['differ']}/{a['tokens']}", number(a["max_abs"]),
             number(a["mean_abs"]), number(a.get("k3_mean")),
             " / ".join(number(a.get(k)) for k in ("ratio_min", "ratio_mean", "ratio_max")),
             f"{a['items_exact']}/{a['items']}"]
            for stack, gaps in engine.items() for name, a in gaps.items()]
    return head, rows


def replay_blocks(replay: dict, case, engine: dict | None = None) -> list[tuple]:
    """The Replay section of the run report (with the engine's three gaps when the
    trajectories carried the engine's logprobs)."""
    head, rows = replay_rows(replay)
    out = [("h2", "Replay"),
           ("p", "Supplied trajectories re-scored the way a trainer does (teacher-forced, "
                 "every continuation token), each against the generator's step-by-step "
                 "reference on the same stack. A token differs when its fp32 logprob's bits "
                 "do; KL(reference || construction) is computed in fp64."),
           ("table", head, rows)]
    out.append(("list", verdicts(replay)))
    if engine:
        out += [("h3", "The engine as a reference: three gaps"),
                ("p", "The trajectories carried the logprobs the engine sampled them with. "
                      "engine~step-by-step: the engine against generation on this stack; "
                      "step-by-step~C: generation against the re-scoring C; engine~C: what a "
                      "trainer sees. K3 estimates KL(sampler || trainer) per token; the ratio "
                      "is p_trainer / p_sampler."),
                ("table", *engine_rows(engine))]
    series = {f"{stack} {c}": a["abs_delta_decades"] for stack, cons in replay.items()
              for c, a in cons.items()}
    labels = [label for label, _ in next(iter(series.values()), [])]
    out += [("h3", "|Δ logprob| by decade"),
            ("figure", svg_bars({name: [(i, i + 1, n) for i, (_, n) in enumerate(bins)]
                                 for name, bins in series.items()},
                                "|Δ logprob| by decade (bin 1e-k holds [1e-k, 10 × 1e-k); 0: bit-identical)",
                                ylabel="tokens", labels=labels),
             "Tokens by |Δ logprob| against step-by-step generation, per stack and construction."),
            ("table", ["stack construction"] + labels,
             [[name] + [str(n) for _, n in bins] for name, bins in series.items()])]
    out += [("h3", "Reproduce"), ("pre", "\n".join(replay_command(case, s) for s in case.stacks))]
    return out


def replay_command(case, stack) -> str:
    """The `kvfid replay` command that re-scores the case's trajectories on `stack`."""
    args = ["kvfid", "replay", case.replay.trajectories, "--model", case.model,
            "--stack", stack.label, "--device", stack.device,
            "--constructions", ",".join(case.replay.constructions)]
    return shlex.join(args)
