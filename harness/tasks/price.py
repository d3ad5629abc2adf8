"""`kvfid price`: the faithful stacks' price table, each row from one interleaved run.

Per model (loaded as `kvfid.load_model` loads it), rows of work from the cheapest up: decode steps
(`sequences` rows over `context` keys each, and one sequence over each of `keys`), then prefills
of each length. Each row times the stock stack, the faithful stack and, for a `+bi` faithful
stack that names no TP size, the same stack at `@tp1` (its row-parallel products in fixed
segments added in an fp32 tree: what TP=N against TP=1 costs at TP=1), interleaved (kvfid.tasks.price_work). Beside each decode row, the
floor: the step's products at the rows the faithful route pads them to against its own rows.
Then the faithful vLLM engine's rows, from `kvfid engine-bench` run in vLLM's venv
(kvfid.tasks.price_engine).

A time budget bounds the run: a row whose estimate (a warm-up and one round, scaled from the
nearest row measured, by linear weights x rows) passes what is left is shown skipped with that
estimate. The table is written under reports/<environment key>/price/ after every row, so a run
stopped part way keeps what it measured.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kvfid.errors import BadInput, Interrupted, Unavailable
from kvfid.records.plain import as_plain
from kvfid.records.price import FAITHFUL, SPANS, TP_PRODUCTS, STOCK, Floor, PriceRow, PriceTable
from kvfid.tasks import price_work, price_engine
from kvfid.api import load_model
from kvfid.diagnoses.subject import check_model_name
from kvfid.environment import envinfo
from kvfid.kernels.invariant import route as mode_route
from kvfid.kernels.invariant.route import Route
from kvfid.reports.price_table import new_price_path, write_table
from kvfid.stacks.stack import check_supports, parse_stack

MODELS = ("smollm2-135m", "qwen2.5-0.5b-shape", "llama-3.2-1b-shape")


@dataclass(frozen=True)
class PricePlan:
    """What `kvfid price` measures (data, apart from the timer)."""

    models: tuple[str, ...] = MODELS
    prefill: tuple[int, ...] = (64, 512, 2048)      # prefill lengths
    sequences: tuple[int, ...] = (1, 8, 32)         # decode rows, each over `context` keys
    context: int = 512
    keys: tuple[int, ...] = (64, 512, 2048)         # one sequence's decode over these many keys
    stock: str = "sdpa/bf16"
    faithful: str = "native/bf16+bi"
    tp_products: bool = True        # also the faithful stack at @tp1 (its TP-invariant products)
    # The rows and dtype the faithful route computes a decode product in, `[widen:]F` (as
    # KVFID_TILED_ROUTE writes a route: F rows a call, widened to fp32 or not): the floor's F.
    # None: this machine's route for the dtype, as the faithful stack takes it (pinned or kept).
    floor_route: str | None = None
    threads: int = 1
    budget_s: float = 1800.0
    engine: bool = True             # the faithful vLLM engine's rows (engine-bench in vLLM's venv)
    engine_model: str = "smollm2-135m"
    vllm_venv: str = ".venv-vllm"

    def works(self) -> list[tuple[str, int, int]]:
        """(phase, tokens or keys, sequences) of a model's rows, cheapest first."""
        decode = {(n, self.context) for n in self.sequences} | {(1, k) for k in self.keys}
        return ([("decode", k, n) for n, k in sorted(decode)]
                + [("prefill", t, 1) for t in sorted(set(self.prefill))])


def parse_route(text: str):
    """`[widen:][whole:]F` -> kvfid.kernels.invariant.route.Route (exit 2 on anything else)."""
    try:
        return Route.from_spec(text)
    except ValueError:
        raise BadInput(f"--floor-route {text!r}: expected [widen:][whole:]F, e.g. 16, widen:1 "
                       "or whole:1") from None


def check_plan(plan: PricePlan) -> None:
    """Refuse a plan that cannot run, before any loading (exit 2)."""
    for name in plan.models:
        check_model_name(name)
    sizes = [*plan.prefill, *plan.sequences, *plan.keys, plan.context, plan.threads]
    if any(not isinstance(n, int) or n < 1 for n in sizes):
        raise BadInput("lengths, sequence counts and threads must be positive integers")
    if plan.budget_s <= 0:
        raise BadInput(f"--budget {plan.budget_s}: a positive number of seconds")
    for option, label in (("--stock", plan.stock), ("--faithful", plan.faithful)):
        try:
            stack = parse_stack(label)
        except ValueError as err:
            raise BadInput(f"{option}: {err}") from None
        if "@t" in label or stack.tp != 1:
            raise BadInput(f"{option} {label}: give the stack without @tN/@tpN (--threads sets "
                           "the threads; the price is taken at TP=1)")
    if plan.floor_route is not None:
        parse_route(plan.floor_route)


