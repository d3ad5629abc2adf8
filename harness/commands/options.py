"""Options several commands share. Light: click and `kvfid.names`, nothing that loads torch."""

from __future__ import annotations

import click

from kvfid.names import BACKENDS, CONSTRUCTION_HELP, DTYPE_NAMES, MODEL_NAMES  # noqa: F401

FORMAT_HELP = "text for people, json for programs."


def options(*decorators):
    """One decorator for a group of click options."""
    def decorate(command):
        for option in reversed(decorators):
            command = option(command)
        return command
    return decorate


fmt_option = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
                          show_default=True, help=FORMAT_HELP)

db_option = click.option("--db", type=click.Path(), default=None,
                         help="Ledger file (default: $KVFID_DB, else reports/ledger.sqlite).")

reports_option = click.option("--reports", default="reports", show_default=True,
                              type=click.Path(file_okay=False),
                              help="The reports folder (files go under <environment key>/).")

# --model, --prompt, --item-set, --item: one model and one item.
item_options = options(
    click.option("--model", "model_name", default="smollm2-135m", show_default=True,
                 help=f"One of {', '.join(MODEL_NAMES)} (see `kvfid models`)."),
    click.option("--prompt", help="The prompt text (a one-turn chat)."),
    click.option("--item-set", help="Take the prompt from an item set: arith | arith-easy | jsonl:<path>."),
    click.option("--item", "item_index", type=int, help="Index of the item in --item-set."))

STACK_HELP = ("The whole stack as one value, as reports label it, e.g. native/bf16+bi@t1 "
              "(BACKEND/DTYPE[+bi][+scan|+fr][+compile][@tN][@tpN]), instead of the separate "
              "options below; one of them given too must say what the label says (exit 2). "
              "--device combines with it.")


class HiddenAlias(click.Option):
    """An option whose first name is the one shown in the help; the others are old names that
    still work (users' scripts keep running), left out of the help."""

    def get_help_record(self, ctx: click.Context):
        names = self.opts
        self.opts = names[:1]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = names


# --stack, or --backend, --dtype, --batch-invariant, --device, --threads, ...: one stack.
stack_options = options(
    click.option("--stack", "stack_label", metavar="LABEL", help=STACK_HELP),
    click.option("--backend", default="sdpa", show_default=True,
                 help=f"Attention backend: {', '.join(BACKENDS)}, module:function, or an "
                      "implementation transformers registered."),
    click.option("--dtype", default="bf16", show_default=True,
                 help=f"Precision: {', '.join(DTYPE_NAMES)}."),
    click.option("--batch-invariant", is_flag=True,
                 help="Swap in batch-invariant matmul/norm/softmax."),
    click.option("--faithful-recurrence/--chunked-scan", default=None,
                 help="Compute a recurrent layer's multi-token call by its decode step, one token "
                      "at a time (the prefill then runs the decode's algorithm), or by its chunked "
                      "scan; default: stepped with --batch-invariant, scanned without; part of "
                      "the stack (`+bi` steps, `+bi+scan` scans)."),
    click.option("--compile", "compiled", is_flag=True,
                 help="Run the model's forward under torch.compile (inductor); part of the stack."),
    click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N."),
    click.option("--threads", type=int,
                 help="torch thread count (default: torch's); part of the stack."),
    click.option("--tp", type=int, default=1, show_default=True,
                 help="Tensor-parallel size: the model sharded over N ranks this command starts on "
                      "this machine (gloo on a CPU); part of the stack (`@tpN`). An arm may name "
                      "another size (prefill@tp1)."))


def constructions_option(default: str, help: str):
    """`--constructions` (the glossary's word for what it selects), `--arms` its old name."""
    return click.option("--constructions", "--arms", "constructions", cls=HiddenAlias,
                        default=default, show_default=True, help=help)


def repro_arguments(options: dict) -> dict:
    """`kvfid repro`'s comma lists parsed once, here at the edge, into the typed values
    kvfid.diagnoses.repro.repro takes: Constructions, TransplantSpecs (a stage program's stay
    as given: their `segment=NAME` is resolved against the program), dtype names. A bad one is
    refused (ProtocolError, exit 2) naming what is allowed."""
    from kvfid.protocol.constructions import parse_constructions, parse_transplant

    typed = dict(options)
    typed["constructions"] = parse_constructions(options["constructions"])
    typed["replicas"] = parse_constructions(options["replicas"] or "")
    if not options.get("program"):
        typed["transplants"] = tuple(parse_transplant(t) for t in options["transplants"])
    typed["cross"] = tuple(options["cross"].split(",")) if options["cross"] else ()
    return typed


def take_stack(options: dict):
    """Take a command's stack options out of `options` and return the one Stack they name
    (kvfid.diagnoses.subject.command_stack: --stack's label, or the separate options given on
    the command line; both: they must agree, exit 2)."""
    from click.core import ParameterSource

    from kvfid.diagnoses.subject import STACK_PARTS, command_stack

    context = click.get_current_context()
    label, device = options.pop("stack_label"), options.pop("device")
    given = {}
    for name in STACK_PARTS:
        value = options.pop(name)
        if context.get_parameter_source(name) is not ParameterSource.DEFAULT:
            given[name] = value
    return command_stack(label, device, **given)


def exit_with(ok: bool) -> None:
    """Exit 1 when a verdict failed (0 otherwise): kvfid.errors.EXIT_VERDICT."""
    from kvfid.errors import EXIT_OK, EXIT_VERDICT

    raise SystemExit(EXIT_OK if ok else EXIT_VERDICT)


# --engine, --model, --dtype, --threads, --faithful, --tp: one engine, as every engine command
# starts one (kvfid.engines.registry names the engines; an unknown one is refused there, exit 2).
def engine_options(tp: bool = True, faithful: bool = True, engine: str | None = "vllm",
                   kv_cache: bool = True):
    """The engine commands' shared options (`tp`, `faithful`, `kv_cache`: whether the command
    takes them; `engine`: the default, None for a command that runs without one unless told)."""
    shared = [
        click.option("--engine", default=engine, show_default=engine is not None, metavar="NAME",
                     help="The serving engine: vllm (`make install-vllm`) or transformers "
                          "(its continuous batching, paged attention, on CPU)"
                          + ("." if engine else "; default: none, kvfid samples on sdpa/fp32, "
                             "one thread.")),
        click.option("--model", "model_name", default="smollm2-135m", show_default=True,
                     help="smollm2-135m or hf:<folder> (the engines load folders)."),
        click.option("--dtype", default="bf16", show_default=True, help="bf16, fp16 or fp32."),
        click.option("--threads", type=click.IntRange(1, 1024), default=None,
                     help="The engine's calls at N torch threads (default: the engine's own).")]
    if faithful:
        shared.append(click.option("--faithful", is_flag=True,
                                   help="Run the engine with kvfid's batch-invariant attention "
                                        "and mode inside it."))
    if tp:
        shared.append(click.option("--tp", type=click.IntRange(1, 64), default=1, show_default=True,
                                   help="Tensor-parallel size (worker processes, each on its own "
                                        "cores), where the engine offers it."))
    if kv_cache:
        shared.append(click.option("--kv-cache-dtype", default="auto", show_default=True,
                                   type=click.Choice(["auto", "fp8_e4m3", "fp8_e5m2"]),
                                   help="The paged cache's stored format: the model's dtype, or fp8 "
                                        "bytes with a scale per layer, where the engine offers it."))
    return options(*shared)
