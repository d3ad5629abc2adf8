"""The rows of a unit's record: what the ledger's rows table holds and what audit compares.

A record (kvfid.records.record: `run_item`'s or `run_crossing`'s, a ReplayRecord or a
ProgramRecord) is stored whole; its rows (one per arm, comparison, replica, transplant, crossing
cell, replayed construction) are a projection of it: metrics for queries and fingerprints for `audit`. `record_rows` is that projection, `fingerprints` its
fingerprint part. Row labels keep the text ledgers of schema 1-2 stored, so their runs stay
auditable and comparable with new ones.
"""

from __future__ import annotations

import dataclasses

from kvfid.states.cache import sha_ids
from kvfid.records.record import Comparison, CrossingRecord, ItemRecord
from kvfid.records.program import ProgramRecord
from kvfid.records.replay_record import ReplayRecord


def record_rows(record: ItemRecord | CrossingRecord) -> list[tuple[str, str, dict, dict]]:
    """(kind, label, metrics, fingerprints) for each arm, comparison, transplant, crossing cell."""
    if isinstance(record, CrossingRecord):
        return _crossing_rows(record)
    if isinstance(record, ReplayRecord):
        return _replay_rows(record)
    if isinstance(record, ProgramRecord):
        return _program_rows(record)
    if not record.ok:
        generated = record.arms["live"].generated or ()
        return [("short", "live", {"generated": len(generated), "note": record.note},
                 {"generated_sha": sha_ids(generated)})]
    rows = [("prefix", "P", {"length": len(record.prefix), "prompt_length": record.prompt_length},
             {"prefix_sha": record.prefix_sha})]
    for label, arm in record.arms.items():
        metrics = {"correct": arm.correct, "suffix_length": len(arm.suffix),
                   "suffix_eos": arm.suffix_eos, "wall_s": arm.wall_s,
                   "forward_calls": arm.forward_calls}
        if arm.rows_identical is not None:
            metrics["rows_identical"] = arm.rows_identical
        rows.append(("boundary", label, metrics, {"cache_sha": arm.cache_sha,
                                                  "logits_sha": arm.logits_sha,
                                                  "suffix_sha": arm.suffix_sha}))
    stack_tp = (record.stack or {}).get("tp", 1) if isinstance(record.stack, dict) else 1
    for c in record.comparisons:
        metrics = _comparison_metrics(c)
        sizes = (_tp_size(c.a, stack_tp), _tp_size(c.b, stack_tp))
        if sizes != (1, 1):   # a row of a TP stack says each side's TP size
            metrics["tp_a"], metrics["tp_b"] = sizes
        rows.append((c.kind, f"{c.a}~{c.b}", metrics, {}))
    for r in record.replicas:   # the replica's own state, and its verdict vs the first run
        prints = {k: v for k, v in dataclasses.asdict(r.fingerprints).items() if v is not None}
        rows.append(("replica", f"{r.construction}~{r.construction}'",
                     _comparison_metrics(r.comparison),
                     {"verdict": _verdict(r.comparison), **prints}))
    for t in record.transplants:
        rows.append(("transplant", t.label,
                     {"outcome": t.outcome, "recipient_equals_donor": t.recipient_equals_donor},
                     {"suffix_sha": t.suffix_sha, "outcome": t.outcome}))
    return rows


def _tp_size(arm: str, stack_tp: int) -> int:
    """The TP size an arm was built at: its label's `@tpN`, else its stack's."""
    _, at, size = arm.rpartition("@tp")
    return int(size) if at and size.isdigit() else stack_tp


def cell_label(stack: str, construction: str) -> str:
    """The rows-table label of a crossing cell."""
    return f"{stack}|{construction}"


def _crossing_rows(record: CrossingRecord) -> list[tuple[str, str, dict, dict]]:
    if record.status == "short":
        return [("short", "reference", {}, {})]
    rows = [("prefix", "P", {}, {"prefix_sha": record.prefix_sha}),
            ("reference", "live", {}, {"suffix_sha": sha_ids(record.reference_suffix)})]
    for cell in record.cells:
        prints = {k: v for k, v in dataclasses.asdict(cell.fingerprints).items()
                  if v is not None}
        rows.append(("crossing-cell", cell_label(cell.stack, cell.construction),
                     {"same_as_reference_live": cell.same_as_reference_live}, prints))
    for w in record.within:
        c = w.comparison
        rows.append(("crossing", f"{w.stack}|{c.a}~{c.b}", _comparison_metrics(c), {}))
    return rows


