"""A price table's typed rows and their JSON round trip (kvfid.tasks.price measures them,
kvfid.reports.price_table renders them).

The price of a faithful stack is its time over the stock stack's on the same work, both timed in
one interleaved run (a shared machine's load slows both alike). A row holds each arm's timed
calls; its ratios are read from their medians. The floor beside a decode row is the same
step's matrix products at the rows the faithful route pads them to, against the products at the
step's own rows (stock kernels, one interleaved run of their own).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from kvfid.records.plain import as_plain, from_plain

SCHEMA = 1
STOCK, FAITHFUL, TP_PRODUCTS = "stock", "faithful", "faithful with TP products"


@dataclass(frozen=True)
class ArmTimes:
    """One arm of a row: what ran (a stack label, or the products' form), and the wall and this
    thread's CPU seconds of each timed call, in the order they ran."""

    name: str
    stack: str
    wall_s: tuple[float, ...]
    cpu_s: tuple[float, ...] = ()

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.wall_s) if self.wall_s else None

    @property
    def cpu_median_s(self) -> float | None:
        return statistics.median(self.cpu_s) if self.cpu_s else None


def over(a: ArmTimes | None, b: ArmTimes | None, cpu: bool = False) -> float | None:
    """a's median over b's, of wall time or (`cpu`) of CPU time; None where either has none."""
    if a is None or b is None:
        return None
    top, bottom = (a.cpu_median_s, b.cpu_median_s) if cpu else (a.median_s, b.median_s)
    return top / bottom if top and bottom else None


SPANS = "spans"     # a Floor's route where each product takes its own key's span (the faithful mode's calls)


@dataclass(frozen=True)
class Floor:
    """A decode step's matrix products (the model's linear layers, one call each) at the step's
    rows and at the rows the faithful route pads them to, stock kernels, one interleaved run."""

    route: str               # `[widen:]F` as KVFID_TILED_ROUTE writes a route, or SPANS
    source: str              # where that route came from
    rows: int                # the step's rows (its sequences)
    padded_rows: int         # the rows the route computes: F-row calls covering `rows`
    products: int            # linear products in one step
    own: ArmTimes            # every product once at `rows`
    padded: ArmTimes         # every product by the route's calls
    rounds: int

    @property
    def ratio(self) -> float | None:
        return over(self.padded, self.own)


@dataclass(frozen=True)
class PriceRow:
    """One row of work (a prefill, a decode step, an engine's phase) and its arms' times; the
    first arm is the stock one."""

    model: str
    phase: str                # prefill | decode | engine prefill | engine decode | engine load
    tokens: int               # prefill: its tokens; decode: the keys each sequence reads
    sequences: int            # the rows of the call (decode), or the engine's prompts
    unit: str                 # what one timed figure is: "a call", "a token", ...
    order: str                # "interleaved", or how else the arms were timed
    arms: tuple[ArmTimes, ...] = ()
    rounds: int = 0
    seconds: float = 0.0      # the row's wall, warm-ups and set-up included
    skipped: str | None = None   # why the row was not measured (an estimate, a refusal)
    floor: Floor | None = None
    note: str = ""

    def arm(self, name: str) -> ArmTimes | None:
        return next((a for a in self.arms if a.name == name), None)

    @property
    def ratio(self) -> float | None:
        """Faithful over stock: the price."""
        return over(self.arm(FAITHFUL), self.arm(STOCK))

    @property
    def cpu_ratio(self) -> float | None:
        """Faithful over stock in this thread's CPU time (which other jobs on a shared machine
        stretch much less than wall time)."""
        return over(self.arm(FAITHFUL), self.arm(STOCK), cpu=True)

    @property
    def work(self) -> str:
        if self.phase == "prefill":
            return f"prefill {self.tokens} tokens"
        if self.phase == "decode":
            return (f"decode {self.sequences} sequence{'s' if self.sequences > 1 else ''} "
                    f"over {self.tokens} keys")
        return self.phase


@dataclass(frozen=True)
class PriceTable:
    """One `kvfid price` run: what it was asked, where it ran, its rows as they finished."""

    plan: dict
    threads: int
    environment: dict
    environment_key: str
    started: str
    status: str               # running | finished | interrupted
    rows: tuple[PriceRow, ...] = ()
    finished: str | None = None
    schema: int = SCHEMA


def to_json(table: PriceTable) -> str:
    return json.dumps(as_plain(table), indent=1)


def from_json(text: str) -> PriceTable:
    """A stored price table read back (a table of another schema is refused, ValueError)."""
    data = json.loads(text)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"a price table of schema {data.get('schema')!r}; this kvfid reads {SCHEMA}")
    return from_plain(PriceTable, data)
