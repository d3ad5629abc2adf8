"""One stack of a regression comparison: what changed between run A and run B, item by item.

`compare_stack` (called by kvfid.compare.runs) takes the units both runs stored for one stack and
returns its entry and regression reasons: bit-exact verdicts that flipped, item by item (with
INVARIANCE_RULE); rates whose 95% Wilson intervals no longer overlap (`rate_change`,
INTERVAL_RULE); and stored fingerprints that differ per item and row, with what the records say
about where tokens part and each run's first bad layer against live (FINGERPRINT_RULE).
"""

from __future__ import annotations

from kvfid.records.program import ProgramRecord
from kvfid.records.record import CrossingRecord, ItemRecord
from kvfid.records.replay_record import ReplayRecord
from kvfid.records.plain import as_plain
from kvfid.runs.aggregate import rate
from kvfid.runs.stats import PairedDifference
from kvfid.runs.summary import CrossingAggregate, Rate, StackAggregate
from kvfid.reports.document import interval_text, number
from kvfid.ledger.rows import cell_label

# --------------------------------------------------------------------------- one stack

def compare_stack(label: str, side_a: dict, side_b: dict, must_reproduce: bool):
    """(the stack's entry, its regression reasons); `must_reproduce`: same key and case."""
    units_a = {i: u for (i, s), u in side_a["units"].items() if s == label}
    units_b = {i: u for (i, s), u in side_b["units"].items() if s == label}
    both = [i for i in units_a if i in units_b]
    comparable = [i for i in both if _comparable(units_a[i].record, units_b[i].record)]
    ok = [i for i in comparable
          if units_a[i].record.status == units_b[i].record.status == "ok"]
    entry = {"items": {"compared": ok,
                       "only_a": [i for i in units_a if i not in units_b],
                       "only_b": [i for i in units_b if i not in units_a],
                       "not_comparable": [i for i in both if i not in comparable],
                       "status_changed": [{"item": i, "a": units_a[i].record.status,
                                           "b": units_b[i].record.status}
                                          for i in comparable if units_a[i].record.status
                                          != units_b[i].record.status]}}
    reasons = []
    entry["verdicts"] = _verdict_changes([(i, units_a[i].record, units_b[i].record) for i in ok])
    for v in entry["verdicts"]:
        if v["status"] == "regression":
            items = "; ".join(f"{f['item']} (B: {f['b']})" for f in v["broke"][:5])
            more = f" and {len(v['broke']) - 5} more" if len(v["broke"]) > 5 else ""
            reasons.append(f"{label}: {v['check']} of {v['construction']} held on all "
                           f"{v['a']['n']} items in A and fails in B on {items}{more}")
    summary_a, summary_b = side_a["summary"], side_b["summary"]
    crossing = any(u.is_crossing for u in units_a.values())
    if crossing:
        entry["rates"] = _crossing_rates(summary_a.crossing, summary_b.crossing)
    elif label not in summary_a.stacks:    # a program run: its verdicts and fingerprints
        entry["rates"] = []
    else:
        entry["rates"] = _rate_changes(summary_a.stacks[label], summary_b.stacks[label])
    for r in entry["rates"]:
        if r["status"] == "worse":
            reasons.append(f"{label}: {r['measure']} of {r['construction']} worse beyond the 95% "
                           f"intervals: {interval_text(Rate.from_plain(r['a']))} in A, "
                           f"{interval_text(Rate.from_plain(r['b']))} in B")
    models = side_a["model"], side_b["model"]
    compare_prints = not (all(models) and models[0] != models[1])
    entry["fingerprints"] = [] if not compare_prints else _fingerprint_changes(
        label, comparable, side_a, side_b)
    entry["fingerprints_compared"] = compare_prints
    if must_reproduce and entry["fingerprints"]:
        items = sorted({d["item"] for d in entry["fingerprints"]})
        shown = ", ".join(items[:5]) + (", ..." if len(items) > 5 else "")
        reasons.append(f"{label}: fingerprints differ on {len(items)} item(s) ({shown}) between "
                       f"two runs of one case on the same environment key: the run does not "
                       f"reproduce there")
    entry["regressed"] = bool(reasons)
    return entry, reasons


