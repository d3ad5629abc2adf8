"""The rows of a unit's record: what the ledger's rows table holds and what audit compares.

A record (`run_item`'s or `run_crossing`'s) is stored whole; its rows (one per arm, comparison,
transplant and crossing cell) are a projection of it: metrics for queries and fingerprints for
`audit`. `record_rows` is that projection, `fingerprints` its fingerprint part.
"""

from __future__ import annotations

from harness.protocol.cache import sha_ids


def record_rows(record: dict) -> list[tuple[str, str, dict, dict]]:
    """(kind, label, metrics, fingerprints) for each arm, comparison, transplant, crossing cell."""
    if "cells" in record:
        return _crossing_rows(record)
    if record["status"] == "short":
        generated = record["arms"]["live"]["generated"]
        return [("short", "live", {"generated": len(generated), "note": record.get("note")},
                 {"generated_sha": sha_ids(generated)})]
    rows = [("prefix", "P", {"length": len(record["prefix"]),
                             "prompt_length": record["prompt_length"]},
             {"prefix_sha": record["prefix_sha"]})]
    for label, arm in record["arms"].items():
        metrics = {"correct": arm["correct"], "suffix_length": len(arm["suffix"]),
                   "suffix_eos": arm["suffix_eos"], "wall_s": arm["wall_s"],
                   "forward_calls": arm["forward_calls"]}
        if "rows_identical" in arm:
            metrics["rows_identical"] = arm["rows_identical"]
        rows.append(("boundary", label, metrics, {k: arm[k] for k in
                                                  ("cache_sha", "logits_sha", "suffix_sha")}))
    for c in record["comparisons"]:
        prints = {}
        if c["kind"] == "replica":   # the replica's own state, and its verdict vs the first run
            prints = {"verdict": _verdict(c), **c.get("replica_fingerprints", {})}
        rows.append((c["kind"], f"{c['a']}~{c['b']}", _comparison_metrics(c), prints))
    for t in record["transplants"]:
        rows.append(("transplant", t["label"],
                     {"outcome": t["outcome"],
                      "recipient_equals_donor": t["recipient_equals_donor"]},
                     {"suffix_sha": t.get("suffix_sha"), "outcome": t["outcome"]}))
    return rows


def _crossing_rows(record: dict) -> list[tuple[str, str, dict, dict]]:
    if record["status"] == "short":
        return [("short", "reference", {}, {})]
    rows = [("prefix", "P", {}, {"prefix_sha": record["prefix_sha"]}),
            ("reference", "live", {}, {"suffix_sha": sha_ids(record["reference_suffix"])})]
    for key, cell in record["cells"].items():
        rows.append(("crossing-cell", key, {"same_as_reference_live":
                                            cell["same_as_reference_live"]},
                     {k: cell[k] for k in ("prefix_sha", "cache_sha", "logits_sha",
                                           "suffix_sha") if k in cell}))
    for c in record["comparisons"]:
        rows.append(("crossing", f"{c['stack']}|{c['a']}~{c['b']}", _comparison_metrics(c), {}))
    return rows


def _comparison_metrics(c: dict) -> dict:
    cache, logits, suffix = c.get("cache") or {}, c.get("logits") or {}, c["suffix"]
    return {"prefix_identical": c["prefix_identical"], "cache_bit_exact": cache.get("bit_exact"),
            "first_bad_layer": cache.get("first_bad_layer"), "d_rel": cache.get("d_rel"),
            "max_ulp": cache.get("max_ulp"), "logits_equal": logits.get("equal"),
            "argmax_agree": logits.get("argmax_agree"), "suffix_identical": suffix["identical"],
            "first_divergence": suffix["first_divergence"],
            "margin_at_divergence": suffix["margin_a_at_divergence"]}


def _verdict(c: dict) -> str:
    cache = c.get("cache")
    cache_text = "n/a" if cache is None else "exact" if cache["bit_exact"] else "differs"
    logits = c.get("logits")
    logits_text = "n/a" if logits is None else "exact" if logits["equal"] else "differs"
    suffix = c["suffix"]
    suffix_text = "identical" if suffix["identical"] else f"diverges@{suffix['first_divergence']}"
    return f"cache {cache_text}, logits {logits_text}, suffix {suffix_text}"


def fingerprints(record: dict) -> dict[tuple[str, str], dict]:
    """{(kind, label): fingerprints} of one unit's record (what `audit` compares)."""
    return {(kind, label): prints for kind, label, _, prints in record_rows(record)}
