"""The model step benchmarks of one bench run (extra_info op "model"): each stack's step median
against the baseline stack of the same run (wall and this thread's CPU time), and the scale curve,
a stack's step median by prefix length (a table, and a log-log plot in the HTML page).

`model_steps()` reads them from kvfid.reports.benchreport's comparison rows (kvfid.tasks.bench
sizes the CPU default case from them); `model_steps_document()` is the report's "Model steps"
section, which benchreport's `bench_document()` appends.
"""

from __future__ import annotations

from kvfid.reports.document import Figure, Heading, Paragraph, Table, seconds
from kvfid.reports.figures import svg_curves
from kvfid.kernels.invariant.route import Route


def model_steps(rows: list[dict]) -> list[dict]:
    """The model step benchmarks (extra_info op "model") of one run: per group (phase, model,
    context), each stack's median and its ratio to the group's baseline stack of the same run."""
    steps = [r for r in rows if r["extra_info"].get("op") == "model"]
    out = []
    for row in steps:
        extra = row["extra_info"]
        base = next((r for r in steps if r["group"] == row["group"]
                     and r["extra_info"].get("stack") == extra.get("baseline")), None)
        cpu = lambda r: r["extra_info"].get("cpu_s_per_call")  # noqa: E731
        out.append({"group": row["group"], "phase": extra.get("phase"), "stack": extra.get("stack"),
                    "context": extra.get("context"), "median_s": row["median_s"],
                    "cpu_ratio": cpu(row) / cpu(base) if base and cpu(row) and cpu(base) else None,
                    "baseline": extra.get("baseline"),
                    "ratio": row["median_s"] / base["median_s"] if base else None,
                    "interpreter": bool(extra.get("interpreter")),
                    "tiled_routes": extra.get("tiled_routes") or {},
                    "cache_from": extra.get("cache_from")})
    return out


def _note(step: dict) -> str:
    """What ran: the interpreter, or the tiled mode's route per dtype (kvfid.kernels.invariant.route);
    for a decode step, the stack whose prefill built the cache it read where that was neither the
    baseline nor the step's own stack (the baseline's prefill skipped as over the bench's budget)."""
    notes = ["Triton interpreter"] if step["interpreter"] else [
        f"tiled {name}: {Route(**r).text()}" for name, r in sorted(step["tiled_routes"].items())]
    if step.get("cache_from") not in (None, step["baseline"], step["stack"]):
        notes.append(f"cache from {step['cache_from']}'s prefill")
    return "; ".join(notes)


def scale_curve(steps: list[dict]) -> dict[tuple[str, str], list[tuple[int, float, float | None]]]:
    """(stack, phase) -> [(context, median s, ratio to the baseline)] by context, where the run
    measured more than one context (a stack run at one length only, e.g. the interpreter, is a
    point)."""
    curves: dict = {}
    for s in steps:
        if s["context"] is not None:
            curves.setdefault((s["stack"], s["phase"]), []).append((s["context"], s["median_s"], s["ratio"]))
    lengths = {c for v in curves.values() for c, _, _ in v}
    return {k: sorted(v) for k, v in curves.items()} if len(lengths) > 1 else {}


def scale_document(steps: list[dict]) -> list:
    """The scale curve: each stack's step median by prefix length (a table and a log-log plot)."""
    curves = dict(sorted(scale_curve(steps).items()))   # a stack's decode and prefill share a colour
    if not curves:
        return []
    contexts = sorted({c for v in curves.values() for c, _, _ in v})
    cell = lambda v, c: next((f"{seconds(m)} ({r:.2f}x)" if r is not None else seconds(m)
                              for cc, m, r in v if cc == c), "-")
    series = [(f"{stack} {phase}", [(c, m) for c, m, _ in v]) for (stack, phase), v in curves.items()]
    return [Heading("Scale curve", level=3),
            Paragraph("Each stack's model step median by prefix length (decode: one token after a "
                      "cache of that length; prefill: that many tokens), with its ratio to the "
                      "baseline at the same length: how the cost of faithfulness grows with the context."),
            Table(["stack", "step", *[f"{c} tokens" for c in contexts]],
                  [[stack, phase, *[cell(v, c) for c in contexts]] for (stack, phase), v in curves.items()]),
            Figure(svg_curves(series, "prefix length (tokens)", "median step (s)"),
                   "model step median by prefix length, log-log")]


def model_steps_document(rows: list[dict]) -> list:
    """The "Model steps" table: empty when the run has no model step benchmarks."""
    steps = model_steps(rows)
    if not steps:
        return []
    return [Heading("Model steps", level=2),
            Paragraph("One forward step of the model per stack, on the bench's thread count; the "
                      "ratio is to the baseline stack's median in the same run (and, beside it, "
                      "of this thread's CPU time per call, which other jobs on a shared machine "
                      "stretch much less than wall time). A Triton stack "
                      "on a CPU runs its attention in the Triton interpreter: that is what a CPU "
                      "harness run costs, not the kernel's GPU speed. On a CPU of two cores or "
                      "more `kvfid bench` times the longest context's steps in a second "
                      "one-thread process beside the rest; a stack and its baseline share a "
                      "process."),
            Table(["step", "stack", "median", "x baseline", "CPU time x baseline", "note"],
                  [[s["group"], s["stack"], seconds(s["median_s"]),
                    f"{s['ratio']:.2f}x {s['baseline']}" if s["ratio"] is not None else "-",
                    f"{s['cpu_ratio']:.2f}x" if s["cpu_ratio"] is not None else "-",
                    _note(s)] for s in steps]),
            *scale_document(steps)]
