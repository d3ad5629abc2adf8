"""Every decoder family transformers registers for causal LM, built tiny where its config class
allows, one short `repro` each on sdpa and native+bi (and on triton+bi, in the interpreter on a
CPU, for the first family of each distinct set of layer mechanisms): bit-exact, differs, refused
(and why), or could not be built (and why). `tests/inputs/test_registry_walk.py` runs it in the suite
against the outcomes kept in `tests/support/registry_walk.json`; by hand:

    PYTHONPATH=$PWD/tests/support TRITON_INTERPRET=1 python -m registry_walk [--only NAME,...] [--json OUT]

A family is shrunk by overriding the size fields its config has (hidden size, layers, heads,
vocabulary, experts, state sizes and scan chunks, ...) with tiny values; a config that rejects
them, or a model that cannot be built or run by transformers' own forward from them, is listed as
not built, with the first line of the error. The model is built in this process (seeded) and
measured as `kvfid repro` measures a folder's (the same checks before compute, the same
`run_item`), without a save and load per stack: what `repro --model hf:FOLDER` adds is the loading.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from registry_sizes import first_line as _first_line, tiny_module


def registry() -> dict[str, str]:
    """model_type -> causal-LM class name, from transformers' own mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny(model_type: str):
    """A seeded tiny random-weight fp32 model of `model_type` (raises if not), as a kvfid Model
    over bytes (tests/support/registry_sizes.py sizes it)."""
    import transformers

    from kvfid.inputs.models import Model
    from kvfid.inputs.codecs import ByteCodec

    module = tiny_module(model_type, getattr(transformers, registry()[model_type]))
    return Model(f"walk:{model_type}", module, ByteCodec())


def mechanisms(model) -> tuple[str, ...]:
    """The set of layer kinds and mechanisms a model has (kvfid.stacks.serving), or its
    refusal's first words when kvfid cannot read a layer."""
    from kvfid.errors import KvfidError
    from kvfid.stacks import serving

    try:
        infos = serving.describe_layers(model)
    except KvfidError as err:
        return (f"unread: {str(err)[:60]}",)
    return tuple(sorted({i.kind.split(":")[0] for i in infos} | {m for i in infos for m in i.mechanisms}))


def one(model, stack: str, boundary: int = 4, suffix: int = 1) -> str:
    """One short repro, live against prefill: `bit-exact`, `differs KIND (layer L part, d_rel
    D)` with KIND `by rounding`, `functionally` or `unsettled` (kvfid.states.scale; a stack below
    fp32 is settled by the walk from its fp32 twin), `refused (exit N): ...`, `INTERNAL ...`."""
    from kvfid.errors import KvfidError
    from kvfid.stacks.stack import Stack, parse_stack
    from kvfid.protocol.protocol import ItemPlan
    from kvfid.diagnoses import repro
    from kvfid.diagnoses.subject import check_subject

    parsed = parse_stack(stack)
    try:   # kvfid repro's checks before compute (repro.prepare, the model already loaded)
        checked = Stack(parsed.backend, parsed.dtype, parsed.batch_invariant)
        plan = ItemPlan(boundary, suffix, ("live", "prefill"), (), (), ignore_eos=True)
        subject = check_subject(model, checked, "Hi")
        prompt_length = len(subject.prompt_ids)
        plan.check_fits(prompt_length, model.context_length)
        subject.check_serves(prompt_length + boundary + suffix)
        comparison = repro.measure(repro.Repro(model, checked, subject.item, plan,
                                               [])).against_live("prefill")
    except KvfidError as err:
        return f"refused (exit {err.exit_code}): {str(err)[:200]}"
    except Exception as err:   # noqa: BLE001 -- the walk lists every outcome, internal ones too
        return f"INTERNAL {_first_line(err)}"
    cache, difference = comparison.cache, comparison.difference
    if cache.bit_exact and comparison.logits.equal:
        return "bit-exact"
    where = (f"layer {cache.first_bad_layer} {cache.first_bad_kv}" if cache.first_bad_layer is not None
             else "; ".join(cache.uncompared)[:80] or "boundary logits")
    if difference is None:   # nothing measured differs: a part left uncompared
        return f"differs, uncompared ({where})"
    return f"differs {_WORDS[difference.kind]} ({where}, d_rel {difference.d_rel:.1e})"


_WORDS = {"rounding": "by rounding", "functional": "functionally", "unsettled": "unsettled"}


def settled(low: str, fp32: str | None) -> str:
    """A below-fp32 stack's outcome with an unsettled kind settled by its fp32 twin's outcome:
    rounding where fp32 is bit-exact or differs by rounding, functional where fp32 differs
    functionally; unsettled where the twin did not run or was refused."""
    if not low.startswith("differs unsettled") or fp32 is None:
        return low
    if fp32 == "bit-exact" or fp32.startswith("differs by rounding"):
        return low.replace("differs unsettled", "differs by rounding", 1)
    if fp32.startswith("differs functionally"):
        return low.replace("differs unsettled", "differs functionally", 1)
    return low


STACKS = ("sdpa/fp32", "native/fp32+bi", "sdpa/bf16", "native/bf16+bi")
TRITON = "triton/fp32+bi"   # the first family of each distinct set of mechanisms
GENERATE = ("sdpa/fp32", "native/bf16+bi")   # kvfid's live arm against generate, bit for bit


def _fp32_twin(stack: str) -> str:
    return stack.replace("/bf16", "/fp32").replace("/fp16", "/fp32")


