"""The seed paper's endpoints in a run report, and the run side by side with the paper.

"The paper's endpoints" sets every endpoint the seed paper reports beside each other for every
stack of a run (kvfid.runs.endpoints computes them), so a faithful stack's column reads against
stock's. "Side by side with the paper" sets them beside the paper's own figures, for a run of the
paper's design (a crossing, replicas of live and prefill, transplants both ways), with the setup
differences named. The paper's figures are data in one place, `PAPER`, with where they come from.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfid.reports.document import interval_text, number, percent
from kvfid.runs.endpoints import LIVE, REBUILT
from kvfid.runs.summary import (D_REL_PER_LAYER, FixedPrefix, ReplicaFloor, RunSummary,
                                StackEndpoints)

SOURCE = ("kvfid issue 56, which quotes them from the seed paper; an endpoint it quotes no "
          "figure for reads \"not quoted\"")
NOT_QUOTED = "not quoted"


@dataclass(frozen=True)
class PaperFigure:
    """One endpoint (a key of ENDPOINTS) as the paper reports it."""

    endpoint: str
    figure: str


# The seed paper's figures, as issue 56 quotes them; endpoint names are ENDPOINTS' keys.
PAPER = (
    PaperFigure("disagreement", NOT_QUOTED),
    PaperFigure("replica-live", NOT_QUOTED),
    PaperFigure("replica-prefill", NOT_QUOTED),
    PaperFigure("flips", "20 labels flip"),
    PaperFigure("accuracy", "+1 point [-3.5, +5.5] (the issue does not say which arm is "
                            "subtracted)"),
    PaperFigure("first-divergence", "median 88, range 4-453"),
    PaperFigure("histogram", NOT_QUOTED),
    PaperFigure("crossing", "bf16: recurs; fp32: 0/200 with its 95% upper bound (1.88% for "
                            "0/200)"),
    PaperFigure("bridge", NOT_QUOTED),
    PaperFigure("donor", "24/24 and 43/43 (the two directions; the issue does not say which "
                         "is which)"),
    PaperFigure("controls", "0/8 and 0/5, upper bounds 32.4% and 43.4%"),
    PaperFigure("d_rel", NOT_QUOTED),
)
# The paper's setup as far as issue 56 names it.
PAPER_SETUP = {
    "model": "SmolLM2-135M, real weights (as the issue gives the paper's design)",
    "items": "200 arith items (as the issue gives the paper's design)",
    "suffix horizon": "at least 454 tokens (its first divergences reach index 453)",
    "hardware": NOT_QUOTED,
}


# --------------------------------------------------------------------------- cells

def _replica(r: ReplicaFloor | None) -> str:
    if r is None:
        return "-"
    return f"{r.k}/{r.n} suffixes differ; caches {r.cache_bit_exact}/{r.n} bit-exact"


def _flips(e: StackEndpoints) -> str:
    p = e.correctness
    if p is None:
        return "-"
    return (f"{p.a_right_b_wrong + p.a_wrong_b_right} of {p.n} ({p.a_right_b_wrong} live right, "
            f"prefill wrong; {p.a_wrong_b_right} the reverse)")


def _points(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}"


def _accuracy(e: StackEndpoints) -> str:
    p = e.correctness
    if p is None:
        return "-"
    return (f"{_points(p.difference)} points [{_points(p.ci_low)}, {_points(p.ci_high)}] "
            f"(live {percent(p.accuracy_a)}, prefill {percent(p.accuracy_b)}; "
            f"McNemar p {number(p.mcnemar_p)})")


def _first_divergence(e: StackEndpoints) -> str:
    d = e.first_divergence
    if d is None:
        return "-"
    if not d.n:
        return f"none diverges within S={d.horizon}"
    return (f"median {number(d.median)} [{number(d.q1)}, {number(d.q3)}], range {d.low}-{d.high} "
            f"({d.n} diverging; S={d.horizon})")


def _histogram(e: StackEndpoints) -> str:
    d = e.first_divergence
    if d is None or not d.n:
        return "-"
    return ", ".join(f"{lo if hi - lo == 1 else f'{lo}-{hi - 1}'}: {n}"
                     for lo, hi, n in d.histogram)


def _fixed(x: FixedPrefix | None) -> str:
    if x is None:
        return "-"
    n = x.suffix_differs.n
    return (f"{interval_text(x.suffix_differs)} differ; caches {x.cache_bit_exact}/{n} "
            f"bit-exact (P from {x.prefix} live)")


def _crossing(e: StackEndpoints) -> str:
    """The crossing unit's cell where it has this stack, else over the stack's own P."""
    return _fixed(e.crossing or e.own_prefix)


def _bridge(e: StackEndpoints) -> str:
    b = e.bridge
    if b is None:
        return "-"
    return (f"caches {b.cache_bit_exact.k}/{b.cache_bit_exact.n} bit-exact; suffix ≠ live "
            f"{interval_text(b.suffix_differs)}")


def _donor(e: StackEndpoints) -> str:
    return "; ".join(f"{t.transplant}: " + (
        interval_text(t.follows_donor) if t.follows_donor.n else "no divergent row decodes one")
        + (f" ({t.boundary} whose boundary argmax differs, apart)" if t.boundary else "")
        for t in e.transplants) or "-"


def _controls(e: StackEndpoints) -> str:
    return "; ".join(f"{t.transplant}: " + (
        f"{interval_text(t.controls_changed)} changed" if t.controls_changed.n else
        "no control row") for t in e.transplants) or "-"


def _d_rel(e: StackEndpoints) -> str:
    parts = []
    for part, series in e.d_rel_per_layer.items():
        values = [(v, i) for i, v in enumerate(series) if v is not None]
        if not values:
            continue
        top, at = max(values)
        zero = sum(1 for v, _ in values if v == 0)
        parts.append(f"{part.upper()} max {number(top)} (layer {at}), 0 in {zero}/{len(values)} "
                     "layers" if top else f"{part.upper()} 0 in every layer")
    return "; ".join(parts) or "-"


# key, what the row says, the cell of one stack
ENDPOINTS = (
    ("disagreement", "live ≠ prefill suffix [95% Wilson]",
     lambda e: interval_text(e.disagreement)),
    ("replica-live", "replica floor: live twice", lambda e: _replica(e.replicas.get(LIVE))),
    ("replica-prefill", "replica floor: prefill twice",
     lambda e: _replica(e.replicas.get(REBUILT))),
    ("flips", "correctness labels that flip, live → prefill", _flips),
    ("accuracy", "paired accuracy difference, prefill − live [95% Newcombe]", _accuracy),
    ("first-divergence", "first divergence: median [quartiles], range", _first_divergence),
    ("histogram", "first divergence: histogram (index: suffixes)", _histogram),
    ("crossing", "fixed-prefix 2x2: incremental ≠ prefill over one P [95% Wilson]", _crossing),
    ("bridge", "bridge: incremental against live", _bridge),
    ("donor", "transplants: divergent rows that follow the cache donor [95% Wilson]", _donor),
    ("controls", "transplants: exact-control rows the transplant changed [95% Wilson]",
     _controls),
    ("d_rel", "d_rel per layer, live ~ prefill (median over items)", _d_rel),
)


# --------------------------------------------------------------------------- the sections

def endpoint_blocks(summary: RunSummary) -> list[tuple]:
    """"The paper's endpoints": one row per endpoint, one column per stack; the d_rel per layer
    behind its row; what the batch-invariant stacks change."""
    ends = summary.endpoints or {}
    if not ends:
        return []
    stacks = list(ends)
    out = [("h2", "The paper's endpoints"),
           ("p", "Every endpoint the seed paper reports, per stack, live against prefill unless "
                 "the row says otherwise. The fixed-prefix row reads the crossing unit where it "
                 "covers the stack (P frozen from its reference's live run), else incremental "
                 "against prefill over the stack's own live P. Transplant rows that reach a "
                 "suffix count; a row whose boundary argmax already differs is counted apart. "
                 f"d_rel: {D_REL_PER_LAYER}."),
           ("table", ["endpoint"] + stacks,
            [[text] + [cell(ends[s]) for s in stacks] for _, text, cell in ENDPOINTS])]
    layers = max((len(ys) for e in ends.values() for ys in e.d_rel_per_layer.values()), default=0)
    if layers:
        series = [(f"{s} {part.upper()}", ys) for s, e in ends.items()
                  for part, ys in e.d_rel_per_layer.items()]
        numbers = ("table", ["layer"] + [name for name, _ in series],
                   [[str(i)] + [number(ys[i]) if i < len(ys) and ys[i] is not None else "-"
                                for _, ys in series] for i in range(layers)])
        out += [("p", "The d_rel row's numbers, layer by layer:"),
                ("details", "d_rel per layer, live ~ prefill, median over items", numbers)]
    out += [("p", sentence) for sentence in _faithful(ends)]
    return out


def _faithful(ends: dict[str, StackEndpoints]) -> list[str]:
    """What each batch-invariant stack's column shows, in counts."""
    out = []
    for stack, e in ends.items():
        if not e.batch_invariant or e.disagreement is None:
            continue
        own = e.crossing or e.own_prefix
        bridge = e.bridge.cache_bit_exact if e.bridge else None
        out.append(
            f"{stack} (batch invariant): live ≠ prefill on {e.disagreement.k} of "
            f"{e.disagreement.n} items"
            + (f"; bridge caches bit-exact on {bridge.k} of {bridge.n}" if bridge else "")
            + (f"; incremental ≠ prefill over one P on {own.suffix_differs.k} of "
               f"{own.suffix_differs.n}, caches bit-exact on {own.cache_bit_exact}" if own else "")
            + ".")
    return out


