"""`kvfid`: the command line. Thin: parses, calls the library, prints.

Machine-readable output goes to stdout (`--format json`); logs and progress to stderr.
Exit codes: 0 ok, 1 a fidelity or regression verdict failed, 2 usage error, 3 environment
unavailable.
"""

from __future__ import annotations

import json
import sys

import click

from harness import render
from harness.backends import DTYPES, Stack, backend_names
from harness.models import PRESETS, ModelUnavailable, load_model, model_names
from harness.protocol import CONSTRUCTION_HELP, ItemPlan, ProtocolError, parse_transplant

EXIT_VERDICT, EXIT_USAGE, EXIT_ENVIRONMENT = 1, 2, 3


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


if __name__ == "__main__":
    main()