def walk(only=None, stacks=STACKS, triton=TRITON, seen=None, generate=GENERATE) -> list[dict]:
    """Each family's row (built, an outcome per stack, live against generate per stack in
    `generate`, its mechanisms, seconds), printed as it is measured. `seen`: mechanism sets
    whose triton run is already done (shared by shards)."""
    from kvfid import kernels
    from generate_check import live_against_generate

    seen = set() if seen is None else seen
    out = []
    for model_type in sorted(registry()):
        if only and model_type not in only:
            continue
        start, row = time.perf_counter(), {"family": model_type}
        try:
            model = tiny(model_type)
        except Exception as err:   # noqa: BLE001
            row["built"] = f"not built: {_first_line(err)}"
        else:
            row["built"], cpu = "built", {}

            def timed(key, measure, *args):
                begin = time.process_time()
                try:
                    row[key] = measure(model, *args)
                except Exception as err:   # noqa: BLE001 -- listed, and failed by the test
                    row[key] = f"INTERNAL {_first_line(err)}"
                cpu[key] = round(time.process_time() - begin, 2)

            for stack in stacks:
                timed(stack, one, stack)
            for stack in stacks:
                row[stack] = settled(row[stack], row.get(_fp32_twin(stack)))
            row["mechanisms"] = list(mechanisms(model))
            if triton and kernels.interpreting() and tuple(row["mechanisms"]) not in seen:
                timed(triton, one, triton)
                if not row[triton].startswith("refused"):   # else the next family of the set
                    seen.add(tuple(row["mechanisms"]))
            for stack in generate:
                timed(f"generate {stack}", live_against_generate, stack)
            row["cpu_s"] = cpu
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


EXPECTED = Path(__file__).with_name("registry_walk.json")
OUTCOMES = ("bit-exact", "differs by rounding", "differs functionally", "differs unsettled",
            "differs, uncompared", "differs", "refused", "not built", "INTERNAL")


def outcome(text: str | None) -> str | None:
    """An outcome's class (OUTCOMES), None for a stack not run."""
    return None if text is None else next(o for o in OUTCOMES if text.startswith(o))


def expectations(rows: list[dict]) -> dict:
    """What the expectation file keeps: the transformers version and each family's row."""
    import transformers

    return {"transformers": transformers.__version__,
            "families": {r["family"]: {k: v for k, v in r.items()
                                       if k not in ("family", "seconds", "cpu_s")}
                         for r in rows}}


def regressions(rows: list[dict], expected: dict) -> list[str]:
    """Each family worse than kept: built before and not now; on a faithful (+bi) stack
    bit-exact before and not now, or differing where it did not before; on any stack differing
    functionally where it did not before (a functional difference does not depend on the CPU).
    Whether a stock stack is bit-exact or differs by rounding depends on the CPU, so that is not
    held to."""
    out = []
    for row in rows:
        kept = expected["families"].get(row["family"])
        if kept is None:
            continue
        if kept["built"] == "built" and row["built"] != "built":
            out.append(f"{row['family']}: built before, now {row['built']}")
        for stack in (k for k in kept if "/" in k and k in row):
            was, now = outcome(kept[stack]), outcome(row[stack])
            faithful = stack.endswith("+bi") and (was == "bit-exact" or now.startswith("differs"))
            if now != was and (faithful or now == "differs functionally"):
                out.append(f"{row['family']} on {stack}: {kept[stack]!r} before, now {row[stack]!r}")
    return out


def counts(rows: list[dict], stacks=(*STACKS, TRITON, *(f"generate {s}" for s in GENERATE))
           ) -> dict:
    """How many families have each outcome class, per stack (and `built` / `not built`)."""
    out = {"families": len(rows), "built": sum(r["built"] == "built" for r in rows)}
    out["not built"] = out["families"] - out["built"]
    for stack in stacks:
        classes = [outcome(r.get(stack)) for r in rows if r.get(stack) is not None]
        out[stack] = {c: classes.count(c) for c in OUTCOMES if c in classes}
    return out


def table(rows: list[dict], stacks=(*STACKS, TRITON)) -> str:
    """The walk as a Markdown table: the counts per stack, then each family's outcome per stack
    (or why it was not built)."""
    summary = counts(rows, stacks)
    lines = [f"{summary['built']} of {summary['families']} families built.", "",
             "| stack | " + " | ".join(OUTCOMES) + " |", "|---" * (len(OUTCOMES) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(str(summary[s].get(o, 0)) for o in OUTCOMES) + " |"
              for s in stacks]
    lines += ["", "| family | " + " | ".join(stacks) + " |", "|---" * (len(stacks) + 1) + "|"]
    for r in rows:
        cells = ([r.get(s, "") for s in stacks] if r["built"] == "built"
                 else [r["built"]] + [""] * (len(stacks) - 1))
        lines.append(f"| {r['family']} | " + " | ".join(c.replace("|", "/")[:90] for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--json", help="write the outcomes here")
    parser.add_argument("--table", help="write the outcomes here as a Markdown table")
    parser.add_argument("--expect", action="store_true",
                        help=f"keep the outcomes as the expectations ({EXPECTED.name})")
    args = parser.parse_args(argv)
    rows = walk(set(args.only.split(",")) if args.only else None)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.table:
        Path(args.table).write_text(table(rows) + "\n")
    if args.expect:
        EXPECTED.write_text(json.dumps(expectations(rows), indent=1, sort_keys=True) + "\n")
    internal = [r["family"] for r in rows if any("INTERNAL" in str(v) for v in r.values())]
    print(f"{len(rows)} families; internal errors: {', '.join(internal) or 'none'}", file=sys.stderr)
    return 1 if internal else 0


if __name__ == "__main__":
    raise SystemExit(main())
