"""The index page: per case one grid a person scans, environments down and stacks across (the
reverse when there are more stacks than fit across and fewer environments than stacks; a grid
too big both ways is split into tables of ACROSS columns), so the page fits 1280 px.

Each cell is one stack on one environment key: the headline construction's (prefill's) cache
bit-exact count against live and its suffix ≠ live rate with the 95% Wilson interval, coloured
by verdict (`bit-exact`: every cache bit-exact and no suffix differs; `cache differs`: suffixes
identical, some cache not; `diverges`: some suffix differs), linking the run's report. Two kinds
of old names are folded so one thing has one line: a CPU key from before the key carried the
instruction set (no `capability` in its record) goes under the key that replaced it (same CPU
model and versions), and a stack label from before the label carried the thread count takes it
from the run's repro command (`--threads N`).
"""

from __future__ import annotations

import re

from kvfid.environment import envinfo
from kvfid.reports.document import Cell, Heading, Link, Paragraph, Table, fraction, interval_text
from kvfid.runs.summary import Rate

HEADLINE = "prefill"    # the construction a cell shows (else the stack's first one)
ACROSS = 6              # at most this many stacks across before the grid turns
VERDICT_WORDS = {"bit-exact": "bit-exact", "cache-differs": "cache differs", "diverges": "diverges"}


def index_document(entries: list[dict], loads: list[dict] = ()) -> list:
    """The index as blocks of kvfid.reports.document: a grid per case, the runs shown, then the
    engine load runs (index.load_entries)."""
    return _runs_document(entries) + load_section(loads)


def load_section(loads: list[dict]) -> list:
    """One row per engine load run: the engine, what load did, requests differing from alone."""
    if not loads:
        return []
    rows = []
    for e in loads:
        r = e["record"]
        done = [q for q in r.requests if not q.missing]
        differ = sum(q.differs for q in done)
        verdict = ("no verdict", "diverges") if not r.complete else \
            ("bit-exact", "bit-exact") if not differ else (f"{differ}/{len(done)} differ", "diverges")
        rows.append([e["environment_key"], r.label, f"{len(r.requests)} from {r.clients} clients",
                     str(sum(q.preemptions for q in done)), Cell(verdict[0], verdict[1]),
                     f"{r.tokens_per_s:.1f}", report_link({**e, "run": e["id"]})])
    return [Heading("Engine load runs", 2),
            Paragraph("`kvfid engine-load`: each request under load (concurrent clients, a small KV "
                      "cache that preempts) against itself run alone, bitwise (tokens, logprob bits, "
                      "engine state); the newest run per environment key and engine."),
            Table(["environment key", "engine", "requests", "preemptions", "against alone",
                   "tok/s", "report"], rows)]


def _runs_document(entries: list[dict]) -> list:
    doc = [Heading("kvfid reports index"),
           Paragraph("The newest run of each case on each environment key (finished runs first). "
                     f"A cell: {HEADLINE}'s cache bit-exact count against live, and its suffix ≠ "
                     "live rate with the 95% Wilson interval; green **bit-exact** (every cache "
                     "bit-exact, no suffix differs), amber **cache differs** (suffixes identical), "
                     "red **diverges** (a suffix differs). A cell links its run's report. "
                     "`kvfid compare KEY_A KEY_B` reports what changed between two rows.")]
    if not entries:
        return doc + [Paragraph("No run reports yet: `kvfid report RUN` writes one.")]
    entries = [{**e, "stacks": {stack_label(s, e): v for s, v in (e["stacks"] or {}).items()}}
               for e in entries]
    for case in sorted({e["case"] for e in entries}):
        rows = fold_old_keys(sorted((e for e in entries if e["case"] == case),
                                    key=lambda e: _natural(e["environment_key"])))
        doc += [Heading(f"Case {case}", 2), *grids(rows)]
    shown = sorted(entries, key=lambda e: (e["case"], _natural(e["environment_key"])))
    doc += [Heading("Runs shown", 2),
            Table(["environment key", "case", "run", "report", "kernel table"],
                  [[e["environment_key"], e["case"], e["run"], report_link(e),
                    Link("kernels", e["kernels"], e["kernels_html"]) if e["kernels"] else "-"]
                   for e in shown])]
    return doc


def grids(rows: list[dict]) -> list[Table]:
    """Environments down, stacks across; turned when there are more stacks than fit across and
    fewer environments than stacks; split into tables of ACROSS columns when both are many."""
    stacks = list(dict.fromkeys(s for e in rows for s in e["stacks"]))
    turned = len(stacks) > ACROSS and len(rows) < len(stacks)
    across = rows if turned else stacks
    tables = []
    for start in range(0, max(len(across), 1), ACROSS):
        part = across[start:start + ACROSS]
        if turned:
            tables.append(Table(["stack"] + [environment_text(e) for e in part],
                                [[s] + [stack_cell(e, s) for e in part] for s in stacks]))
        else:
            tables.append(Table(["environment, run"] + part,
                                [[environment_text(e)] + [stack_cell(e, s) for s in part]
                                 for e in rows]))
    return tables