def _comparable(ra, rb) -> bool:
    """Same kind of unit, prompt, and shape: B and S (a program unit: its programs and S; a
    replay unit: the trajectory's prompt and token counts and its constructions): the two units
    measured the same thing."""
    return type(ra) is type(rb) and (ra.item.prompt, _shape(ra)) == (rb.item.prompt, _shape(rb))


def _shape(record) -> tuple:
    if isinstance(record, ProgramRecord):
        return tuple((run.program, run.S) for run in record.runs)
    if isinstance(record, ReplayRecord):
        return record.prompt_length, record.tokens, tuple(sorted(record.constructions))
    return record.B, record.S


def _verdicts(record) -> dict[tuple, tuple[bool, str]]:
    """{(check, construction, invariance?): (holds, what it says)} of one unit's record."""
    out = {}
    if isinstance(record, CrossingRecord):
        for w in record.within:
            c = w.comparison
            _comparison_verdicts(out, c, f"{c.b} vs {c.a} at {w.stack}")
        for cell in record.cells:
            out[("suffix equals reference live", f"{cell.stack} {cell.construction}", False)] = (
                cell.same_as_reference_live,
                "equal" if cell.same_as_reference_live else "differs")
        return out
    if isinstance(record, ProgramRecord):
        for run in record.runs:
            for c in run.comparisons:
                out[("cache bit-exact", f"{run.layout} {c.arm} vs live", True)] = (
                    c.bit_exact, "bit-exact" if c.bit_exact else
                    f"first bad layer {c.cache.first_bad_layer}, segment {c.first_bad_segment}")
                out[("suffix identical", f"{run.layout} {c.arm} vs live", False)] = (
                    c.suffix.identical, "identical" if c.suffix.identical
                    else f"diverges at {c.suffix.first_divergence}")
            for r in run.replicas:
                out[("replica bit-exact", f"{run.layout} {r.arm}", True)] = (
                    r.bit_exact and r.suffix_identical, "bit-exact" if r.bit_exact else "differs")
        return out
    if isinstance(record, ReplayRecord):   # each re-scoring against the step-by-step reference
        for name, m in record.constructions.items():
            out[("logprobs bit-exact", f"{name} vs step-by-step", True)] = (
                m.differ == 0, "bit-exact" if m.differ == 0 else
                f"{m.differ} of {m.tokens} tokens differ, first at {m.first_position}")
        return out
    for c in record.comparisons:
        where = f"{c.b} vs {c.a}" + (" (bridge)" if c.kind == "bridge" else "")
        _comparison_verdicts(out, c, where)
    for r in record.replicas:
        c = r.comparison
        exact = c.bit_exact and bool(c.logits and c.logits.equal) and c.suffix.identical
        out[("replica bit-exact", r.construction, True)] = (exact, _state_text(c))
    for label, arm in record.arms.items():
        if arm.rows_identical is not None:
            out[("batched rows identical", label, True)] = (
                arm.rows_identical, "every row's state equals row 0's"
                if arm.rows_identical else "a row's state differs from row 0's")
    return out


def _comparison_verdicts(out: dict, c, where: str) -> None:
    if c.cache is not None:
        out[("cache bit-exact", where, True)] = (c.cache.bit_exact, _state_text(c))
    out[("suffix identical", where, False)] = (
        c.suffix.identical, "identical" if c.suffix.identical
        else f"diverges at {c.suffix.first_divergence}")


def _state_text(c) -> str:
    """One comparison's cache verdict: `bit-exact`, or its first bad layer and size."""
    cache = c.cache
    if not cache:
        return "no cache comparison"
    if cache.bit_exact:
        text = "bit-exact"
    elif cache.first_bad_layer is None:
        text = f"not compared whole ({'; '.join(cache.uncompared)})"
    else:
        kv = (cache.first_bad_kv or "").upper()
        text = (f"first bad layer {cache.first_bad_layer}{' ' + kv if kv else ''}"
                f" ({len(cache.bad_layers)} layer(s) differ), max ULP {cache.max_ulp} (through "
                f"zero), d_rel {number(cache.d_rel)}")
    if c.kind == "replica" and not c.suffix.identical:
        text += f"; suffix diverges at {c.suffix.first_divergence}"
    return text


