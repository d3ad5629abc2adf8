"""Text rendering of one item's record for a person at a terminal (`kvfid repro`), one stream's
or a stage program's (`program_text`)."""

from __future__ import annotations

from kvfid.records.record import ArmRecord, Comparison, ItemRecord
from kvfid.states.scale import describe


def _short(text: str, width: int = 60) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 1] + "…"


def _aligned(codec, a: list[int], b: list[int], first: int) -> list[str]:
    """The two suffixes as text, split at the first divergent token so they line up."""
    common = codec.decode(a[:first])
    tail_a, tail_b = codec.decode(a[first:]), codec.decode(b[first:])
    pad = " " * min(len(_short(common, 40)), 40)
    return [f"      common  {_short(common, 40)}",
            f"      a       {pad}|{_short(tail_a)}",
            f"      b       {pad}|{_short(tail_b)}"]


def comparison_lines(comparison: Comparison, arms: dict[str, ArmRecord], codec,
                     b_name: str | None = None) -> list[str]:
    """A comparison's cache, logits and suffix verdicts; `b_name` names b when it is not an arm
    label (a replica: the second run of a)."""
    a, b = comparison.a, comparison.b
    lines = [f"  {a} ~ {b_name or b}  [{comparison.kind}]"]
    cache = comparison.cache
    if cache is None:
        lines.append("    cache   not comparable: the two prefixes differ")
    elif cache.bit_exact:
        lines.append("    cache   bit-exact")
    elif cache.first_bad_layer is None:   # nothing differs in what was compared, but not all was
        lines.append(f"    cache   NOT COMPARED WHOLE  {'; '.join(cache.uncompared)}")
    else:
        lines.append(f"    cache   DIFFERS  first bad layer {cache.first_bad_layer} "
                     f"({(cache.first_bad_kv or '?').upper()}), position "
                     f"{'- (no position axis)' if cache.first_position is None else cache.first_position}, "
                     f"{cache.n_diff} elements, max |diff| {cache.max_abs:.3g} "
                     f"({cache.max_abs_rel:.3g} of max |value|), "
                     f"max ULP {cache.max_ulp} (through zero), d_rel {cache.d_rel:.3g}")
        if cache.uncompared:
            lines.append(f"    cache   not compared: {'; '.join(cache.uncompared)}")
    if comparison.difference is not None:
        lines.append(f"    kind    {difference_text(comparison.difference)}")
    logits = comparison.logits
    if logits is not None:
        verdict = "bit-exact" if logits.equal else f"max |diff| {logits.max_abs:.3g}"
        agree = "argmax agrees" if logits.argmax_agree else "ARGMAX DIFFERS"
        lines.append(f"    logits  {verdict}, {agree}")
    suffix = comparison.suffix
    if suffix.identical:
        lines.append(f"    suffix  identical ({suffix.len_a} tokens)")
    else:
        first = suffix.first_divergence
        margin = suffix.margin_a_at_divergence
        margin_text = f", margin there {margin:.3g}" if margin is not None else ""
        lines.append(f"    suffix  DIVERGES at token {first}{margin_text} "
                     f"(lengths {suffix.len_a} / {suffix.len_b})")
        if a in arms and b in arms and b_name is None:
            lines += _aligned(codec, list(arms[a].suffix), list(arms[b].suffix), first)
    return lines


def difference_text(difference) -> str:
    """A difference's kind in words, its scale against the dtype's epsilon, and what settled it."""
    settled = f"; settled by {difference.settled_by}" if difference.settled_by else ""
    return (f"{describe(difference.kind)} (d_rel {difference.d_rel:.3g} = "
            f"{difference.d_rel / difference.epsilon:.3g} x the {difference.dtype} epsilon{settled})")