def _estimate(model: str, row: tuple, weights: int, measured: list[dict]) -> tuple[float, str] | None:
    """(seconds, why) a row would take (a warm-up and one round), scaled from the nearest row of
    its phase measured (this model's first) by linear weights x rows; None where none is."""
    phase, tokens, sequences = row
    rows = tokens if phase == "prefill" else sequences
    same = [m for m in measured if m["phase"] == phase]
    if not same:
        return None
    mine = [m for m in same if m["model"] == model] or same
    below = [m for m in mine if m["rows"] <= rows]
    ref = max(below, key=lambda m: m["rows"]) if below else min(mine, key=lambda m: m["rows"])
    round_s = ref["round_s"] * (weights * rows) / (ref["weights"] * ref["rows"])
    return 2 * round_s, (f"a warm-up and one round of about {round_s:.1f} s, from {ref['model']} "
                         f"{ref['work']} ({ref['round_s']:.2f} s a round) by linear weights x rows")


class PriceRun:
    """One `kvfid price` run: the plan, its budget, its rows so far and where they are written."""

    def __init__(self, plan: PricePlan, reports, say):
        self.plan, self.say = plan, say
        self.start = time.monotonic()
        environment = envinfo.collect()
        self.table = PriceTable(as_plain(asdict(plan)), plan.threads, environment,
                                envinfo.environment_key(environment), _now(), "running")
        self.path = new_price_path(reports, self.table.environment_key) if reports else None
        self.measured: list[dict] = []
        self.floors: dict[tuple, Floor] = {}

    def left(self) -> float:
        return self.plan.budget_s - (time.monotonic() - self.start)

    def add(self, row: PriceRow) -> None:
        """A finished row into the table, and the table onto disk."""
        self.table = replace(self.table, rows=self.table.rows + (row,))
        self.write()

    def write(self) -> None:
        if self.path is not None:
            write_table(self.table, self.path)

    def finish(self, status: str) -> PriceTable:
        """The table closed: its status, when, and the tiled routes kept now (a route the run's
        faithful stack chose is kept once it is timed; the rest of the record is the start's)."""
        routes = {name: r["route"] for name, r in mode_route.kept().items()}
        self.table = replace(self.table, status=status, finished=_now(),
                             environment={**self.table.environment, "tiled_routes": routes})
        self.write()
        return self.table


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _model_rows(run: PriceRun, name: str) -> None:
    """Every row of one model, cheapest first, each measured or skipped."""
    plan = run.plan
    stock, faithful = (parse_stack(s, threads=plan.threads) for s in (plan.stock, plan.faithful))
    works = plan.works()
    try:
        model = load_model(name)
        for stack in (stock, faithful):
            check_supports(stack, model, max(t for _, t, _ in works) + 1)
    except Unavailable as err:
        for phase, tokens, sequences in works:
            run.add(_skipped(name, phase, tokens, sequences, f"{err}"))
        return
    weights = price_work.linear_weights(model.master)
    for work in works:
        phase, tokens, sequences = work
        guess = _estimate(name, work, weights, run.measured)
        what = _skipped(name, phase, tokens, sequences, "").work
        if run.left() <= 0 or (guess and guess[0] > run.left()):
            why = (f"about {guess[0]:.0f} s ({guess[1]}), over the {max(run.left(), 0):.0f} s left "
                   f"of the {plan.budget_s:.0f} s budget" if guess else
                   f"the {plan.budget_s:.0f} s budget is spent")
            run.say(f"{name}: {what}: skipped: {why}")
            run.add(_skipped(name, phase, tokens, sequences, why))
            continue
        run.say(f"{name}: {what}: measuring" + (f" (about {guess[0]:.0f} s or more)" if guess else ""))
        row = _measure(run, model, name, stock, faithful, work)
        run.measured.append({"model": name, "work": row.work, "phase": phase, "weights": weights,
                             "rows": tokens if phase == "prefill" else sequences,
                             "round_s": sum(a.median_s or 0.0 for a in row.arms)})
        run.add(row)
        cpu = f"{row.cpu_ratio:.2f}x" if row.cpu_ratio else "-"
        run.say(f"{name}: {row.work}: stock {row.arm(STOCK).median_s:.4f} s, faithful "
                f"{row.arm(FAITHFUL).median_s:.4f} s ({row.ratio:.2f}x; CPU time {cpu}), "
                f"{row.rounds} round(s)")
    del model
    gc.collect()


def _skipped(model: str, phase: str, tokens: int, sequences: int, why: str) -> PriceRow:
    return PriceRow(model, phase, tokens, sequences, "a call", "interleaved", skipped=why)


