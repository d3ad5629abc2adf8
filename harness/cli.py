"""`kvfid`: the command line. Thin: parses, calls the library, prints.

Machine-readable output goes to stdout (`--format json`); logs and progress to stderr.
Exit codes, mapped here in one place from harness.errors: 0 ok, 1 a fidelity or regression verdict
failed, 2 usage error or bad input, 3 environment unavailable (70: a bug). Every error is one line
on stderr; KVFID_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time

import click

from harness.reports import render
from harness.protocol.backends import DTYPES, backend_names
from harness.errors import EXIT_INTERNAL, EXIT_VERDICT, BadInput, KvfidError, Unavailable
from harness.protocol.models import model_names
from harness.protocol.protocol import CONSTRUCTION_HELP


class _Kvfid(click.Group):
    """The `kvfid` group: every KvfidError becomes one line and its exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KvfidError as err:
            if os.environ.get("KVFID_DEBUG") == "1":
                raise
            click.echo(f"error: {err}", err=True)
            ctx.exit(err.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as err:    # a bug: still one line, unless KVFID_DEBUG=1
            if os.environ.get("KVFID_DEBUG") == "1":
                raise
            text = " ".join(f"{type(err).__name__}: {err}".split())
            click.echo(f"internal error (a bug in kvfid): {text}; KVFID_DEBUG=1 shows the "
                       "traceback", err=True)
            ctx.exit(EXIT_INTERNAL)


@click.group(cls=_Kvfid, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """kvfid: is a rebuilt KV state the live state? Per kernel, precision and stack."""


@main.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def models(fmt: str) -> None:
    """List the model presets, their sizes, and whether they can be loaded here."""
    from harness.protocol.models import describe_presets

    click.echo(describe_presets(fmt))


@main.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def env(fmt: str) -> None:
    """Print the environment record (GPUs through NVML, versions, CPU, git) and its key."""
    from harness.environment import envinfo

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
    from harness.runs import checks
    from harness.environment import invariance

    device = checks.device_and_threads(device, threads)
    try:
        result = invariance.compare_kernels(tuple(d for d in dtypes.split(",") if d), device,
                                            quick, threads=threads,
                                            progress=lambda m: click.echo(m, err=True))
    except ValueError as err:
        raise BadInput(str(err)) from None
    except EnvironmentError as err:
        raise Unavailable(str(err)) from None
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
    from harness.environment.compile import compile_targets, render_table
    from harness.environment.compile_plan import plan

    def split(text):
        return tuple(x for x in text.split(",") if x) if text else None

    try:
        targets = plan(split(archs), split(dtypes), split(kernel_names), quick)
    except ValueError as err:
        raise BadInput(str(err)) from None
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
    from harness.runs.bench import run_bench

    start = time.perf_counter()
    outcome = run_bench(reports, db, case_path, kernels_quick=quick, speed=not quick,
                        items=items)
    for name, path in outcome.files.items():
        click.echo(f"{name}: {path}", err=True)
    click.echo(outcome.text(time.perf_counter() - start))
    sys.exit(0 if outcome.invariance_ok else EXIT_VERDICT)


@main.command(name="bench-report")
@click.argument("bench_json", type=click.Path(exists=True, dir_okay=False))
@click.option("--reports", default="reports", show_default=True, type=click.Path(file_okay=False))
@click.option("--threshold", type=float, default=0.10, show_default=True,
              help="A median slower by more than this fraction is a regression.")
def bench_report(bench_json, reports, threshold) -> None:
    """File a pytest-benchmark JSON under reports/<environment key>/bench/ and compare its
    medians with the previous result of the same key; exit 1 on a regression."""
    from harness.reports import benchreport

    saved, comparison = benchreport.file_bench(bench_json, reports, threshold)
    click.echo(f"bench: {saved}", err=True)
    click.echo(benchreport.render_bench(comparison))
    sys.exit(0 if comparison["ok"] else EXIT_VERDICT)


def _options(*options):
    """One decorator for a group of click options shared by several commands."""
    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


# --model, --prompt, --item-set, --item: one model and one item.
_item_options = _options(
    click.option("--model", "model_name", default="smollm2-135m", show_default=True,
                 help=f"One of {', '.join(model_names())}."),
    click.option("--prompt", help="The prompt text (a one-turn chat)."),
    click.option("--item-set", help="Take the prompt from an item set: arith | jsonl:<path>."),
    click.option("--item", "item_index", type=int, help="Index of the item in --item-set."))

# --backend, --dtype, --batch-invariant, --device, --threads: the options of one stack.
_stack_options = _options(
    click.option("--backend", default="sdpa", show_default=True,
                 help=f"Attention backend: {', '.join(backend_names())}, module:function, or an "
                      "implementation transformers registered."),
    click.option("--dtype", default="bf16", show_default=True, help=f"Precision: {', '.join(DTYPES)}."),
    click.option("--batch-invariant", is_flag=True, help="Swap in batch-invariant matmul/norm/softmax."),
    click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N."),
    click.option("--threads", type=int, help="torch thread count (default: torch's); part of the stack."))


@main.command()
@_item_options
@_stack_options
@click.option("-B", "boundary", type=int, default=32, show_default=True,
              help="Live-generated tokens in the boundary prefix.")
@click.option("-S", "suffix", type=int, default=48, show_default=True,
              help="Greedy suffix tokens decoded from each boundary state.")
@click.option("--arms", default="live,prefill,incremental", show_default=True,
              help=f"Comma-separated constructions: {CONSTRUCTION_HELP}.")
@click.option("--replicas", default="", help="Comma-separated arms to run twice (replica floor).")
@click.option("--transplant", "transplants", multiple=True,
              help="RECIPIENT<-DONOR[:SELECTION], e.g. live<-prefill:keys (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Generate all B and S tokens even past an end-of-turn "
                                                  "token (tiny random models end early otherwise).")
@click.option("--cross", help="Also run the fixed-prefix precision crossing over these dtypes "
                              "(comma-separated), P frozen from this stack's live run.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def repro(fmt, **options) -> None:
    """Reproduce one item on one stack: every arm against live, cache and suffix verdicts."""
    from harness.runs import repro as one_item

    checked = one_item.prepare(**options)
    record = one_item.measure(checked)
    if fmt == "json":
        click.echo(json.dumps(record, indent=1))
    else:
        click.echo(render.item_text(record, checked.model.codec))


@main.command()
@_item_options
@_stack_options
@click.option("-B", "boundary", type=click.IntRange(1, 100000), default=8, show_default=True,
              help="Live tokens generated after the prompt: P is the prompt plus these.")
@click.option("--against", default="prefill", show_default=True,
              help="The construction traced against incremental decoding: prefill or chunked:N.")
@click.option("--position", type=int, help="The position of P to blame (default: the first whose "
                                            "cache differs between the two constructions).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              help="text for people, json for programs.")
def blame(fmt, **options) -> None:
    """Name the op that first gives a position of P other bits in incremental decoding than in a
    prefill (or a chunk): a culprit has bit-equal inputs on both sides and a differing output."""
    from harness.protocol import blame as blame_lib

    outcome = blame_lib.blame_command(**options)
    click.echo(json.dumps(outcome.to_json(), indent=1) if fmt == "json" else outcome.text())


@main.command()
@click.argument("trajectories", type=click.Path(dir_okay=False))
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="A preset (see `kvfid models`) or hf:<folder>; the one the trajectories are for.")
@_stack_options
@click.option("--constructions", default="prefill", show_default=True,
              help="Comma-separated re-scorings: prefill, chunked:N, batched:N.")
@click.option("--expect-exact", is_flag=True, help="Exit 1 unless every logprob is bit-identical.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              help="text for people, json for programs.")
def replay(fmt, expect_exact, **options) -> None:
    """Re-score supplied trajectories (JSONL: prompt_ids or prompt, and tokens) the way a trainer
    does and report, per token, how its logprob differs from step-by-step generation."""
    from harness.protocol import replay as replay_lib

    result = replay_lib.replay_command(progress=lambda i: click.echo(f"replay {i}", err=True), **options)
    click.echo(json.dumps(result, indent=1) if fmt == "json" else replay_lib.render(result))
    if expect_exact and any(a["differ"] for a in result["aggregate"].values()):
        sys.exit(EXIT_VERDICT)


@main.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="A preset (see `kvfid models`) or hf:<folder>.")
@click.option("--item-set", default="arith", show_default=True, help="Prompts: arith | jsonl:<path>.")
@click.option("-n", "count", type=click.IntRange(1, 10000), default=8, show_default=True,
              help="Trajectories (the first n items).")
@click.option("--tokens", type=click.IntRange(1, 100000), default=32, show_default=True,
              help="Continuation length (shorter when an end-of-turn token is sampled).")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=0.8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="The JSONL file to write.")
def rollouts(**options) -> None:
    """Sample trajectories with temperature (sdpa/fp32, seeded): a real input for `kvfid replay`."""
    from harness.protocol import replay as replay_lib

    rows, out = replay_lib.rollouts_command(**options)
    click.echo(f"{len(rows)} trajectories, {sum(len(r['tokens']) for r in rows)} tokens -> {out}", err=True)


# --------------------------------------------------------------------------- matrix runs

def _db_option(command):
    option = click.option("--db", type=click.Path(), default=None,
                          help="Ledger file (default: $KVFID_DB, else reports/ledger.sqlite).")
    return option(command)


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
    from harness.runs import distributed, matrix
    from harness.runs.case import load_case
    from harness.runs.ledger_views import db_path, headline, report_run

    case = load_case(matrix.default_case_path() if case_path == "default" else case_path)
    if item_count is not None:
        case.with_item_count(item_count)        # refuse a bad count before anything runs
    shard_spec = matrix.parse_shard(shard)
    path = db_path(db)
    ranked = distributed.torchrun_rank()
    if ranked and (resume or shard != "0/1"):
        raise BadInput("under torchrun each rank takes its shard itself; drop --shard/--resume")
    try:
        if ranked:
            result = distributed.run_ranked(case, path, ranked, items=item_count, run_id=run_id,
                                            progress=not quiet)
            if ranked.rank != 0:
                return
        else:
            result = matrix.run_case(case, path, items=item_count, run_id=run_id,
                                     resume=resume, shard=shard_spec, progress=not quiet)
    except matrix.RunInterrupted as stop:
        click.echo(f"interrupted: what was measured is stored; `kvfid run {case_path} --resume "
                   f"{stop.run_id}` continues run {stop.run_id}", err=True)
        sys.exit(130)
    click.echo(f"run {result.run_id} {result.status}: {result.measured} units measured, "
               f"{result.skipped} already stored")
    click.echo(headline(path, result.run_id))
    if write_report:
        for name, file in report_run(path, result.run_id).items():
            click.echo(f"{name}: {file}", err=True)


@main.command()
@_db_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def runs(db, fmt) -> None:
    """List the runs in the ledger (a run whose processes died shows as `died`)."""
    from harness.runs.ledger_views import list_runs, runs_text

    rows = list_runs(db)
    click.echo(json.dumps(rows, indent=1) if fmt == "json" else runs_text(rows))


@main.command()
@click.argument("run_id", metavar="RUN")
@_db_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def show(run_id, db, fmt) -> None:
    """Print a run's aggregates (RUN: an id, a unique prefix, or `latest`)."""
    from harness.runs.ledger_views import show_run

    click.echo(show_run(db, run_id, fmt))


@main.command()
@click.argument("run_id", metavar="RUN")
@_db_option
@click.option("--items", "item_count", type=int, help="Audit only the first N items.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def audit(run_id, db, item_count, quiet) -> None:
    """Check a stored run against its plan and its record checksums, then re-run it and check
    every fingerprint; exit 1 when anything is missing, changed or does not reproduce."""
    from harness.runs.audit import audit_run
    from harness.runs.ledger_views import db_path

    result = audit_run(db_path(db), run_id, items=item_count, progress=not quiet)
    click.echo(result.text())
    sys.exit(0 if result.passed else EXIT_VERDICT)


@main.command(name="report")
@click.argument("run_id", metavar="RUN")
@_db_option
@click.option("--out", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Reports folder; files go to OUT/<environment key>/<run id>/.")
def report_command(run_id, db, out) -> None:
    """Write a run's report: report.md, report.html (self-contained) and summary.json."""
    from harness.runs.ledger_views import report_run

    for name, path in report_run(db, run_id, out).items():
        click.echo(f"{name}: {path}")


@main.command()
@click.argument("run_ids", metavar="RUN RUN...", nargs=-1, required=True)
@_db_option
@click.option("--into", metavar="RUN_ID", help="Id of the merged run (default: a new id).")
def merge(run_ids, db, into) -> None:
    """Merge runs of one case (e.g. shards) into a new run; exit 1 if a unit stored twice has
    different fingerprints."""
    from harness.runs.ledger_views import merge_runs

    merged, copied, conflicts = merge_runs(db, list(run_ids), into)
    click.echo(f"run {merged.id} {merged.status}: {copied} units from {len(run_ids)} runs")
    for source, index, stack in conflicts:
        click.echo(f"conflict: item #{index} stack {stack} differs in run {source} "
                   f"(kept the first run's)", err=True)
    sys.exit(EXIT_VERDICT if conflicts else 0)


@main.command(name="compare")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@_db_option
@click.option("--db-a", type=click.Path(), help="A's ledger (default: --db).")
@click.option("--db-b", type=click.Path(), help="B's ledger (default: --db).")
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
    from harness.reports import compare as comparison
    from harness.runs.ledger_views import db_path

    result = comparison.compare((db_path(db_a or db), db_path(db_b or db)), a, b,
                                kernels_a=kernels_a, kernels_b=kernels_b, bench_a=bench_a,
                                bench_b=bench_b, threshold=threshold, reports=reports)
    if out:
        for name, path in comparison.write_comparison(result, out).items():
            click.echo(f"{name}: {path}", err=True)
    click.echo(json.dumps(result, indent=1) if fmt == "json"
               else comparison.render_markdown(result))
    sys.exit(EXIT_VERDICT if result["regressed"] else 0)


if __name__ == "__main__":
    main()
