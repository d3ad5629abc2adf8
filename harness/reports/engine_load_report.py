"""A load run's report: one stored `kvfid engine-load` as text, Markdown and self-contained HTML.

Through kvfid.reports.document like the engine check's report (kvfid.reports.engine_report),
written to `<reports>/<environment key>/<id>/report.md`, `report.html` and the record as
`engine-load.json` (which the index lists). It holds what ran and what load did (preemptions,
tokens recomputed, prefix-cache hits, co-residents, throughput), the verdict (none while a
request is missing), the table per group of requests (all, preempted / not, by co-resident
count: differing in tokens, logprob bits or engine state, the first differing token step and the
first bad layer), each preemption's live state against the rebuilt one, the missing requests
with why, the sweep (a table and, in the HTML, a figure), the command and the environment.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from kvfid.records.engine_load import EngineLoadRecord, groups
from kvfid.reports.document import Cell, plain_text
from kvfid.reports.engine_report import closing, write_files_of
from kvfid.reports.figures import svg_shares

EXACT, DIFFERS = "bit-exact", "diverges"


def verdict(record: EngineLoadRecord) -> str:
    """One sentence: no verdict (missing requests), every request exact, or how many differ."""
    done = [r for r in record.requests if not r.missing]
    if not record.complete:
        return (f"No verdict: {len(record.missing)} of {len(record.requests)} requests are missing "
                "(below, with why); the comparisons of the others are shown, not judged.")
    differ = sum(r.differs for r in done)
    preempted = [r for r in done if r.preemptions]
    if not differ:
        read = all(r.kv is not None for r in done)
        what = "tokens, logprob bits and engine state" if read else \
            "tokens and logprob bits (engine states not read: see the note)"
        return (f"Bit-exact: all {len(done)} requests equal their alone runs in {what}, the "
                f"{len(preempted)} preempted ones included.")
    return (f"Differs: {differ} of {len(done)} requests differ from their alone runs "
            f"({sum(r.differs for r in preempted)} of the {len(preempted)} preempted).")


GROUP_HEAD = ["requests", "n", "differ", "tokens", "logprobs", "KV", "1st token step", "1st bad layer"]


def group_rows(record: EngineLoadRecord) -> list[list]:
    """The table per group of requests (records.engine_load.groups)."""
    show = lambda v: "-" if v is None else str(v)   # noqa: E731
    return [[g.name, g.requests, Cell(str(g.differ), DIFFERS if g.differ else EXACT),
             g.tokens_differ, g.logprobs_differ,
             f"{g.kv_differ}/{g.kv_read}", show(g.first_token_step), show(g.first_bad_layer)]
            for g in groups(record.requests)]


def load_facts(record: EngineLoadRecord) -> list[list[str]]:
    """What ran and what load did, as rows of two cells."""
    done = [r for r in record.requests if not r.missing]
    preempted = [r for r in done if r.preemptions]
    return [["engine", record.engine + (" (faithful: kvfid's attention and batch-invariant mode)"
                                        if record.faithful else " (stock)")],
            ["served", "the engine's own OpenAI server on 127.0.0.1" if record.mode == "server"
             else "in process (clients on the step loop)"],
            ["model", f"{record.model} ({record.dtype})"],
            ["requests", f"{len(record.requests)} from {record.clients} clients, {record.tokens} new "
                         f"tokens each, plan seed {record.seed}"],
            ["KV budget", f"{record.kv_blocks} blocks of {record.block_size} tokens"],
            ["chunked prefill", f"by {record.chunk}" if record.chunk else "off (prompts never split)"],
            ["prefix cache", "on" if record.prefix_caching else "off"],
            ["preemptions", f"{sum(r.preemptions for r in done)} in {len(preempted)} requests, "
                            f"{sum(r.recomputed for r in done)} tokens recomputed"
                            + (f", {record.offloads} offloaded to host memory" if record.offloads else "")],
            *([["under pressure", record.pressure]] if record.pressure else []),
            *([["cached blocks evicted", f"{record.evictions} times"]] if record.evictions else []),
            ["prefix-cache hits", f"{sum(sum(r.cache_hits) for r in done)} tokens served"],
            ["most co-resident", str(max((r.coresident for r in done), default=0))],
            ["throughput", f"{record.tokens_per_s:.1f} generated tok/s ({record.generated_tokens} "
                           f"tokens, {record.prompt_tokens} prompt tokens, {record.load_wall_s:.1f} s, "
                           f"{record.steps} steps)"],
            ["threads", str(record.threads) if record.threads else "the engine's own"]]


def resumed_rows(record: EngineLoadRecord) -> list[list]:
    """Per preempted request: each preemption's live state against what the resume rebuilt."""
    rows = []
    for r in record.requests:
        for i, d in enumerate(r.resumed):
            served = r.cache_hits[i + 1] if i + 1 < len(r.cache_hits) else "-"
            rows.append([r.index, i + 1, d.positions, max(d.positions - r.prompt, 0), served,
                         "bit-exact" if d.exact else "differs",
                         "-" if d.first_bad_layer is None else d.first_bad_layer,
                         "-" if d.first_position is None else d.first_position, d.n_diff])
    return rows