def _verdict_changes(units: list[tuple[str, dict, dict]]) -> list[dict]:
    """Per (check, construction): counts in A and B over the same items, items that flipped."""
    table: dict[tuple, dict] = {}
    for item, ra, rb in units:
        va, vb = _verdicts(ra), _verdicts(rb)
        for key in [k for k in va if k in vb]:
            check, construction, invariance = key
            entry = table.setdefault(key, {
                "check": check, "construction": construction, "invariance": invariance,
                "a": {"k": 0, "n": 0}, "b": {"k": 0, "n": 0}, "broke": [], "fixed": []})
            (held_a, text_a), (held_b, text_b) = va[key], vb[key]
            for side, held in (("a", held_a), ("b", held_b)):
                entry[side]["k"] += held
                entry[side]["n"] += 1
            if held_a != held_b:
                entry["broke" if held_a else "fixed"].append(
                    {"item": item, "a": text_a, "b": text_b})
    for entry in table.values():
        entry["held_a"] = entry["a"]["n"] > 0 and entry["a"]["k"] == entry["a"]["n"]
        entry["held_b"] = entry["b"]["n"] > 0 and entry["b"]["k"] == entry["b"]["n"]
        if entry["invariance"] and entry["held_a"] and not entry["held_b"]:
            entry["status"] = "regression"
        elif entry["broke"] and entry["fixed"]:
            entry["status"] = "changed"
        elif entry["broke"]:
            entry["status"] = "worse"
        elif entry["fixed"]:
            entry["status"] = "better"
        else:
            entry["status"] = "same"
    return list(table.values())


# --------------------------------------------------------------------------- rates

def rate_change(measure: str, construction: str, ra: Rate | None, rb: Rate | None,
                 worse: str) -> dict | None:
    """`worse`: `higher` or `lower`; status same / within / worse / better (INTERVAL_RULE).
    The comparison's row is plain data (its rates as summary.json writes them)."""
    if not ra or not rb:
        return None
    ra, rb = rate(ra.k, ra.n), rate(rb.k, rb.n)   # recomputed: one source of CI
    if (ra.k, ra.n) == (rb.k, rb.n):
        status = "same"
    elif ra.ci[1] < rb.ci[0]:
        status = "worse" if worse == "higher" else "better"
    elif rb.ci[1] < ra.ci[0]:
        status = "better" if worse == "higher" else "worse"
    else:
        status = "within"
    return {"measure": measure, "construction": construction, "worse_when": worse,
            "a": as_plain(ra), "b": as_plain(rb), "status": status}


def _flips(paired: PairedDifference | None) -> Rate | None:
    """Correctness flips against live (either direction) as a count of the paired items."""
    if not paired or not paired.n:
        return None
    return rate(paired.a_right_b_wrong + paired.a_wrong_b_right, paired.n)


def _rate_changes(sa: StackAggregate, sb: StackAggregate) -> list[dict]:
    rows = []
    for label, ca in sa.constructions.items():
        cb = sb.constructions.get(label)
        if cb is None:
            continue
        name = f"{label} vs {ca.vs}" + (" (bridge)" if ca.kind == "bridge" else "")
        rows += [rate_change("suffix differs", name, ca.suffix_disagree, cb.suffix_disagree,
                             "higher"),
                 rate_change("cache bit-exact", name, ca.cache_bit_exact, cb.cache_bit_exact,
                             "lower"),
                 rate_change("correctness flips", name, _flips(ca.correctness),
                             _flips(cb.correctness), "higher")]
    for arm, ra in sa.replicas.items():
        rows.append(rate_change("replica floor (suffix differs)", f"{arm} twice", ra,
                                sb.replicas.get(arm), "higher"))
    for arm, ra in sa.batched_rows_identical.items():
        rows.append(rate_change("batched rows identical", arm, ra,
                                sb.batched_rows_identical.get(arm), "lower"))
    return [r for r in rows if r]