def _replay_rows(record: ReplayRecord) -> list[tuple[str, str, dict, dict]]:
    """The reference's picked logprobs, then per construction its mismatch and its own bits."""
    rows = [("reference", "incremental", {"tokens": record.tokens,
                                          "prompt_length": record.prompt_length},
             {"logprobs_sha": record.reference_sha})]
    for label, m in record.constructions.items():
        rows.append(("replay", label, {"tokens": m.tokens, "differ": m.differ,
                                       "max_abs": m.max_abs, "kl_mean": m.kl_mean,
                                       "first_position": m.first_position},
                     {"logprobs_sha": m.logprobs_sha}))
    return rows


def _program_rows(record: ProgramRecord) -> list[tuple[str, str, dict, dict]]:
    """Per layout (labels `LAYOUT|...`): the merge boundary, each arm's state, each rebuilt arm's
    comparison with live (and the first bad segment), the replicas and the transplants."""
    rows = []
    for run in record.runs:
        at = f"{run.layout}|"
        rows.append(("prefix", at + "P", {"length": run.boundary_length,
                                          "prompt_length": run.prompt_length,
                                          "program": run.program},
                     {"prefix_sha": run.prefix_sha}))
        for label, arm in run.arms.items():
            rows.append(("boundary", at + label, {"suffix_length": len(arm.suffix),
                                                  "wall_s": arm.wall_s,
                                                  "forward_calls": arm.forward_calls},
                         {"cache_sha": arm.cache_sha, "suffix_sha": sha_ids(arm.suffix)}))
        for c in run.comparisons:
            rows.append(("arm", f"{at}live~{c.arm}", {
                "cache_bit_exact": c.bit_exact, "first_bad_layer": c.cache.first_bad_layer,
                "first_bad_segment": c.first_bad_segment, "logits_equal": c.logits.equal,
                "suffix_identical": c.suffix.identical,
                "first_divergence": c.suffix.first_divergence}, {}))
        for r in run.replicas:
            rows.append(("replica", f"{at}{r.arm}~{r.arm}'", {"cache_bit_exact": r.bit_exact,
                                                              "suffix_identical": r.suffix_identical},
                         {}))
        for t in run.transplants:
            rows.append(("transplant", at + t.transplant, {"outcome": t.outcome,
                                                           "recipient_equals_donor": t.same_suffixes},
                         {"suffix_sha": t.suffix_sha, "outcome": t.outcome}))
    return rows


def _comparison_metrics(c: Comparison) -> dict:
    cache, logits = c.cache, c.logits
    return {"prefix_identical": c.prefix_identical,
            "cache_bit_exact": cache.bit_exact if cache else None,
            "first_bad_layer": cache.first_bad_layer if cache else None,
            "d_rel": cache.d_rel if cache else None,
            "max_ulp": cache.max_ulp if cache else None,
            "logits_equal": logits.equal if logits else None,
            "argmax_agree": logits.argmax_agree if logits else None,
            "suffix_identical": c.suffix.identical,
            "first_divergence": c.suffix.first_divergence,
            "margin_at_divergence": c.suffix.margin_a_at_divergence}


def _verdict(c: Comparison) -> str:
    cache_text = "n/a" if c.cache is None else "exact" if c.cache.bit_exact else "differs"
    logits_text = "n/a" if c.logits is None else "exact" if c.logits.equal else "differs"
    suffix_text = ("identical" if c.suffix.identical
                   else f"diverges@{c.suffix.first_divergence}")
    return f"cache {cache_text}, logits {logits_text}, suffix {suffix_text}"


def fingerprints(record) -> dict[tuple[str, str], dict]:
    """{(kind, label): fingerprints} of one unit's record (what `audit` compares)."""
    return {(kind, label): prints for kind, label, _, prints in record_rows(record)}
