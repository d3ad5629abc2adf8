"""Commands that look closely at one item or one set of trajectories: `repro`, `blame`, `replay`,
`rollouts`; and inside a serving engine: `engine-check`, `engine-load`, `engine-bench`."""

from __future__ import annotations

import json

import click

from kvfid.commands.options import (constructions_option, db_option, engine_options, exit_with,
                                    fmt_option, item_options, repro_arguments, stack_options,
                                    take_stack)
from kvfid.names import BIT_EXACT, CONSTRUCTION_HELP, DIVERGES, VERDICT_HELP


@click.command()
@item_options
@stack_options
@click.option("-B", "boundary", type=int, default=32, show_default=True,
              help="Live-generated tokens in the boundary prefix.")
@click.option("-S", "suffix", type=int, default=48, show_default=True,
              help="Greedy suffix tokens decoded from each boundary state.")
@constructions_option("live,prefill,incremental",
                      f"Comma-separated constructions, each built as an arm and compared with "
                      f"live: {CONSTRUCTION_HELP}.")
@click.option("--replicas", default="", help="Comma-separated constructions to run twice "
                                          "(replica floor).")
@click.option("--transplant", "transplants", multiple=True,
              help="RECIPIENT<-DONOR[:SELECTION], e.g. live<-prefill:keys (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Generate all B and S tokens even past an "
              "end-of-turn token (tiny random models end early otherwise).")
@click.option("--cross", help="Also run the fixed-prefix precision crossing over these dtypes "
                              "(comma-separated), P frozen from this stack's live run.")
@click.option("--program", help="A stage program instead of one stream: LAYOUT:NxL+M[:POSITIONS], "
              "e.g. packed:3x8+8:parallel (N branches of L tokens from the prompt, then a merge "
              "of M; layout packed or batched; positions continuing or parallel); the arms are "
              "compared at its merge "
              "boundary (-B is not used; constructions: live, prefill, incremental, chunked:N).")
@click.option("--expect", type=click.Choice([BIT_EXACT, DIVERGES]),
              help=f"Exit 1 unless the verdict is this one (or when nothing was compared with "
                   f"live). {VERDICT_HELP}")
@fmt_option
def repro(fmt, expect, **options) -> None:
    """Reproduce one item on one stack: every arm against live, cache and suffix verdicts, and
    the environment it ran in (in --format json)."""
    from kvfid.diagnoses.repro import repro as run_repro

    stack = take_stack(options)   # the stack options, one value
    outcome = run_repro(stack=stack, **repro_arguments(options))
    click.echo(json.dumps(outcome.to_json(), indent=1) if fmt == "json" else outcome.text())
    exit_with(outcome.passed(expect))


@click.command()
@item_options
@stack_options
@click.option("-B", "boundary", type=click.IntRange(1, 100000), default=8, show_default=True,
              help="Live tokens generated after the prompt: P is the prompt plus these.")
@click.option("--against", default="prefill", show_default=True,
              help="The construction traced against incremental decoding: prefill or chunked:N.")
@click.option("--position", type=int, help="The position of P to blame (default: the first whose "
                                            "cache differs between the two constructions).")
@fmt_option
def blame(fmt, **options) -> None:
    """Name the op that first gives a position of P other bits in incremental decoding than in a
    prefill (or a chunk): a culprit has bit-equal inputs on both sides and a differing output."""
    from kvfid.diagnoses.blame_command import blame_command

    stack = take_stack(options)
    outcome = blame_command(stack=stack, **options)
    click.echo(json.dumps(outcome.to_json(), indent=1) if fmt == "json" else outcome.text())


@click.command()
@click.argument("trajectories", type=click.Path(dir_okay=False))
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="A preset (see `kvfid models`) or hf:<folder>; the one the trajectories are for.")
@stack_options
@constructions_option("prefill", "Comma-separated constructions, each a re-scoring: prefill, "
                                 "chunked:N, batched:N, cached:K, spec:k[+PATTERN], spec:tree:WxD.")
@click.option("--expect-exact", is_flag=True, help="Exit 1 unless every logprob is bit-identical.")
@fmt_option
def replay(fmt, expect_exact, **options) -> None:
    """Re-score supplied trajectories (JSONL: prompt_ids or prompt, and tokens) the way a trainer
    does and report, per token, how its logprob differs from step-by-step generation."""
    from kvfid.diagnoses import replay as replay_lib

    stack = take_stack(options)
    result = replay_lib.replay_command(progress=lambda i: click.echo(f"replay {i}", err=True),
                                       stack=stack, **options)
    click.echo(json.dumps(result, indent=1) if fmt == "json" else replay_lib.render(result))
    exit_with(not expect_exact or not any(a["differ"] for a in result["aggregate"].values()))