def _crossing_rates(xa: CrossingAggregate | None, xb: CrossingAggregate | None) -> list[dict]:
    if not xa or not xb:
        return []
    rows = []
    for stack, cells in xa.cells.items():
        for construction, ra in cells.items():
            rows.append(rate_change("suffix equals reference live", f"{stack} {construction}",
                                    ra, xb.cells.get(stack, {}).get(construction), "lower"))
        within_b = xb.within.get(stack)
        if within_b:
            within = xa.within[stack]
            rows.append(rate_change("suffix differs", f"{within.pair} at {stack}",
                                    within.suffix_disagree, within_b.suffix_disagree, "higher"))
    return [r for r in rows if r]


# --------------------------------------------------------------------------- fingerprints

def _fingerprint_changes(label: str, items: list[str], side_a: dict, side_b: dict) -> list[dict]:
    """One entry per (item, row) whose stored fingerprints differ between the runs."""
    out = []
    for item in items:
        pa, pb = side_a["prints"].get((item, label), {}), side_b["prints"].get((item, label), {})
        ra = side_a["units"][(item, label)].record
        rb = side_b["units"][(item, label)].record
        for row in sorted(set(pa) | set(pb)):
            old, new = pa.get(row), pb.get(row)
            if old == new:
                continue
            kind, name = row
            fields = (["row stored in B only"] if old is None else ["row stored in A only"]
                      if new is None else sorted(f for f in set(old) | set(new)
                                                 if old.get(f) != new.get(f)))
            out.append({"item": item, "kind": kind, "label": name, "fields": fields,
                        "detail": _fingerprint_detail(kind, name, fields, ra, rb)})
    return out


def _fingerprint_detail(kind: str, name: str, fields: list[str], ra, rb) -> str:
    """What the stored records say about a differing row: where tokens part, each run's layers."""
    parts = []
    if kind == "prefix" and isinstance(ra, ItemRecord) and isinstance(rb, ItemRecord):
        at = _first_difference(ra.prefix, rb.prefix)
        parts.append(f"P differs from token {at}: the live generation changed, so every state "
                     f"and suffix of this item is built over another prefix")
    if kind == "boundary":
        arm_a, arm_b = ra.arms.get(name), rb.arms.get(name)
        if "suffix_sha" in fields:
            at = _first_difference(arm_a.suffix if arm_a else (), arm_b.suffix if arm_b else ())
            parts.append(f"suffix differs from token {at}")
        if "cache_sha" in fields:
            ca, cb = ra.against_live(name), rb.against_live(name)
            if ca is None or cb is None:
                parts.append("cache bytes differ (one hash per cache is stored, so the layers "
                             "where the two runs' states differ are not known)")
            else:
                parts.append(f"cache bytes differ; against {ca.a}: A {_state_text(ca)}, "
                             f"B {_state_text(cb)}")
        if "logits_sha" in fields:
            parts.append("boundary logits differ")
    if kind == "crossing-cell":
        cell_a, cell_b = (next((c for c in r.cells if cell_label(c.stack, c.construction) == name),
                               None) for r in (ra, rb))
        if "suffix_sha" in fields:
            at = _first_difference(cell_a.suffix if cell_a else (),
                                   cell_b.suffix if cell_b else ())
            parts.append(f"suffix differs from token {at}")
    if kind == "replica" and "verdict" in fields:
        parts.append("the replica verdict changed")
    if kind == "transplant" and "outcome" in fields:
        ta, tb = (next((t for t in r.transplants if t.label == name), None) for r in (ra, rb))
        parts.append(f"outcome {ta and ta.outcome} in A, {tb and tb.outcome} in B")
    return "; ".join(parts)


def _first_difference(a: list, b: list) -> int | None:
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if list(a) == list(b) else common
