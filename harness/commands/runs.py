"""Commands over cases, runs and the ledger: `run`, `runs`, `show`, `audit`, `report`, `merge`,
`compare`, `bench`, `bench-report`, `times`, `price`."""

from __future__ import annotations

import json
import time

import click

from kvfid.commands.options import db_option, exit_with, fmt_option, reports_option


@click.command()
@click.argument("case_name", metavar="CASE")
@click.option("--items", "item_count", type=int, help="Only the first N items of the case.")
@db_option
@click.option("--resume", metavar="RUN_ID", help="Continue a stored run of this case: units "
              "already stored are skipped.")
@click.option("--run-id", metavar="RUN_ID", help="Name the run; processes given the same id "
              "(with different --shard) fill one run.")
@click.option("--shard", default="0/1", show_default=True, metavar="I/N",
              help="Run every N-th item, starting at item I.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes on this machine, each taking every N-th item (one-thread CPU "
              "stacks: one per core).")
@click.option("--report", "write_report", is_flag=True, help="Also write the run report.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def run(**options) -> None:
    """Run a case into the ledger; prints the run id and the headline table. CASE: a name in
    cases/ (`smoke` is cases/smoke.toml), a TOML path, or `default` (the GPU case with CUDA, else
    the CPU one).

    Under `torchrun --nproc-per-node N -m kvfid.cli run CASE`, each rank runs its shard of
    the items into one run and rank 0 closes it and prints the headline."""
    from kvfid.tasks.launch import launch

    launched = launch(**options)
    for line in launched.lines:
        click.echo(line)
    for name, file in launched.files.items():
        click.echo(f"{name}: {file}", err=True)


@click.command()
@db_option
@fmt_option
def runs(db, fmt) -> None:
    """List the runs in the ledger (a run whose processes died shows as `died`)."""
    from kvfid.tasks.ledger_views import list_runs, runs_text

    rows = list_runs(db)
    click.echo(json.dumps(rows, indent=1) if fmt == "json" else runs_text(rows))


@click.command()
@click.argument("run_id", metavar="RUN")
@db_option
@fmt_option
def show(run_id, db, fmt) -> None:
    """Print a run's aggregates (RUN: an id, a unique prefix, or `latest`)."""
    from kvfid.tasks.ledger_views import show_run

    click.echo(show_run(db, run_id, fmt))


@click.command()
@click.argument("run_id", metavar="RUN")
@db_option
@click.option("--items", "item_count", type=int, help="Audit only the first N items.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def audit(run_id, db, item_count, quiet) -> None:
    """Check a stored run against its plan and its record checksums, then re-run it and check
    every fingerprint; exit 1 when anything is missing, changed or does not reproduce."""
    from kvfid.runs.audit import audit_run
    from kvfid.tasks.ledger_views import db_path

    result = audit_run(db_path(db), run_id, items=item_count, progress=not quiet)
    click.echo(result.text())
    exit_with(result.passed)


@click.command(name="report")
@click.argument("run_id", metavar="RUN")
@db_option
@click.option("--out", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Reports folder; files go to OUT/<environment key>/<run id>/.")
def report_command(run_id, db, out) -> None:
    """Write a run's report: report.md, report.html (self-contained) and summary.json."""
    from kvfid.tasks.ledger_views import report_run

    for name, path in report_run(db, run_id, out).items():
        click.echo(f"{name}: {path}")


@click.command()
@click.argument("run_ids", metavar="RUN RUN...", nargs=-1, required=True)
@db_option
@click.option("--into", metavar="RUN_ID", help="Id of the merged run (default: a new id).")
def merge(run_ids, db, into) -> None:
    """Merge runs of one case (e.g. shards) into a new run; exit 1 if a unit stored twice has
    different fingerprints."""
    from kvfid.tasks.ledger_views import merge_runs

    merged, copied, conflicts = merge_runs(db, list(run_ids), into)
    click.echo(f"run {merged.id} {merged.status}: {copied} units from {len(run_ids)} runs")
    for source, index, stack in conflicts:
        click.echo(f"conflict: item #{index} stack {stack} differs in run {source} "
                   f"(kept the first run's)", err=True)
    exit_with(not conflicts)


def _path_option(name: str, help: str):
    return click.option(name, type=click.Path(exists=True, dir_okay=False), help=help)


@click.command(name="compare")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@db_option
@click.option("--db-a", type=click.Path(), help="A's ledger (default: --db).")
@click.option("--db-b", type=click.Path(), help="B's ledger (default: --db).")
@_path_option("--kernels-a", "A's kernel invariance result (JSON of `kvfid kernels --format json`).")
@_path_option("--kernels-b", "B's kernel invariance result.")
@_path_option("--bench-a", "A's kernel benchmarks (pytest-benchmark JSON).")
@_path_option("--bench-b", "B's kernel benchmarks.")
@click.option("--reports", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Where `kvfid bench` filed kernels.json and bench/*.json per environment key "
                   "(used for a side whose --kernels/--bench is not given).")
@click.option("--threshold", type=click.FloatRange(min=0), default=0.10, show_default=True,
              help="A kernel whose median is slower than A's by more than this fraction regresses.")
@click.option("--allow-different", is_flag=True, help="Compare runs that differ in case, model, "
              "B/S, items or thread count (refused by default, exit 2).")
@click.option("--out", type=click.Path(file_okay=False),
              help="Also write comparison.md, comparison.html and comparison.json here.")
@fmt_option
def compare_command(fmt, **options) -> None:
    """What changed from A to B. A and B: run ids (unique prefixes, `latest`) or environment keys
    (the latest finished run there, of the other side's case when it has one). Exit 1 when B
    regressed against A."""
    from kvfid.compare.runs import render_markdown
    from kvfid.compare.runs import compare_command as run_compare

    result, files = run_compare(**options)
    for name, path in files.items():
        click.echo(f"{name}: {path}", err=True)
    click.echo(json.dumps(result, indent=1) if fmt == "json" else render_markdown(result))
    exit_with(not result["regressed"])


@click.command()
@reports_option
@click.option("--db", help="Ledger path (default: REPORTS/ledger.sqlite).")
@click.option("--case", "case_path", default="default", show_default=True,
              help="The fidelity case (default: the GPU case with CUDA, else smollm2-cpu).")
@click.option("--items", type=int, help="Only the first N items of the case.")
@click.option("--quick", is_flag=True, help="Quick kernel comparison and no speed benches.")
@click.option("--jobs", type=click.IntRange(min=1), help="Processes for the kernel table and "
              "the fidelity case (default: on a CPU one per core, else 1).")
def bench(reports, db, case_path, items, quick, jobs) -> None:
    """Everything `make bench` does: environment, kernel table, speed benches, the default
    fidelity case, its report and reports/index.md; exit 1 if a claimed invariance fails."""
    from kvfid.tasks.bench import run_bench

    start = time.perf_counter()
    outcome = run_bench(reports, db, case_path, kernels_quick=quick, speed=not quick,
                        items=items, jobs=jobs)
    for name, path in outcome.files.items():
        click.echo(f"{name}: {path}", err=True)
    click.echo(outcome.text(time.perf_counter() - start))
    exit_with(outcome.invariance_ok)


@click.command(name="bench-report")
@click.argument("bench_json", type=click.Path(exists=True, dir_okay=False))
@reports_option
@click.option("--threshold", type=float, default=0.10, show_default=True,
              help="A median slower by more than this fraction is a regression.")
def bench_report(bench_json, reports, threshold) -> None:
    """File a pytest-benchmark JSON under reports/<environment key>/bench/ and compare its
    medians with the previous result of the same key; exit 1 on a regression."""
    from kvfid.reports import benchreport

    saved, comparison = benchreport.file_bench(bench_json, reports, threshold)
    click.echo(f"bench: {saved}", err=True)
    click.echo(benchreport.render_bench(comparison))
    exit_with(comparison["ok"])


@click.command()
@reports_option
@click.option("--db", "dbs", multiple=True, help="Also a ledger's runs (repeatable).")
@click.option("--write", "write_to", type=click.Path(exists=True, dir_okay=False),
              help="Rewrite the generated section of this document (docs/environment.md) instead "
              "of printing.")
@click.option("--format", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True,
              help="md: the Markdown table; json: the rows.")
def times(reports, dbs, write_to, fmt) -> None:
    """The timings table: every stored run, kernel table and speed bench under REPORTS (and in
    each --db ledger), each row with the file it comes from."""
    from kvfid.reports.times import times as times_table

    text, written = times_table(reports, dbs, fmt, write_to)
    if written:
        click.echo(f"times: {written}", err=True)
    else:
        click.echo(text, nl=False)


def _counts(_ctx, param, text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (empty: none)."""
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: comma-separated positive integers", param=param) from None
    if any(v < 1 for v in values):
        raise click.BadParameter(f"{text!r}: comma-separated positive integers", param=param)
    return values


@click.command()
@click.option("--models", default="smollm2-135m,qwen2.5-0.5b-shape,llama-3.2-1b-shape",
              show_default=True, help="Comma-separated presets (see `kvfid models`), in order.")
@click.option("--prefill", default="64,512,2048", show_default=True, callback=_counts,
              help="Prefill lengths (empty: none).")
@click.option("--sequences", default="1,8,32", show_default=True, callback=_counts,
              help="Decode steps of this many sequences, each over --context keys.")
@click.option("--context", type=click.IntRange(min=1), default=512, show_default=True,
              help="The keys each sequence of a --sequences decode step reads.")
@click.option("--keys", default="64,512,2048", show_default=True, callback=_counts,
              help="Decode steps of one sequence over this many keys.")
@click.option("--stock", default="sdpa/bf16", show_default=True, help="The stock stack.")
@click.option("--faithful", default="native/bf16+bi", show_default=True,
              help="The faithful stack.")
@click.option("--tp-products/--no-tp-products", default=True, show_default=True,
              help="Also time a +bi faithful stack at @tp1 (its TP-invariant products).")
@click.option("--floor-route", metavar="[widen:][whole:]F", default=None,
              help="The floor's route: F rows a product call (whole: one call, padded to F "
                   "below F), widened to fp32 or not (default: "
                   "this machine's route for the dtype, as the faithful stack takes it).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch threads of every arm.")
@click.option("--budget", "budget_s", type=click.FloatRange(min=0, min_open=True), default=1800.0,
              show_default=True, help="Seconds for the whole table: a row whose estimate passes "
                                      "what is left is shown skipped with it.")
@click.option("--engine/--no-engine", default=True, show_default=True,
              help="The faithful vLLM engine's rows (engine-bench in --vllm-venv).")
@click.option("--engine-model", default="smollm2-135m", show_default=True,
              help="The engine rows' model (smollm2-135m or hf:<folder>).")
@click.option("--vllm-venv", default=".venv-vllm", show_default=True,
              type=click.Path(file_okay=False), help="The venv holding vLLM (`make install-vllm`).")
@reports_option
@fmt_option
def price(models, reports, fmt, budget_s, **options) -> None:
    """The faithful stacks' price: faithful over stock time per model, prefill length and decode
    shape, each row from one interleaved run, with the TP-invariant products' share, the floor
    beside each decode row and the faithful vLLM engine's rows; written under
    REPORTS/<environment key>/price/ as each row finishes."""
    from kvfid.records.price import to_json
    from kvfid.reports.price_table import render_markdown
    from kvfid.tasks.price import PricePlan, price as price_table

    plan = PricePlan(models=tuple(m.strip() for m in models.split(",") if m.strip()),
                     budget_s=budget_s, **options)
    table, path = price_table(plan, reports, progress=lambda s: click.echo(s, err=True))
    if path:
        click.echo(f"price: {path}", err=True)
    click.echo(to_json(table) if fmt == "json" else render_markdown(table), nl=fmt == "json")


COMMANDS = [run, runs, show, audit, report_command, merge, compare_command, bench, bench_report,
            times, price]