def environment_text(e: dict) -> list:
    """The row's environment and run: device, versions, the run (linked) with date, git, status,
    and the earlier keys folded under it."""
    device, driver, cuda, torch, triton = environment_columns(e["environment"])
    versions = " · ".join(f"{name} {v}" for name, v in (("driver", driver), ("CUDA", cuda),
                                                         ("torch", torch), ("triton", triton))
                          if v != "-")
    when = (e["date"] or "-")[:16].replace("T", " ")
    text = [f"{device} · {versions} · run ", report_link(e, e["run"]),
            f" ({when}, git {_git(e['git_revision'])}, {e['status'] or '-'})"]
    for old in e.get("folded", []):
        text += [f" · earlier key {old['environment_key']}: run ", report_link(old, old["run"])]
    if e.get("old_key"):
        text.append(" · key from before the CPU instruction set was part of it")
    return text


def stack_cell(e: dict, stack: str) -> Cell:
    """The headline construction of `stack` on `e`'s run, its verdict and its link."""
    s = e["stacks"].get(stack)
    cons = (s or {}).get("constructions") or {}
    arms = [label for label, c in cons.items() if c.get("kind") != "bridge"]
    label = HEADLINE if HEADLINE in cons else (arms[0] if arms else None)
    if label is None:
        return Cell("-", "none")
    c = cons[label]
    # what summary.json stored (any version of it): plain data, read into rates here
    cache = Rate.from_plain(c.get("cache_bit_exact"))
    suffix = Rate.from_plain(c.get("suffix_disagree"))
    verdict = ("diverges" if suffix and suffix.k else
               "cache-differs" if not cache or cache.k < cache.n else "bit-exact")
    word = VERDICT_WORDS[verdict] + ("" if label == HEADLINE else f" ({label})")
    numbers = f": cache {fraction(cache)} bit-exact, suffix ≠ live {interval_text(suffix)}"
    return Cell([report_link(e, word) if e["report"] else word, numbers], verdict)


def stack_label(label: str, e: dict) -> str:
    """`label`, with `@tN` added from the run's repro command when it predates thread counts in
    labels (e.g. `sdpa/bf16` run with `--threads 1` is `sdpa/bf16@t1`)."""
    command = ((e.get("repro") or {}).get(label)) or ""
    threads = re.search(r"--threads (\d+)", command)
    return f"{label}@t{threads[1]}" if threads and "@t" not in label else label


def fold_old_keys(rows: list[dict]) -> list[dict]:
    """Rows with each CPU key from before the capability joined the key folded under the key
    that replaced it (same CPU model and versions, capability added); unreplaced, it stays."""
    def without_capability(environment: dict) -> str:
        cpu = {k: v for k, v in (environment.get("cpu") or {}).items() if k != "capability"}
        return envinfo.environment_key({**environment, "cpu": cpu})

    old = [e for e in rows if not e["environment"].get("gpus")
           and not (e["environment"].get("cpu") or {}).get("capability")]
    out = []
    for e in rows:
        if e in old:
            continue
        before = without_capability(e["environment"]) if e["environment"].get("cpu") else None
        folded = [o for o in old if o["environment_key"] == before and o["environment_key"] !=
                  e["environment_key"]]
        out.append({**e, "folded": folded})
    taken = {o["run"] for e in out for o in e["folded"]}
    out += [{**o, "old_key": bool(o["environment"].get("cpu"))} for o in old
            if o["run"] not in taken]
    return sorted(out, key=lambda e: _natural(e["environment_key"]))


def environment_columns(environment: dict) -> list[str]:
    """GPU (or CPU model and capability), driver, CUDA (runtime), torch, triton of a record."""
    gpus, versions = environment.get("gpus") or [], environment.get("versions") or {}
    if gpus:
        gpu = f"{gpus[0].get('name')}" + (f" x{len(gpus)}" if len(gpus) > 1 else "")
    else:
        cpu = environment.get("cpu") or {}
        name = " ".join(str(p) for p in (cpu.get("model"), cpu.get("capability")) if p)
        gpu = f"CPU {name}" if name else "CPU"
    driver = gpus[0].get("driver_version") if gpus else None
    return [gpu] + [v or "-" for v in (driver, versions.get("cuda_runtime"),
                                        versions.get("torch"), versions.get("triton"))]


def report_link(entry: dict, text: str | None = None):
    """The run's report as a link (report.md; report.html from the HTML page), else plain text."""
    if not entry["report"]:
        return text or f"not written (from {entry.get('ledger', 'a ledger')})"
    return Link(text or "report", entry["report"], entry.get("report_html"))


def _natural(text: str) -> list:
    """Sort key that orders 535.x before 1000.x (numbers compared as numbers)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", text) if p]


def _git(revision: str | None) -> str:
    if not revision:
        return "-"
    return revision[:12] + ("+dirty" if revision.endswith("+dirty") else "")
