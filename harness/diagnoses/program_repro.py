"""`kvfid repro --program`: one stage program on one stack at its merge boundary, every input
checked before any compute (a bad program exits 2 in one line), the verdict against live."""

from __future__ import annotations

from dataclasses import dataclass

from kvfid.errors import BadInput
from kvfid.names import BIT_EXACT, DIVERGES


@dataclass
class ProgramOutcome:
    """What `kvfid repro --program` prints, and whether the verdict is the expected one."""

    record: dict  # kvfid.stages.program.run_program
    environment: dict
    environment_key: str

    @property
    def verdict(self) -> str | None:
        comparisons = self.record["comparisons"]
        if not comparisons:
            return None
        exact = all(c["bit_exact"] and c["logits"]["equal"] and c["suffix"]["identical"]
                    for c in comparisons)
        return BIT_EXACT if exact else DIVERGES

    def passed(self, expect: str | None) -> bool:
        return expect is None or self.verdict == expect

    def to_json(self) -> dict:
        return {**self.record, "verdict": self.verdict, "environment": self.environment,
                "environment_key": self.environment_key}

    def text(self) -> str:
        r = self.record
        lines = [f"program {r['program']} on {r['stack']['label']}: merge boundary of "
                 f"{r['boundary_length']} tokens, S={r['S']}"]
        for s in r["segments"]:
            lines.append(f"  {s['segment']:<10} tokens {s['start']}-{s['start'] + s['length'] - 1}"
                         f"  positions {s['positions'][0]}-{s['positions'][1]}")
        lines.append("arm vs live      cache      first bad (layer, segment)   logits   suffix")
        for c in r["comparisons"]:
            bad = "-" if c["bit_exact"] else f"{c['first_bad_layer']} {c['first_bad_kv']}, {c['first_bad_segment']}"
            lines.append(f"  {c['arm']:<14} {'bit-exact' if c['bit_exact'] else 'differs':<10} "
                         f"{bad:<28} {'equal' if c['logits']['equal'] else 'differ':<8} "
                         f"{'identical' if c['suffix']['identical'] else 'diverges at ' + str(c['suffix']['first_divergence'])}")
        for rep in r["replicas"]:
            lines.append(f"  replica of {rep['arm']}: cache {'bit-exact' if rep['bit_exact'] else 'differs'}, "
                         f"suffix {'identical' if rep['suffix_identical'] else 'differs'}")
        for t in r["transplants"]:
            lines.append(f"  transplant {t['transplant']}: {t['outcome']}"
                         + (" (the two suffixes are the same)" if t["same_suffixes"] else ""))
        if "crossing" in r:
            lines.append(f"crossing (the program frozen from {r['crossing']['reference']}'s live run):")
            for cell in r["crossing"]["cells"]:
                lines.append(f"  {cell['stack']:<16} {cell['arm']:<12} suffix "
                             f"{'= reference' if cell['suffix_equals_reference'] else '!= reference'}")
            for row in r["crossing"]["within"]:
                lines.append(f"  {row['stack']}: incremental vs prefill cache "
                             f"{'bit-exact' if row['bit_exact'] else 'differs'}")
        for c in r["comparisons"]:
            differ = [name for name, same in c["segments_exact"].items() if not same]
            if differ:
                lines.append(f"  {c['arm']}: segments whose keys or values differ: {', '.join(differ)}")
        shown = self.verdict or "none (nothing was compared with live)"
        return "\n".join(lines) + f"\n\nverdict: {shown}"


def repro_program(program: str, model_name: str, stack, prompt, item_set, item_index,
                  boundary: int, suffix: int, constructions: str, replicas: str, transplants, cross,
                  ignore_eos: bool = False) -> ProgramOutcome:
    """Check the program and the options, then measure it (kvfid.stages.program)."""
    from kvfid.environment import envinfo
    from kvfid.stages import program as stages, checks as stages_checks
    from kvfid.stacks.serving import describe_layers
    from kvfid.diagnoses.subject import check_subject

    spec = stages.parse_program(program)
    if suffix < 1:
        raise BadInput(f"-S = {suffix}: a stage program needs a suffix of at least 1 token")
    if stack.tp != 1:
        raise BadInput(f"--tp {stack.tp}: a stage program runs at TP size 1 only")
    try:
        crossed = [stack.with_dtype(d) for d in cross.split(",")] if cross else []
    except ValueError as err:
        raise BadInput(f"--cross {cross}: {err}") from None
    arms = constructions
    chosen = tuple(a for a in arms.split(",") if a)
    again = tuple(r for r in replicas.split(",") if r)
    if "live" not in chosen:
        raise BadInput(f"--constructions {arms}: a stage program's arms are compared with live; "
                       f"include it")
    for label in again:
        if label not in chosen:
            raise BadInput(f"--replicas {label}: not among --constructions ({arms})")
    try:
        stages_checks.check_arms(chosen)
    except ValueError as err:
        raise BadInput(str(err)) from None
    subject = check_subject(model_name, stack, prompt, item_set, item_index)
    item, model, prompt_length = subject.item, subject.model, len(subject.prompt_ids)
    openers = [len(o) for o in stages.delimiters(model.codec, spec)]
    stages_checks.check_program_fits(prompt_length, spec, openers, suffix, model.context_length)
    if spec.layout == "batched":
        from kvfid.stages.batched import check_batched

        check_batched(spec, stages.delimiters(model.codec, spec))
    from kvfid.stages import transplant as stages_transplant

    ranges = stages_transplant.segment_ranges(prompt_length, spec, openers)
    moves = tuple(stages_transplant.parse(t, ranges, chosen) for t in transplants)
    subject.check_serves(stages_checks.program_length(prompt_length, spec, openers) + suffix,
                         tuple(crossed))
    stages_checks.check_layers(describe_layers(model))
    record = stages.run_program(model, stack, item.prompt, spec, suffix, chosen, ignore_eos, again,
                                moves)
    if crossed:
        from kvfid.stages.crossing import run_crossing

        eos = frozenset() if ignore_eos else model.codec.eos_ids
        record["crossing"] = run_crossing(model, spec, record, crossed, suffix, eos)
    environment = envinfo.collect()
    return ProgramOutcome(record, environment, envinfo.environment_key(environment))