def is_paper_design(summary: RunSummary) -> bool:
    """A run of the paper's design: a crossing, replicas of live and prefill, transplants both
    ways between them."""
    if not summary.crossing or not summary.endpoints:
        return False
    return any({LIVE, REBUILT} <= set(e.replicas)
               and {f"{LIVE}<-{REBUILT}", f"{REBUILT}<-{LIVE}"}
               <= {t.transplant.partition(":")[0] for t in e.transplants}
               for e in summary.endpoints.values())


def side_by_side_blocks(summary: RunSummary, case, run) -> list[tuple]:
    """"Side by side with the paper": per endpoint the paper's figure beside this run's stock
    stacks and its batch-invariant ones, then the setup differences, for a paper-design run."""
    if not is_paper_design(summary):
        return []
    ends = summary.endpoints
    stock = [s for s, e in ends.items() if not e.batch_invariant]
    faithful = [s for s, e in ends.items() if e.batch_invariant]
    paper = {f.endpoint: f.figure for f in PAPER}
    joined = lambda stacks, cell: "; ".join(f"{s}: {cell(ends[s])}" for s in stacks) or "-"
    x = summary.crossing     # the whole 2x2, its fp32 cell too where no stack of the run has it
    crossing = "; ".join(f"{stack}: "
                         + _fixed(FixedPrefix(x.reference, w.suffix_disagree, w.cache_bit_exact))
                         for stack, w in x.within.items())
    rows = [[text, paper[key], crossing if key == "crossing" else joined(stock, cell),
             joined(faithful, cell)] for key, text, cell in ENDPOINTS]
    environment = run.environment or {}
    cpu = (environment.get("cpu") or {}).get("model") or "n/a"
    gpus = ", ".join(g.get("name") or "?" for g in environment.get("gpus") or [])
    ours = {
        "model": f"{case.model}; stacks {', '.join(ends)}",
        "items": f"{case.items.set}, n={run.item_count}, seed={case.items.seed}",
        "suffix horizon": f"S={case.S} tokens after B={case.B} live tokens: a divergence after "
                          f"suffix token {case.S} is not seen, so the first-divergence figures "
                          "are cut at S and the disagreement counts only divergences within it",
        "hardware": f"{run.environment_key}; CPU {cpu}" + (f"; GPU {gpus}" if gpus else ""),
    }
    return [("h2", "Side by side with the paper"),
            ("p", f"The paper's figures as {SOURCE}. This run's columns are this run's "
                  "measurements on its own setup (below)."),
            ("table", ["endpoint", "the paper", "this run: stock", "this run: batch invariant"],
             rows),
            ("table", ["setup", "the paper", "this run"],
             [[name, PAPER_SETUP[name], ours[name]] for name in PAPER_SETUP]),
            ("p", "Where the setups differ, a difference between the columns says nothing about "
                  "the paper's setup, and agreement is not a replication of it: each figure of "
                  "this run holds for this run's model, items, horizon and machine.")]
