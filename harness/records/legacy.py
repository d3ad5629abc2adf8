"""Records as ledgers of schema 1-2 stored them: untagged dicts, read into today's records.

Those records spelled a replica as a comparison whose b label ends in a prime (`prefill'`) with
its fingerprints beside it, and crossing cells under "stack|construction" keys; both become
their typed places here (kvfid.records.record). Nothing writes this form any more.
"""

from __future__ import annotations

import dataclasses

from kvfid.records.plain import from_plain
from kvfid.records.record import (Comparison, CrossingCell, CrossingRecord, Fingerprints,
                                     ItemRecord, ItemRef, RecordRefused, Replica,
                                     StackComparison)


def from_untagged(data: dict):
    """A record as ledgers of schema 1-2 stored it (a dict without `schema`)."""
    try:
        return _crossing_v2(data) if "cells" in data else _item_v2(data)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise RecordRefused(f"not a kvfid record of schema 1-2 ({type(err).__name__}: {err})"
                            ) from None


def _comparison_v2(c: dict) -> Comparison:
    plain = {k: v for k, v in c.items()
             if k in ("a", "b", "kind", "suffix", "prefix_identical", "cache", "logits")}
    if plain.get("kind") == "replica":
        plain["b"] = plain["b"].rstrip("'")
    return from_plain(Comparison, plain)


def _item_v2(data: dict) -> ItemRecord:
    data = dict(data)
    comparisons, replicas = [], []
    for c in data.pop("comparisons", []):
        if c["kind"] == "replica":
            replicas.append(Replica(c["a"], from_plain(Fingerprints, c.get("replica_fingerprints",
                                                                      {})), _comparison_v2(c)))
        else:
            comparisons.append(_comparison_v2(c))
    item = data.pop("item")
    data["item"] = item if isinstance(item, dict) else {"id": item}
    record = from_plain(ItemRecord, {k: v for k, v in data.items() if k != "crossing"})
    crossing = data.get("crossing")
    return dataclasses.replace(record, comparisons=tuple(comparisons), replicas=tuple(replicas),
                               crossing=_crossing_v2(crossing) if crossing else None)


def _crossing_v2(data: dict) -> CrossingRecord:
    cells = []
    for key, cell in data.get("cells", {}).items():
        stack, construction = key.split("|")
        prints = {k: cell[k] for k in ("cache_sha", "logits_sha", "suffix_sha", "prefix_sha")
                  if k in cell}
        cells.append(CrossingCell(stack, construction, from_plain(Fingerprints, prints),
                                  tuple(cell.get("suffix", ())),
                                  cell["same_as_reference_live"], cell.get("forward_calls", 0),
                                  float(cell.get("wall_s", 0.0))))
    within = tuple(StackComparison(c["stack"], _comparison_v2(c))
                   for c in data.get("comparisons", []))
    item = data["item"]
    return CrossingRecord(from_plain(ItemRef, item if isinstance(item, dict) else {"id": item}),
                          data["reference"], data["B"], data["S"], data["status"],
                          data.get("prefix_sha"), tuple(data.get("reference_suffix", ())),
                          tuple(cells), within)
