"""Commands about this machine: `models`, `env`, `kernels`, `compile`."""

from __future__ import annotations

import json

import click

from kvfid.commands.options import exit_with, fmt_option
from kvfid.names import DTYPE_NAMES


@click.command()
@click.argument("model", required=False)
@click.option("--length", type=click.IntRange(min=1), default=None,
              help="Tokens a run will hold (default: the model's context); a window at least "
                   "this long needs no window support.")
@fmt_option
def models(model: str | None, length: int | None, fmt: str) -> None:
    """List the model presets, their sizes, and whether they can be loaded here; with MODEL (a
    preset or hf:<folder>), each layer type of that model (its state, its mechanisms) and which
    stacks serve it and why not, read from its config before any compute."""
    if model is None:
        from kvfid.inputs.models import describe_presets

        click.echo(describe_presets(fmt))
        return
    from kvfid.stacks.backends import builtin_backends
    from kvfid.stacks.serving import describe_serving
    from kvfid.diagnoses.subject import check_model_name

    check_model_name(model)
    click.echo(describe_serving(model, builtin_backends(), fmt, length))


@click.command()
@fmt_option
def env(fmt: str) -> None:
    """Print the environment record (GPUs through NVML, versions, CPU, git) and its key."""
    from kvfid.environment import envinfo

    record = envinfo.machine_record()
    click.echo(json.dumps({**record, "key": envinfo.environment_key(record)}, indent=1)
               if fmt == "json" else envinfo.describe(record))


@click.command()
@click.option("--dtypes", default="bf16,fp32", show_default=True,
              help=f"Comma-separated: {', '.join(DTYPE_NAMES)}.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available).")
@click.option("--quick", is_flag=True, help="Small shapes and a few batch sizes (seconds).")
@click.option("--threads", type=int, default=1, show_default=True,
              help="torch threads (stock CPU results depend on it).")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes measuring the rows (on a CPU more than cores / threads buys nothing).")
@click.option("--out", type=click.Path(file_okay=False),
              help="Also write kernels.json and kernels.md into OUT/<environment key>/.")
@fmt_option
def kernels(dtypes, device, quick, threads, jobs, out, fmt) -> None:
    """Bitwise batch-invariance and prefill-vs-decode verdicts for every op and implementation;
    exit 1 if an implementation that claims invariance is not invariant."""
    from kvfid.reports.invariance_table import render_table
    from kvfid.tasks.kernel_commands import kernel_verdicts

    result, written = kernel_verdicts(dtypes, device, quick, threads, out, jobs=jobs,
                                      progress=lambda m: click.echo(m, err=True))
    if written:
        click.echo(f"kernels: {written}", err=True)
    click.echo(json.dumps(result, indent=1) if fmt == "json" else render_table(result))
    exit_with(result["ok"])


@click.command(name="compile")
@click.option("--arch", "archs", default="sm_80,sm_90,sm_100", show_default=True,
              help="Comma-separated GPU archs.")
@click.option("--dtypes", default="bf16,fp16,fp32", show_default=True,
              help=f"Comma-separated: {', '.join(DTYPE_NAMES)}.")
@click.option("--kernels", "kernel_names", help="Comma-separated (default: all): attention, "
              "matmul, mean, rms_norm, softmax, log_softmax.")
@click.option("--quick", is_flag=True, help="Attention at the GPU default case's shape only.")
@click.option("--jobs", type=click.IntRange(min=1), help="Compiler processes (default: CPUs).")
@click.option("--out", type=click.Path(file_okay=False), help="Keep each config's cubin here.")
@fmt_option
def compile_command(archs, dtypes, kernel_names, quick, jobs, out, fmt) -> None:
    """Compile every Triton kernel config for GPU archs on this machine (no GPU needed) and
    inspect the cubins; exit 1 on a compile failure, spill, shared memory over the limit, atomic,
    or a bf16/fp16 product without tensor cores."""
    from kvfid.reports.compile_report import render_table
    from kvfid.tasks.kernel_commands import compile_report

    report = compile_report(archs, dtypes, kernel_names, quick, jobs, out)
    click.echo(json.dumps(report, indent=1) if fmt == "json" else render_table(report))
    exit_with(report["ok"])


COMMANDS = [models, env, kernels, compile_command]
