"""`kvfid`: the command line. Thin: parses, calls the library, prints.

Machine-readable output goes to stdout (`--format json`); logs and progress to stderr.
Exit codes: 0 ok, 1 a fidelity or regression verdict failed, 2 usage error, 3 environment
unavailable.
"""

from __future__ import annotations

import json
import sys
import time

import click

from harness import render
from harness.backends import DTYPES, Stack, backend_names
from harness.models import PRESETS, ModelUnavailable, load_model, model_names
from harness.protocol import CONSTRUCTION_HELP, ItemPlan, ProtocolError, parse_transplant

EXIT_VERDICT, EXIT_ENVIRONMENT = 1, 3   # usage errors exit 2 through click


def _usage(message: str):
    raise click.UsageError(message)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """kvfid: is a rebuilt KV state the live state? Per kernel, precision and stack."""


@main.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def models(fmt: str) -> None:
    """List the model presets, their sizes, and whether they can be loaded here."""
    rows = [{"name": p.name, "params": p.params, "available": p.available(),
             "description": p.description} for p in PRESETS.values()]
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        mark = "yes" if row["available"] else "no "
        click.echo(f"{row['name']:<20} {row['params']:>6}  available: {mark}  "
                   f"{row['description']}")
    click.echo(f"{'hf:<folder>':<20} {'':>6}  any local Hugging Face model folder")


@main.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def env(fmt: str) -> None:
    """Print the environment record (GPUs through NVML, versions, CPU, git) and its key."""
    from harness import envinfo

    record = envinfo.collect()
    if fmt == "json":
        click.echo(json.dumps({**record, "key": envinfo.environment_key(record)}, indent=1))
    else:
        click.echo(envinfo.describe(record))


@main.command()
@click.option("--dtypes", default="bf16,fp32", show_default=True,
              help=f"Comma-separated: {', '.join(DTYPES)}.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--quick", is_flag=True, help="Small shapes and a few batch sizes (seconds).")
@click.option("--threads", type=int, default=1, show_default=True,
              help="torch threads (stock CPU results depend on it).")