@click.command()
@engine_options(engine=None)
@click.option("--item-set", default="arith", show_default=True,
              help="Prompts: arith | arith-easy | jsonl:<path>.")
@click.option("-n", "count", type=click.IntRange(1, 10000), default=8, show_default=True,
              help="Trajectories (the first n items).")
@click.option("--tokens", type=click.IntRange(1, 100000), default=32, show_default=True,
              help="Continuation length (shorter when an end-of-turn token is sampled).")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=0.8,
              show_default=True, help="Sampling temperature (> 0).")
@click.option("--seed", type=int, default=0, show_default=True, help="The sampler's seed.")
@click.option("--out", type=click.Path(dir_okay=False), required=True,
              help="The JSONL file to write.")
@click.option("--server", help="Sample from an OpenAI-compatible completions server at this URL "
                               "(e.g. http://127.0.0.1:8000) instead.")
def rollouts(**options) -> None:
    """Sample trajectories with temperature (seeded), each token's logprob kept: a real input for
    `kvfid replay`, whose engine reference those logprobs are."""
    from kvfid.diagnoses.replay import rollouts_command

    rows, out = rollouts_command(**options)
    click.echo(f"{len(rows)} trajectories, {sum(len(r['tokens']) for r in rows)} tokens -> {out}",
               err=True)


@click.command("engine-check")
@engine_options()
@click.option("-n", "count", type=click.IntRange(1, 1000), default=8, show_default=True,
              help="Prompts (the first n items of --item-set).")
@click.option("--item-set", default="arith", show_default=True,
              help="Prompts: arith | arith-easy | jsonl:<path>.")
@click.option("--tokens", type=click.IntRange(1, 4096), default=48, show_default=True,
              help="Greedy tokens per prompt (end-of-turn ignored).")
@click.option("--chunk", type=click.IntRange(1, 1 << 20), default=32, show_default=True,
              help="The step's token budget that splits a prefill into chunks (vLLM: a multiple of 32).")
@click.option("--batch-invariant", is_flag=True,
              help="The engine's own batch-invariant switch (vLLM: VLLM_BATCH_INVARIANT=1; the "
                   "output says where the engine does not apply it).")
@click.option("--kv", is_flag=True,
              help="Also read each layer's K and V out of the engine's paged cache and compare them bitwise.")
@click.option("--block-size", default="32", show_default=True, metavar="N|default",
              help="The paged cache's KV block in tokens; `default`: the engine's own.")
@click.option("--attention", default=None, metavar="IMPL",
              help="The engine's attention implementation where it has several (transformers: "
                   "paged|sdpa, paged|eager).")
@click.option("--db", type=click.Path(), default=None,
              help="Store the result in this ledger (with --report and no --db: $KVFID_DB, else "
                   "reports/ledger.sqlite).")
@click.option("--report", is_flag=True, help="Store the result and write its report (report.md, "
                                             "report.html) under OUT/<environment key>/<id>/.")
@click.option("--out", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="The reports folder (with --report).")
@fmt_option
def engine_check(fmt, block_size, **options) -> None:
    """An engine's own constructions on the same tokens, bitwise: decode vs prefill re-scoring,
    alone vs batched, and where the engine offers them chunked prefill off vs on, prefix cache
    cold vs warm, TP=1 vs TP=N."""
    from kvfid.tasks.engine_store import check_and_store

    default = block_size == "default"
    if not default and not (block_size.isdigit() and int(block_size) > 0):
        raise click.BadParameter(f"{block_size!r}: a positive number of tokens or `default`",
                                 param_hint="--block-size")
    text, written = check_and_store(fmt, progress=lambda s: click.echo(f"engine-check: {s}", err=True),
                                    block_size=None if default else int(block_size), **options)
    click.echo(text)
    for name, path in written.items():
        click.echo(f"{name}: {path}", err=True)