def item_text(record: ItemRecord, codec) -> str:
    """The whole record of `kvfid repro` as readable text."""
    head = [f"kvfid repro  model {record.model}  stack {record.stack_label}  device "
            f"{record.device}  B={record.B} S={record.S}",
            f"item {record.item.id}: {_short(record.item.prompt or '', 70)}",
            f"prompt {record.prompt_length} tokens"]
    if not record.ok:
        return "\n".join(head + [f"status SHORT: {record.note}; nothing compared"])
    arms = record.arms
    head.append(f"boundary prefix |P| = {len(record.prefix)} tokens, "
                f"sha256 {record.prefix_sha[:16]}")
    lines = head + ["", "arms"]
    for label, arm in arms.items():
        correct = {None: "", True: "  correct", False: "  wrong"}[arm.correct]
        lines.append(f"  {label:<14} {arm.forward_calls:>4} forward calls  "
                     f"{arm.wall_s:7.3f} s  cache {arm.cache_sha[:12]}  suffix "
                     f"{len(arm.suffix)} tokens{correct}")
    lines.append(f"  live text: {_short(arms['live'].answer_text or '', 90)}")
    lines += ["", "comparisons (a ~ b)"]
    for comparison in record.comparisons:
        lines += comparison_lines(comparison, arms, codec)
    for replica in record.replicas:
        lines += comparison_lines(replica.comparison, arms, codec,
                                  b_name=f"{replica.construction} (again)")
    if record.transplants:
        lines += ["", "transplants (recipient <- donor)"]
        for t in record.transplants:
            note = "  (recipient and donor suffixes agree)" if t.recipient_equals_donor else ""
            lines.append(f"  {t.label:<32} {t.outcome}{note}")
    if record.crossing is not None:
        lines += ["", "precision crossing (P frozen from this stack's live run)"]
        for w in record.crossing.within:
            suffix = w.comparison.suffix
            verdict = "identical" if suffix.identical else \
                f"diverges at {suffix.first_divergence}"
            lines.append(f"  {w.stack:<14} {w.comparison.a} ~ {w.comparison.b}: cache "
                         f"{'bit-exact' if w.comparison.bit_exact else 'differs'}, "
                         f"suffix {verdict}")
        for cell in record.crossing.cells:
            same = "same as" if cell.same_as_reference_live else "differs from"
            lines.append(f"  {cell.stack + ' ' + cell.construction:<28} suffix {same} the "
                         f"reference live suffix")
    timing = record.timing
    lines += ["", f"total {timing.wall_s:.2f} s, {timing.forward_calls} forward calls, "
                  f"{timing.forward_s:.2f} s in forward, overhead {timing.overhead:.3f} "
                  f"(after an untimed warm-up of {record.warmup_s:.2f} s)"]
    return "\n".join(lines)


def program_text(run, stack_label: str, crossing, verdict: str | None) -> str:
    """A stage program's run (kvfid.records.program.ProgramRun) on the stack labelled
    `stack_label`: its stages, each arm against live, replicas, transplants, its crossing
    (kvfid.stages.crossing.ProgramCrossing, or None), the verdict."""
    lines = [f"program {run.program} on {stack_label}: merge boundary of "
             f"{run.boundary_length} tokens, S={run.S}"]
    for s in run.segments:
        lines.append(f"  {s.segment:<10} tokens {s.start}-{s.start + s.length - 1}"
                     f"  positions {s.positions[0]}-{s.positions[1]}")
    lines.append("arm vs live      cache      first bad (layer, segment)   logits   suffix")
    for c in run.comparisons:
        bad = ("-" if c.bit_exact else
               f"{c.cache.first_bad_layer} {c.cache.first_bad_kv}, {c.first_bad_segment}")
        suffix = ("identical" if c.suffix.identical else
                  f"diverges at {c.suffix.first_divergence}")
        lines.append(f"  {c.arm:<14} {'bit-exact' if c.bit_exact else 'differs':<10} "
                     f"{bad:<28} {'equal' if c.logits.equal else 'differ':<8} {suffix}")
    for rep in run.replicas:
        lines.append(f"  replica of {rep.arm}: cache {'bit-exact' if rep.bit_exact else 'differs'}, "
                     f"suffix {'identical' if rep.suffix_identical else 'differs'}")
    for t in run.transplants:
        lines.append(f"  transplant {t.transplant}: {t.outcome}"
                     + (" (the two suffixes are the same)" if t.same_suffixes else ""))
    if crossing is not None:
        lines.append(f"crossing (the program frozen from {crossing.reference}'s live run):")
        for cell in crossing.cells:
            lines.append(f"  {cell.stack:<16} {cell.arm:<12} suffix "
                         f"{'= reference' if cell.suffix_equals_reference else '!= reference'}")
        for row in crossing.within:
            lines.append(f"  {row.stack}: incremental vs prefill cache "
                         f"{'bit-exact' if row.bit_exact else 'differs'}")
    for c in run.comparisons:
        differ = [name for name, same in c.segments_exact.items() if not same]
        if differ:
            lines.append(f"  {c.arm}: segments whose keys or values differ: {', '.join(differ)}")
    shown = verdict or "none (nothing was compared with live)"
    return "\n".join(lines) + f"\n\nverdict: {shown}"