RESUMED_HEAD = ["request", "preemption", "positions", "of them decoded live", "from the prefix cache",
                "rebuilt vs live", "1st bad layer", "1st position", "elements"]


def sweep_rows(record: EngineLoadRecord) -> list[list]:
    """The sweep: per prompt length and co-resident count, requests differing from alone."""
    return [[p.prompt, p.coresident, p.observed or "-", Cell(f"{p.differ}/{p.requests}", DIFFERS if p.differ else EXACT),
             "-" if p.first_step is None else p.first_step] for p in record.sweep]


def first_parting(record: EngineLoadRecord) -> list[str]:
    """Per prompt length, the fewest co-resident sequences at which some request differs."""
    out = []
    for length in sorted({p.prompt for p in record.sweep}):
        points = sorted((p for p in record.sweep if p.prompt == length), key=lambda p: p.coresident)
        first = next((p for p in points if p.differ), None)
        held = f" ({first.observed} held in one step)" if first is not None and first.observed else ""
        out.append(f"prompt {length}: " + (f"first differs at {first.coresident} co-resident{held}"
                                           if first else f"never differs up to {points[-1].coresident}"))
    return out


def command(record: EngineLoadRecord) -> str:
    """The `kvfid engine-load` command that measures this again (the plan's shape at its defaults
    but for what the record holds)."""
    args = ["kvfid", "engine-load", "--engine", record.engine_name, "--model", record.model,
            "--dtype", record.dtype, "-n",
            str(len(record.requests)), "--clients", str(record.clients), "--tokens", str(record.tokens),
            "--seed", str(record.seed), "--kv-blocks", str(record.kv_blocks)]
    args += ["--greedy-share", f"{record.greedy_share:g}"] if record.greedy_share != 0.5 else []
    args += ["--chunk", str(record.chunk)] if record.chunk else []
    args += ["--faithful"] if record.faithful else []
    args += ["--server"] if record.mode == "server" else []
    args += ["--no-prefix-cache"] if not record.prefix_caching else []
    args += ["--threads", str(record.threads)] if record.threads else []
    args += ["--sweep"] if record.sweep else []
    args += ["--kv-cache-dtype", record.kv_cache_dtype] if record.kv_cache_dtype != "auto" else []
    return shlex.join(args)


def document(stored, raw_environment: bool = True) -> list:
    """The report as blocks (kvfid.reports.document's tuple form and Cells)."""
    r: EngineLoadRecord = stored.record
    doc = [("h1", f"kvfid engine-load {stored.id}: {r.label}"), ("p", verdict(r)),
           ("table", ["load run", stored.id], load_facts(r) + [
               ["written", stored.written], ["wall", f"{r.wall_s:.1f} s"],
               ["environment", stored.environment_key], ["git revision", stored.git_revision or "none"]]),
           ("h2", "Each request against itself alone"),
           ("table", GROUP_HEAD, group_rows(r)),
           ("p", "Each request was run again alone (a fresh engine's state: the prefix cache emptied, "
                 "the same sampling seed) and compared bitwise: its tokens, the fp32 bits of each "
                 "token's logprob up to the first differing token, and its engine state (each layer's "
                 "K and V read out of the paged cache) over the positions both hold over identical "
                 "tokens. KV: requests whose state differs / requests whose state was read. "
                 "Co-resident: the most sequences sharing one of the request's steps.")]
    if resumed_rows(r):
        doc += [("h2", "Preempted requests: rebuilt against live"), ("table", RESUMED_HEAD, resumed_rows(r)),
                ("p", "The state a request held just before its preemption freed its blocks, against "
                      "the same positions of the state it ended with after the resume recomputed them "
                      "(partly from the prefix cache).")]
    if r.missing:
        doc += [("h2", "Missing requests"), ("table", ["request", "why"],
                                             [[m.index, m.missing] for m in r.missing])]
    if r.sweep:
        series = [(f"prompt {length}", [(p.coresident, p.differ / p.requests) for p in r.sweep
                                        if p.prompt == length])
                  for length in sorted({p.prompt for p in r.sweep})]
        doc += [("h2", "Sweep: co-resident sequences and prompt length"),
                ("p", "; ".join(first_parting(r)) + "."),
                ("figure", svg_shares(series, "co-resident sequences", "share of requests differing"),
                 "Per prompt length, the share of the co-resident requests whose tokens or logprob "
                 "bits differ from their alone runs; hollow marks: none differs."),
                ("details", "the sweep's numbers",
                 ("table", ["prompt", "co-resident sent", "most held in a step", "differ", "1st step"],
                  sweep_rows(r)))]
    doc += [("p", f"Note: {n}") for n in r.notes]
    return doc + closing(stored, command(r), raw_environment)


def text(stored) -> str:
    """The report for a terminal (no figure, no raw environment)."""
    return plain_text(document(stored, raw_environment=False))


def write_report(stored, root: str | Path = "reports") -> dict[str, Path]:
    """Write report.md, report.html and engine-load.json to <root>/<environment key>/<id>/."""
    return write_files_of(stored, document(stored), "engine-load.json", root)