@click.command("engine-report")
@click.argument("check_id", metavar="[CHECK]", required=False)
@db_option
@click.option("--out", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Reports folder; files go to OUT/<environment key>/<check id>/.")
@fmt_option
def engine_report(check_id, db, out, fmt) -> None:
    """A stored engine check read back (CHECK: an id, a unique prefix, or `latest`): its table,
    and its report (report.md, report.html, engine-check.json) written; without CHECK, the
    stored engine checks."""
    from kvfid.tasks import engine_store

    if check_id is None:
        rows = engine_store.list_checks(db)
        click.echo(json.dumps(rows, indent=1) if fmt == "json" else engine_store.checks_text(rows))
        return
    text, files = engine_store.report_check(db, check_id, out, fmt)
    click.echo(text)
    for name, path in files.items():
        click.echo(f"{name}: {path}", err=True)


@click.command("engine-bench")
@engine_options(faithful=False)
@click.option("-n", "count", type=click.IntRange(1, 1000), default=4, show_default=True,
              help="Prompts, all in one generate call (the first n items of --item-set).")
@click.option("--item-set", default="arith", show_default=True,
              help="Prompts: arith | arith-easy | jsonl:<path>.")
@click.option("--tokens", type=click.IntRange(2, 4096), default=32, show_default=True,
              help="Greedy tokens per prompt in the decode call.")
@click.option("--load", "clients", type=click.IntRange(1, 1024), default=None,
              help="Under load instead: -n requests of engine-load's plan from this many clients, "
                   "generated tokens/s (median of 3).")
@click.option("--kv-blocks", type=click.IntRange(2, 1 << 24), default=18, show_default=True,
              help="With --load: the paged cache's size in blocks of 32 tokens.")
@fmt_option
def engine_bench(fmt, clients, kv_blocks, **options) -> None:
    """The faithful engine's price: the stock and faithful engine on the same requests, prefill
    and decode tokens per second (medians of 3) and how many times slower faithful is; with
    --load, generated tokens per second under engine-load's load."""
    from kvfid.tasks.engine_store import bench

    say = lambda s: click.echo(f"engine-bench: {s}", err=True)  # noqa: E731
    if clients is not None and options["tp"] != 1:
        raise click.UsageError("--load runs the engine at TP 1; drop --tp or --load")
    click.echo(bench(fmt, clients, kv_blocks, progress=say, **options))


@click.command("engine-load")
@engine_options(tp=False)
@click.option("-n", "requests", type=click.IntRange(1, 10000), default=64, show_default=True,
              help="Requests in the plan.")
@click.option("--clients", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Concurrent clients sending them.")
@click.option("--tokens", type=click.IntRange(1, 4096), default=32, show_default=True,
              help="New tokens per request (end-of-turn ignored).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="The plan's seed: prompts, sampling seeds, clients, arrival gaps.")
@click.option("--greedy-share", type=click.FloatRange(0, 1), default=None,
              help="The share of greedy requests (the rest sample with their own seeds); default "
                   "0.5, or 1 for an engine that samples greedily only (transformers).")
@click.option("--kv-blocks", type=click.IntRange(2, 1 << 24), default=40, show_default=True,
              help="The paged cache's size in blocks of 32 tokens (small: the scheduler preempts).")
@click.option("--chunk", type=click.IntRange(32, 1 << 20), default=None,
              help="Chunked prefill by this many tokens per step (greedy plans only; default: off).")
@click.option("--no-prefix-cache", "prefix_caching", flag_value=False, default=True,
              help="Run the engines without the prefix cache.")
@click.option("--server", is_flag=True, help="Serve the load by the engine's own OpenAI server, "
                                             "started here on 127.0.0.1 and stopped at the end.")
@click.option("--client-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="--server: seconds a client waits for one answer.")
@click.option("--kill-server-after", type=click.IntRange(1), default=None,
              help="--server: kill the server after this many answers (what a dead server leaves).")
@click.option("--sweep", is_flag=True, help="Also sweep co-resident sequences (1..64) and prompt "
                                            "lengths across 256 and the chunk size.")
@db_option
@click.option("--report", is_flag=True, help="Also write its report under OUT/<environment "
                                             "key>/<id>/ and update OUT/index.md.")
@click.option("--out", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="The reports folder (with --report).")
@fmt_option
def engine_load(fmt, db, report, out, **options) -> None:
    """An engine under load (concurrent clients, a small KV cache that forces preemption, shared
    prefixes, greedy and seeded sampling), each request bit for bit against itself run alone;
    stored in the ledger (exit 1 when a request differs, 3 when some are missing)."""
    from kvfid.tasks.engine_load_command import run_engine_load

    text, written, code = run_engine_load(fmt, db, report, out, options,
                                          lambda s: click.echo(f"engine-load: {s}", err=True))
    click.echo(text)
    for name, path in written.items():
        click.echo(f"{name}: {path}", err=True)
    raise SystemExit(code)


COMMANDS = [repro, blame, replay, rollouts, engine_check, engine_load, engine_bench, engine_report]