def _measure(run: PriceRun, model, name: str, stock, faithful, work) -> PriceRow:
    plan = run.plan
    phase, tokens, sequences = work
    begun = time.monotonic()

    def session(stack):
        return (price_work.prefill(model, stack, tokens) if phase == "prefill"
                else price_work.decode(model, stack, sequences, tokens))

    arms = [price_work.Arm(STOCK, stock.label, session(stock)),
            price_work.Arm(FAITHFUL, faithful.label, session(faithful))]
    if plan.tp_products and faithful.batch_invariant and not faithful.tp_named:
        at_tp1 = replace(faithful, tp_named=True)
        arms.append(price_work.Arm(TP_PRODUCTS, at_tp1.label, session(at_tp1)))
    times, rounds = price_work.interleaved(arms, lambda s: price_work.rounds_for(s, run.left()))
    floor = _floor(run, model, faithful, sequences) if phase == "decode" else None
    return PriceRow(name, phase, tokens, sequences, "a call", "interleaved", times, rounds,
                    time.monotonic() - begun, floor=floor,
                    note="" if phase == "prefill" else "cache: seeded random keys and values")


def _floor(run: PriceRun, model, faithful, rows: int) -> Floor:
    """The floor at `rows` for this model (measured once per row count)."""
    key = (id(model), rows)
    if key not in run.floors:
        run.floors[key] = floor(model, faithful, rows, run.plan, run.left())
    return run.floors[key]


def route_of(plan: PricePlan, dtype) -> tuple[object, str]:
    """The floor's route and where it came from: the plan's, else this machine's for `dtype` at
    the plan's threads (pinned, kept, or timed as the faithful stack would time it)."""
    if plan.floor_route is not None:
        return parse_route(plan.floor_route), "given (--floor-route)"
    before = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    try:
        chosen = mode_route.route(dtype, torch.device("cpu"))
        record = mode_route.routes().get(f"{mode_route.NAMES[dtype]}@t{plan.threads}", {})
    finally:
        torch.set_num_threads(before)
    return chosen, f"this machine's {mode_route.NAMES[dtype]} route ({record.get('source', 'chosen here')})"


def floor(model, faithful, rows: int, plan: PricePlan, left_s: float) -> Floor:
    """The model's decode products at `rows` rows, stock, against the same products by the
    route's calls (F rows each, padded; widened where the route widens), interleaved."""
    module = model.cast(faithful.torch_dtype, faithful.device)
    route, source = route_of(plan, faithful.torch_dtype)
    named = price_work.linear_layers(module)
    layers = [(sub.weight.detach(), None if sub.bias is None else sub.bias.detach()) for _, sub in named]
    wide = None
    if route.widen:
        master = dict(model.master.named_modules())    # fp32 weights of the same shapes
        wide = [(master[n].weight.detach(), None if master[n].bias is None else master[n].bias.detach())
                for n, _ in named]
    padded = max(rows, route.tile) if route.whole else math.ceil(rows / route.tile) * route.tile
    if route.whole and not route.widen and plan.floor_route is None:
        # each product by its own key's span (kvfid.kernels.invariant.whole), as the faithful
        # stack makes it: a span may serve a few rows unpadded, or tile a band, not the route's F
        by_route = price_work.products(layers, rows, threads=plan.threads, mode=True)
        spec, label, source, padded = SPANS, "the faithful mode's calls", \
            "each product's kept span on this machine", rows
    else:
        by_route = price_work.products(layers, rows, route.tile, wide, plan.threads, route.whole)
        spec, label = route.spec(), route.text()
    arms = [price_work.Arm("own rows", f"{rows} row(s), one stock call",
                           price_work.products(layers, rows, threads=plan.threads)),
            price_work.Arm("route", f"{label}: {padded} row(s)", by_route)]
    times, rounds = price_work.interleaved(arms, lambda s: price_work.rounds_for(s, left_s))
    return Floor(spec, source, rows, padded, len(layers), times[0], times[1], rounds)


def price(plan: PricePlan = PricePlan(), reports: str | Path | None = "reports",
          progress=None) -> tuple[PriceTable, Path | None]:
    """Measure the plan's rows (rows over the budget shown skipped) and write the table under
    `reports`/<environment key>/price/ after each row: the table and its JSON path. Ctrl-C
    keeps the rows measured (Interrupted, exit 130)."""
    check_plan(plan)
    say = progress or (lambda _: None)
    run = PriceRun(plan, reports, say)
    run.write()
    say(f"price: {run.table.environment_key}" + (f", writing {run.path}" if run.path else ""))
    try:
        for name in plan.models:
            _model_rows(run, name)
        if plan.engine:
            for row in price_engine.engine_rows(plan, run.left, say):
                run.add(row)
    except KeyboardInterrupt:
        run.finish("interrupted")
        raise Interrupted(f"the {len(run.table.rows)} row(s) finished are in {run.path}") from None
    return run.finish("finished"), run.path