@click.option("--out", type=click.Path(file_okay=False),
              help="Also write kernels.json and kernels.md into OUT/<environment key>/.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def kernels(dtypes, device, quick, threads, out, fmt) -> None:
    """Bitwise batch-invariance and prefill-vs-decode verdicts for every op and implementation;
    exit 1 if an implementation that claims invariance is not invariant."""
    import torch

    from harness import invariance

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        result = invariance.compare_kernels(tuple(d for d in dtypes.split(",") if d), device,
                                            quick, threads=threads,
                                            progress=lambda m: click.echo(m, err=True))
    except ValueError as err:
        _usage(str(err))
    except EnvironmentError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(EXIT_ENVIRONMENT)
    if out:
        click.echo(f"kernels: {invariance.write_result(result, out)}", err=True)
    click.echo(json.dumps(result, indent=1) if fmt == "json" else invariance.render_table(result))
    sys.exit(0 if result["ok"] else EXIT_VERDICT)


@main.command(name="compile")
@click.option("--arch", "archs", default="sm_80,sm_90,sm_100", show_default=True,
              help="Comma-separated GPU archs.")
@click.option("--dtypes", default="bf16,fp16,fp32", show_default=True, help="Comma-separated.")
@click.option("--kernels", "kernel_names", help="Comma-separated (default: all): attention, "
              "matmul, mean, rms_norm, softmax, log_softmax.")
@click.option("--quick", is_flag=True, help="Attention at the GPU default case's shape only.")
@click.option("--jobs", type=click.IntRange(min=1), help="Compiler processes (default: CPUs).")
@click.option("--out", type=click.Path(file_okay=False), help="Keep each config's cubin here.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def compile_command(archs, dtypes, kernel_names, quick, jobs, out, fmt) -> None:
    """Compile every Triton kernel config for GPU archs on this machine (no GPU needed) and
    inspect the cubins; exit 1 on a compile failure, spill, shared memory over the limit, atomic,
    or a bf16/fp16 product without tensor cores."""
    from harness.compile import compile_targets, render_table
    from harness.compile_plan import plan

    def split(text):
        return tuple(x for x in text.split(",") if x) if text else None

    try:
        targets = plan(split(archs), split(dtypes), split(kernel_names), quick)
    except ValueError as err:
        _usage(str(err))
    report = compile_targets(targets, out, jobs)
    click.echo(json.dumps(report, indent=1) if fmt == "json" else render_table(report))
    sys.exit(0 if report["ok"] else EXIT_VERDICT)


@main.command()
@click.option("--reports", default="reports", show_default=True, type=click.Path(file_okay=False))
@click.option("--db", help="Ledger path (default: REPORTS/ledger.sqlite).")
@click.option("--case", "case_path", default="default", show_default=True,
              help="The fidelity case (default: the GPU case with CUDA, else smollm2-cpu).")
@click.option("--items", type=int, help="Only the first N items of the case.")
@click.option("--quick", is_flag=True, help="Quick kernel comparison and no speed benches.")
def bench(reports, db, case_path, items, quick) -> None:
    """Everything `make bench` does: environment, kernel table, speed benches, the default
    fidelity case, its report and reports/index.md; exit 1 if a claimed invariance fails."""
    from harness.bench import run_bench

    start = time.perf_counter()
    outcome = run_bench(reports, db, case_path, kernels_quick=quick, speed=not quick,
                        items=items)
    for name, path in outcome.files.items():
        click.echo(f"{name}: {path}", err=True)
    click.echo("\n".join(outcome.lines))
    steps = ", ".join(f"{k} {v:.0f} s" for k, v in outcome.seconds.items())
    click.echo(f"bench took {time.perf_counter() - start:.0f} s ({steps})")
    sys.exit(0 if outcome.invariance_ok else EXIT_VERDICT)


@main.command(name="bench-report")
@click.argument("bench_json", type=click.Path(exists=True, dir_okay=False))
@click.option("--reports", default="reports", show_default=True, type=click.Path(file_okay=False))
@click.option("--threshold", type=float, default=0.10, show_default=True,
              help="A median slower by more than this fraction is a regression.")
def bench_report(bench_json, reports, threshold) -> None:
    """File a pytest-benchmark JSON under reports/<environment key>/bench/ and compare its
    medians with the previous result of the same key; exit 1 on a regression."""
    from harness import benchreport

    saved = benchreport.save_bench(bench_json, reports)
    previous = benchreport.latest_previous(saved.parent, exclude=saved)
    comparison = benchreport.compare_bench(saved, previous, threshold)
    click.echo(f"bench: {saved}", err=True)
    click.echo(benchreport.render_bench(comparison))
    sys.exit(0 if comparison["ok"] else EXIT_VERDICT)


@main.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help=f"A preset ({', '.join(model_names())}).")
@click.option("--prompt", help="The prompt text (a one-turn chat).")
@click.option("--item-set", help="Take the prompt from an item set: arith | jsonl:<path>.")
@click.option("--item", "item_index", type=int, help="Index of the item in --item-set.")
@click.option("--backend", default="sdpa", show_default=True,
              help=f"Attention backend: {', '.join(backend_names())}.")
@click.option("--dtype", default="bf16", show_default=True,
              help=f"Precision: {', '.join(DTYPES)}.")
@click.option("--batch-invariant", is_flag=True, help="Swap in batch-invariant matmul/norm/softmax.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", type=int, help="torch thread count (default: torch's).")
@click.option("-B", "boundary", type=int, default=32, show_default=True,
              help="Live-generated tokens in the boundary prefix.")
@click.option("-S", "suffix", type=int, default=48, show_default=True,
              help="Greedy suffix tokens decoded from each boundary state.")
@click.option("--arms", default="live,prefill,incremental", show_default=True,
              help=f"Comma-separated constructions: {CONSTRUCTION_HELP}.")
@click.option("--replicas", default="", help="Comma-separated arms to run twice (replica floor).")
@click.option("--transplant", "transplants", multiple=True,
              help="RECIPIENT<-DONOR[:SELECTION], e.g. live<-prefill:keys (repeatable).")
@click.option("--cross", help="Also run the fixed-prefix precision crossing over these dtypes "
                              "(comma-separated), P frozen from this stack's live run.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def repro(model_name, prompt, item_set, item_index, backend, dtype, batch_invariant, device,
          threads, boundary, suffix, arms, replicas, transplants, cross, fmt) -> None:
    """Reproduce one item on one stack: every arm against live, cache and suffix verdicts."""
    from harness import items as item_sets
    from harness.protocol import run_crossing, run_item

    try:
        stack = Stack(backend, dtype, batch_invariant, device, threads)
        plan = ItemPlan(boundary, suffix, tuple(a for a in arms.split(",") if a),
                        tuple(r for r in replicas.split(",") if r),
                        tuple(parse_transplant(t) for t in transplants))
        cross_stacks = [stack.with_dtype(d) for d in cross.split(",")] if cross else []
        item = _pick_item(item_sets, prompt, item_set, item_index)
    except (ValueError, ProtocolError) as err:
        _usage(str(err))
    if model_name not in PRESETS and not model_name.startswith("hf:"):
        _usage(f"unknown model {model_name!r}; valid: {', '.join(model_names())}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            click.echo(f"error: --device {device} but no CUDA device is available", err=True)
            sys.exit(EXIT_ENVIRONMENT)
    try:
        model = load_model(model_name)
    except ModelUnavailable as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(EXIT_ENVIRONMENT)
    try:
        plan.check_fits(len(model.codec.prompt_ids(item.prompt)), model.context_length)
    except ProtocolError as err:
        _usage(str(err))
    record = run_item(model, stack, item, plan, matcher=item_sets.match_answer)
    if cross_stacks:
        record["crossing"] = run_crossing(model, item, stack, cross_stacks, boundary, suffix)
    if fmt == "json":
        click.echo(json.dumps(record, indent=1))
    else:
        click.echo(render.item_text(record, model.codec))


def _pick_item(item_sets, prompt, item_set, item_index):
    if (prompt is None) == (item_set is None):
        raise ValueError("give exactly one of --prompt or --item-set/--item")
    if prompt is not None:
        return item_sets.Item(id="prompt", prompt=prompt, answer=None)
    if item_index is None or item_index < 0:
        raise ValueError("--item-set needs --item N (N >= 0)")
    chosen = item_sets.load_item_set(item_set, item_index + 1)
    if item_index >= len(chosen):
        raise ValueError(f"{item_set} has {len(chosen)} items; --item {item_index} is out of range")
    return chosen[item_index]


# --------------------------------------------------------------------------- matrix runs

def _db_option(command):
    option = click.option("--db", type=click.Path(dir_okay=False), default=None,
                          help="Ledger file (default: $KVFID_DB, else reports/ledger.sqlite).")
    return option(command)


def _db_path(db):
    from pathlib import Path

    from harness.ledger import default_db_path

    return Path(db) if db else default_db_path()


def _ledger(db):
    from harness.ledger import Ledger

    path = _db_path(db)
    if not path.is_file():
        _usage(f"no ledger at {path} (run `kvfid run CASE` first, or give --db)")
    return Ledger(path)


def _run_of(ledger, run_id: str):
    from harness.ledger import LedgerError

    try:
        return ledger.run(run_id)
    except LedgerError as err:
        _usage(str(err))


@main.command()
@click.argument("case_path", metavar="CASE")
@click.option("--items", "item_count", type=int, help="Only the first N items of the case.")
@_db_option
@click.option("--resume", "resume", metavar="RUN_ID", help="Continue a stored run of this case: "
              "units already stored are skipped.")
@click.option("--run-id", metavar="RUN_ID", help="Name the run; processes given the same id "
              "(with different --shard) fill one run.")
@click.option("--shard", default="0/1", show_default=True, metavar="I/N",
              help="Run every N-th item, starting at item I.")
@click.option("--report", "write_report", is_flag=True, help="Also write the run report.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def run(case_path, item_count, db, resume, run_id, shard, write_report, quiet) -> None:
    """Run a case (a TOML file, or `default`: the GPU case with CUDA, else the CPU one) into the
    ledger; prints the run id and the headline table.

    Under `torchrun --nproc-per-node N -m harness.cli run CASE`, each rank runs its shard of
    the items into one run and rank 0 closes it and prints the headline."""
    from harness import distributed, matrix, report
    from harness.case import CaseError, load_case
    from harness.ledger import LedgerError

    try:
        case = load_case(matrix.default_case_path() if case_path == "default" else case_path)
        if item_count is not None:
            case.with_item_count(item_count)        # refuse a bad count before anything runs
        shard_spec = matrix.parse_shard(shard)
    except (CaseError, ValueError) as err:
        _usage(str(err))
    path = _db_path(db)
    ranked = distributed.torchrun_rank()
    if ranked and (resume or shard != "0/1"):
        _usage("under torchrun each rank takes its shard itself; drop --shard/--resume")
    try:
        if ranked:
            result = distributed.run_ranked(case, path, ranked, items=item_count, run_id=run_id,
                                            progress=not quiet)
            if ranked.rank != 0:
                return
        else:
            result = matrix.run_case(case, path, items=item_count, run_id=run_id,
                                     resume=resume, shard=shard_spec, progress=not quiet)
    except (CaseError, LedgerError, ProtocolError) as err:
        _usage(str(err))
    except matrix.EnvironmentUnavailable as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(EXIT_ENVIRONMENT)
    except matrix.RunInterrupted as stop:
        click.echo(f"interrupted: what was measured is stored; `kvfid run {case_path} --resume "
                   f"{stop.run_id}` continues run {stop.run_id}", err=True)
        sys.exit(130)
    with _ledger(path) as ledger:
        stored = ledger.run(result.run_id)
        summary = report.aggregate(ledger.units(stored.id), stored.design)
        click.echo(f"run {result.run_id} {result.status}: {result.measured} units measured, "
                   f"{result.skipped} already stored")
        click.echo(report.headline(summary))
        if write_report:
            for name, file in report.write_report(ledger, stored.id).items():
                click.echo(f"{name}: {file}", err=True)
            from harness.index import update_index

            click.echo(f"index: {update_index()}", err=True)


@main.command()
@_db_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def runs(db, fmt) -> None:
    """List the runs in the ledger."""
    with _ledger(db) as ledger:
        rows = [{"id": r.id, "case": r.case_name, "status": r.status, "units": n,
                 "planned": r.design["units"], "environment": r.environment_key,
                 "git": r.git_revision, "started": r.started, "finished": r.finished}
                for r, n in ledger.runs()]
    if fmt == "json":
        click.echo(json.dumps(rows, indent=1))
        return
    from harness.report import text_table

    click.echo(text_table(["run", "case", "status", "units", "started", "environment"],
                          [[r["id"], r["case"], r["status"], f"{r['units']}/{r['planned']}",
                            r["started"], r["environment"]] for r in rows]))


@main.command()
@click.argument("run_id", metavar="RUN")
@_db_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def show(run_id, db, fmt) -> None:
    """Print a run's aggregates (RUN: an id, a unique prefix, or `latest`)."""
    from harness import report
    from harness.case import stored_case

    with _ledger(db) as ledger:
        stored = _run_of(ledger, run_id)
        units = ledger.units(stored.id)
        summary = report.aggregate(units, stored.design)
        if fmt == "json":
            click.echo(json.dumps(summary, indent=1))
            return
        doc = report.document(stored, stored_case(stored), summary, units, raw_environment=False)
        click.echo(report.markdown(doc))


@main.command()
@click.argument("run_id", metavar="RUN")
@_db_option
@click.option("--items", "item_count", type=int, help="Audit only the first N items.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def audit(run_id, db, item_count, quiet) -> None:
    """Re-run a stored run and check every fingerprint; exit 1 when any changed."""
    from harness import matrix

    with _ledger(db) as ledger:
        stored = _run_of(ledger, run_id)
    try:
        result = matrix.audit_run(ledger.path, stored.id, items=item_count, progress=not quiet)
    except matrix.EnvironmentUnavailable as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(EXIT_ENVIRONMENT)
    click.echo(result.text())
    sys.exit(0 if result.passed else EXIT_VERDICT)


@main.command(name="report")
@click.argument("run_id", metavar="RUN")
@_db_option
@click.option("--out", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Reports folder; files go to OUT/<environment key>/<run id>/.")
def report_command(run_id, db, out) -> None:
    """Write a run's report: report.md, report.html (self-contained) and summary.json."""
    from harness import report

    with _ledger(db) as ledger:
        stored = _run_of(ledger, run_id)
        for name, path in report.write_report(ledger, stored.id, out).items():
            click.echo(f"{name}: {path}")
        from harness.index import update_index

        click.echo(f"index: {update_index(out)}")


@main.command()
@click.argument("run_ids", metavar="RUN RUN...", nargs=-1, required=True)
@_db_option
@click.option("--into", metavar="RUN_ID", help="Id of the merged run (default: a new id).")
def merge(run_ids, db, into) -> None:
    """Merge runs of one case (e.g. shards) into a new run; exit 1 if a unit stored twice has
    different fingerprints."""
    from harness.ledger import LedgerError

    with _ledger(db) as ledger:
        try:
            merged, copied, conflicts = ledger.merge(list(run_ids), into)
        except LedgerError as err:
            _usage(str(err))
    click.echo(f"run {merged.id} {merged.status}: {copied} units from {len(run_ids)} runs")
    for source, index, stack in conflicts:
        click.echo(f"conflict: item #{index} stack {stack} differs in run {source} "
                   f"(kept the first run's)", err=True)
    sys.exit(EXIT_VERDICT if conflicts else 0)


@main.command(name="compare")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@_db_option
@click.option("--db-a", type=click.Path(dir_okay=False), help="A's ledger (default: --db).")
@click.option("--db-b", type=click.Path(dir_okay=False), help="B's ledger (default: --db).")
@click.option("--kernels-a", type=click.Path(exists=True, dir_okay=False),
              help="A's kernel invariance result (JSON of `kvfid kernels --format json`).")
@click.option("--kernels-b", type=click.Path(exists=True, dir_okay=False),
              help="B's kernel invariance result.")
@click.option("--bench-a", type=click.Path(exists=True, dir_okay=False),
              help="A's kernel benchmarks (pytest-benchmark JSON).")
@click.option("--bench-b", type=click.Path(exists=True, dir_okay=False),
              help="B's kernel benchmarks.")
@click.option("--reports", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Where `kvfid bench` filed kernels.json and bench/*.json per environment key "
                   "(used for a side whose --kernels/--bench is not given).")
@click.option("--threshold", type=click.FloatRange(min=0), default=0.10, show_default=True,
              help="A kernel whose median is slower than A's by more than this fraction regresses.")
@click.option("--out", type=click.Path(file_okay=False),
              help="Also write comparison.md, comparison.html and comparison.json here.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def compare_command(a, b, db, db_a, db_b, kernels_a, kernels_b, bench_a, bench_b, reports,
                    threshold, out, fmt) -> None:
    """What changed from A to B. A and B: run ids (unique prefixes, `latest`) or environment keys
    (the latest finished run there, of the other side's case when it has one). Exit 1 when B
    regressed against A."""
    from harness import compare as comparison
    from harness.ledger import LedgerError

    try:
        result = comparison.compare((_db_path(db_a or db), _db_path(db_b or db)), a, b,
                                    kernels_a=kernels_a, kernels_b=kernels_b, bench_a=bench_a,
                                    bench_b=bench_b, threshold=threshold, reports=reports)
    except (LedgerError, ValueError) as err:
        _usage(str(err))
    if out:
        for name, path in comparison.write_comparison(result, out).items():
            click.echo(f"{name}: {path}", err=True)
    click.echo(json.dumps(result, indent=1) if fmt == "json"
               else comparison.render_markdown(result))
    sys.exit(EXIT_VERDICT if result["regressed"] else 0)


if __name__ == "__main__":
    main()
