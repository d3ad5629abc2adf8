"""An engine check's report: one stored `kvfid engine-check` as Markdown and self-contained HTML.

Like a run report it goes through kvfid.reports.document and is written to
`<reports>/<environment key>/<check id>/report.md` and `report.html` (with the record itself as
`engine-check.json`; no summary.json, so the runs index does not take it for a run). It holds what
ran (engine and version, model, dtype, prompts x tokens, faithful or stock), the logprob table
(one row per pair of the engine's constructions, coloured by verdict), with `--kv` the engine-state
table (first bad layer and position, elements, max |diff|, max ULP, d_rel) and d_rel per layer
(a figure in the HTML, its numbers in a table), the command that measures it again, and the
environment record.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from kvfid.environment.envinfo import describe as describe_environment
from kvfid.outputs import write_files
from kvfid.reports.document import Cell, markdown, number, to_html
from kvfid.reports.figures import svg_lines
from kvfid.records.record import to_json

EXACT, DIFFERS = "bit-exact", "diverges"
LOGPROB_HEAD = ["constructions", "tokens differ", "max |Δ logprob|", "items exact", "note"]
KV_HEAD = ["constructions", "KV exact", "first bad layer", "first position", "elements differ",
           "max |diff|", "max ULP", "d_rel"]


def _dash(x) -> str:
    return "-" if x is None else str(x)


def logprob_rows(record) -> list[list]:
    """One row per pair of constructions: tokens whose fp32 logprob bits differ, and so on."""
    rows = []
    for r in record.rows:
        note = (f"{r.served_tokens} positions served by the prefix cache" if r.served_tokens
                else f"{r.diverged} items' greedy tokens diverge; compared up to there"
                if r.diverged else "")
        verdict = EXACT if r.differ == 0 else DIFFERS
        rows.append([r.construction, Cell(f"{r.differ}/{r.tokens}", verdict), number(r.max_abs),
                     f"{r.items_exact}/{r.items}", note])
    return rows


def kv_rows(record, dequantized: bool = False) -> list[list]:
    """One row per pair of constructions: the engine states compared bitwise (in the stored
    format; `dequantized`: an fp8 cache's states as the values they stand for)."""
    rows = []
    for r in record.rows:
        k = r.kv_dequantized if dequantized else r.kv
        if k is None:
            continue
        rows.append([r.construction, Cell(f"{k.items_exact}/{k.items}",
                                          EXACT if k.exact else "cache-differs"),
                     _dash(k.first_bad_layer), _dash(k.first_position), k.n_diff,
                     number(k.max_abs), k.max_ulp, number(k.d_rel)])
    return rows


def verdict(record) -> str:
    """The one sentence: every row bit-exact, or which rows differ."""
    if record.exact:
        return ("**Bit-exact**: every construction gave the same logprob bits"
                + (" and the same K and V in every layer." if record.kv else "."))
    bad = [r.construction for r in record.rows if not r.exact]
    return f"**Differs** in {len(bad)} of {len(record.rows)} rows: {', '.join(bad)}."


def command(record) -> str:
    """The `kvfid engine-check` command that measures this again."""
    args = ["kvfid", "engine-check", "--engine", record.engine_name, "--model", record.model,
            "--dtype", record.dtype,
            "-n", str(record.prompts), "--item-set", record.item_set, "--tokens",
            str(record.tokens), "--chunk", str(record.chunk)]
    args += ["--kv"] if record.kv else []
    args += ["--faithful"] if record.faithful else []
    args += ["--batch-invariant"] if record.batch_invariant else []
    args += ["--threads", str(record.threads)] if record.threads else []
    args += ["--attention", record.attention] if record.attention else []
    args += ["--tp", str(record.tp)] if record.tp > 1 else []
    args += ["--kv-cache-dtype", record.kv_cache_dtype] if record.kv_cache_dtype != "auto" else []
    return shlex.join(args)


def document(stored, raw_environment: bool = True) -> list:
    """The report as blocks (kvfid.reports.document's tuple form and Cells)."""
    r = stored.record
    doc = [("h1", f"kvfid engine-check {stored.id}: {r.label}"),
           ("p", verdict(r)),
           ("table", ["engine check", stored.id], [
               ["engine", r.engine + (" (faithful: kvfid's attention and batch-invariant mode)"
                                      if r.faithful else " (stock)")],
               ["model", f"{r.model} ({r.folder})" if r.folder else r.model],
               ["dtype", r.dtype],
               ["KV cache stored as", "the model's dtype" if r.kv_cache_dtype == "auto"
                else f"{r.kv_cache_dtype} bytes, a scale per layer"],
               ["requests", f"{r.prompts} prompts of {r.item_set} x {r.tokens} greedy tokens"],
               ["chunked prefill budget", str(r.chunk)],
               ["the engine's batch-invariant switch", "on" if r.batch_invariant else "off"],
               ["written", stored.written], ["wall", f"{r.wall_s:.1f} s"],
               ["environment", stored.environment_key],
               ["git revision", stored.git_revision or "none"]])]
    if r.batch_invariant_note:
        doc.append(("p", f"Note: {r.batch_invariant_note}"))
    doc += [("h2", "Logprobs, bitwise"), ("table", LOGPROB_HEAD, logprob_rows(r)),
            ("p", "Each row takes the same tokens' logprobs by two of the engine's constructions "
                  "and compares their fp32 bits (the engines return fp32 logprobs).")]
    if r.kv:
        fp8 = r.kv_cache_dtype != "auto"
        doc += [("h2", "Engine state (K and V from the engine's paged cache), bitwise"
                 + (f", stored format ({r.kv_cache_dtype} bytes and scales)" if fp8 else "")),
                ("table", KV_HEAD, kv_rows(r))]
        if fp8:
            doc += [("h2", "The same engine states dequantized (fp32(stored) * scale)"),
                    ("table", KV_HEAD, kv_rows(r, dequantized=True))]
        doc += [("p", "Positions compared: those both states hold over identical tokens. d_rel: "
                      "||a-b||_F/||a||_F of the worst item over every layer's K and V; per layer "
                      "below, the worst of K and V.")]
        doc += _per_layer(r)
    return doc + closing(stored, command(r), raw_environment)


def closing(stored, again: str, raw_environment: bool) -> list:
    """The sections an engine report ends with: the command that measures it again, and the
    environment it was measured in (its raw record too, where asked)."""
    doc = [("h2", "Measure it again"), ("pre", again),
           ("h2", "Environment"), ("pre", describe_environment(stored.environment))]
    if raw_environment:
        doc.append(("details", "the environment record (JSON)",
                    ("pre", json.dumps(stored.environment, indent=1))))
    return doc


def _per_layer(record) -> list:
    series = [(r.construction, list(r.kv.d_rel_per_layer)) for r in record.rows if r.kv]
    layers = max((len(ys) for _, ys in series), default=0)
    if not layers:
        return []
    numbers = ("table", ["layer"] + [name for name, _ in series],
               [[i] + [number(ys[i]) if i < len(ys) else "-" for _, ys in series]
                for i in range(layers)])
    if not any(v for _, ys in series for v in ys):
        return [("h3", "d_rel per layer"), ("p", "0 at every layer, in every row: the engine "
                                                 "states are bit-exact layer by layer.")]
    return [("h3", "d_rel per layer"),
            ("figure", svg_lines(series, "layer", "d_rel (log scale)"),
             "The worst item's d_rel per layer (the worse of K and V), one line per row; hollow "
             "marks on the 0 line are bit-exact layers."),
            ("details", "the figure's numbers", numbers)]


def write_report(stored, root: str | Path = "reports") -> dict[str, Path]:
    """Write report.md, report.html and engine-check.json to <root>/<environment key>/<id>/."""
    return write_files_of(stored, document(stored), "engine-check.json", root)


def write_files_of(stored, doc: list, record_name: str, root: str | Path) -> dict[str, Path]:
    """A stored engine record's report (Markdown, HTML) and its record as JSON (`record_name`)
    under <root>/<environment key>/<id>/."""
    folder = Path(root) / stored.environment_key / stored.id
    return write_files({"markdown": (folder / "report.md", markdown(doc)),
                        "html": (folder / "report.html", to_html(doc)),
                        "record": (folder / record_name, to_json(stored.record, indent=1))})
