"""The whole-call route of the tiled batch-invariant mode: one stock call over all the rows of a
product, where a probe on this machine shows that the call gives every row the bits it gets in
fixed tiles.

kvfid.kernels.invariant.tiled hands the stock kernel fixed [T, K] tiles so that nothing the
kernel chooses from the number of rows M (a GEMV path for a few rows, a blocking, a thread split)
can change a row's bits. Many CPU kernels need no such care over a range of M: one call over M
rows gives each row the bits that row gets in a tile, for every M above some floor (whether one
does is the machine's property: its kernel, ISA, thread count and torch version; never assumed).
Where it holds, the tiles only cost: a prefill is many calls instead of one.

So, per probe key (op, width, the other operand's shape and layout, dtype, extras), thread count
and widening, `span` finds the **floor** F, the smallest of `FLOORS` such that

* an F-row call gives a row the same bits at every place of it (the tiled probe: each row of a
  random tile against itself alone at place 0 of a zero tile), and
* one call over M rows gives every row the bits it gets alone at place 0 of an F-row call, for
  every M from F to F + `DENSE` (each count checked), and for a sample of the counts above up
  to the **ceiling** C (`sample`: both sides of every power of two and a count between
  them, and C itself);

and a product of M rows is then one call: padded with zero rows to F below F, all M rows from F
to C, and tiles of F rows above C (an F-row call: the same bits). Every row has the bits of
itself alone at place 0 of an F-row call in a decode step, a prefill, a chunk and a batch.

Below a floor F > 1, the **small** counts S < F: every count from 1 to S also gives every row
those bits (each count checked), so a call of up to S rows is made as it is, unpadded. A kernel
may take one path for a few rows that agrees with the path it takes from F on (on an Intel Xeon
with AMX, torch 2.13, some bf16 batched products over 16 columns: floor 64, 1 to 4 rows as they
are): a decode step then costs a one-row call, not an F-row one.

The ceiling follows the calls: the first probe of a key checks up to FIRST_CEILING rows or the
call's own count (the next power of two), and a later call above it extends the probe to its
next power of two (up to MAX_CEILING); a count that fails there stops the ceiling below it. A
sample is not every count: it catches a kernel that switches path above some M (every sampled
count above the switch fails) and the small-M paths and remainder rows near the floor (every count
checked), not a path taken for a narrow band of counts between two samples alone.

**What a probe feeds.** A half-precision product rounds its fp32 sum once: two calls that add a
row's terms in different orders give sums a few fp32 ulps apart, and the rounded results differ
only where a sum lies within those ulps of a rounding midpoint: random rows of normal values
show an order change at a few outputs in a hundred thousand, and a probe on them alone passes a
kernel that gives a model's row other bits (docs/hazards.md, "A probe on random rows"). So a
probe also feeds **revealing**
rows (`revealing_rows`): small terms of one magnitude, and a few pairs of big terms that cancel,
each big enough that a small term added while it is open is lost in fp32. The exact sum is the
small terms', and which of them a call keeps depends on the order it adds in, so any change of
order changes the result by whole small terms, far above its rounding. A product's own operand
would not cancel the pairs: its probe calls the stock kernel on a **stand-in** (`stand_in`) of the
operand's shape, strides and dtype, whose two rows of each pair are equal, so that the pair's
products cancel in every column (the kernel's path is chosen from shapes, strides, dtype and
threads, never from the values). Every check holds on both (`parts`): random rows, whose fp32
sums show any change of order, and revealing ones. A softmax's exponentials would overflow on
revealing rows: it probes on random rows of a given scale only.

**A band below the full floor.** A kernel may give a row one set of bits in a call of up to B
rows and another from B + 1 on, consistent above (oneDNN's bf16 product on an AMX CPU: its AVX-512
path up to 32 rows, its AMX tiles above). A floor F whose dense counts fail at B + 1 > 2F is then
kept as a **band**: one call from F to B rows, tiles of B rows above (each a B-row call: the same
bits). The first full floor serves a decode step by an F'-row call and a prefill by one call;
the band serves a decode step unpadded and a prefill in B-row tiles. Which costs less is the
machine's: both are timed on the key's own product (`_cheaper`), per token of a mix of one
decode row and one row of a FIRST_CEILING-row prefill, and the cheaper one is kept (the other's
time said in `why`). Either gives every row one set of bits in every construction.

A verdict is kept per machine, in `$KVFID_CACHE/whole-calls.json` under
kvfid.kernels.invariant.machine.machine_key() (CPU model, dispatch capability, ISA variables, torch
version, threads, the probe's RULE), so a later process reads the floor and ceiling back instead of
probing again; `verdicts()` says in words what each key takes here and why.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, replace

import torch

from kvfid.kernels.invariant import machine

FLOORS = (1, 2, 4, 8, 16, 32, 64)   # candidate floors, smallest first (the cheapest decode)
DENSE = 64                          # every row count from the floor to DENSE above it is checked
FIRST_CEILING = 256                 # the first probe of a key checks at least this many rows
MAX_CEILING = 1 << 16               # no probe beyond this: tiles of F rows serve above it
STORE = "whole-calls.json"
# The probe's version, part of the machine key its spans are kept under (a span found by an
# earlier probe is probed again, not reused).
RULE = "whole 3"
TIMED = 5           # calls per candidate's timing (the fastest counts)
BIG = 2.0 ** 13     # a revealing row's big terms; its small terms are 1 / BIG: lost next to BIG in fp32
PAIRS = 4           # pairs of cancelling big terms per revealing row


@dataclass(frozen=True)
class Span:
    """Where one call serves a key: from `floor` rows (fewer are padded to it, but for 1 to
    `small` rows) up to `ceiling` rows (more run in tiles of `floor` rows); `probed`: the counts
    checked so far reach here."""

    floor: int | None           # None: no floor found, the tiled route serves every count
    ceiling: int = 0
    probed: int = 0
    why: str = ""
    small: int = 0              # 1 to `small` rows: one call as they are (each count checked)
    tile: int = 0               # rows per call above the ceiling (0: the floor's)

    def as_they_are(self, rows: int) -> bool:
        """Whether a call of `rows` rows is made on them as they are (no padding, no tiles)."""
        return rows <= self.ceiling and (rows >= self.floor or rows <= self.small)


def sample(low: int, high: int) -> list[int]:
    """The row counts above `low` up to `high` a probe checks: for every power of two p with
    low <= p < high, the doubling (p, 2p]'s first count, a count inside it, its last two; and
    high itself; ascending."""
    counts = {high}
    p = 1
    while p < high:
        if p >= low:
            counts |= {p + 1, p + p // 2 + 3, 2 * p - 1, 2 * p}
        p *= 2
    return sorted(c for c in counts if low < c <= high)


def tile_of(span: Span) -> int:
    """The rows of each call above a span's ceiling."""
    return span.tile or span.floor


def _ceiling_for(rows: int) -> int:
    return min(MAX_CEILING, max(FIRST_CEILING, 1 << max(0, rows - 1).bit_length()))


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def pair_slots(width: int) -> torch.Tensor:
    """The columns of a row of `width` that hold the cancelling big pairs [pairs, 2]: fixed per
    width (a stand-in operand's equal rows sit at the same places), spread over the row."""
    gen = torch.Generator().manual_seed(width)
    pairs = min(PAIRS, width // 2)
    return torch.randperm(width, generator=gen)[:2 * pairs].reshape(pairs, 2)


def _signs(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=generator).float() * 2 - 1


def revealing_rows(count: int, width: int, dtype: torch.dtype, device: torch.device,
                   seed: int) -> torch.Tensor:
    """[count, width] rows whose sums reveal the order of their terms: +-1/BIG everywhere but
    at `pair_slots`, where each pair holds +BIG and -BIG (its sign drawn per row). Exact in
    bf16, fp16 and fp32."""
    gen = torch.Generator().manual_seed(seed)
    rows = _signs(count, width, generator=gen) / BIG   # [count, width]
    slots = pair_slots(width)
    if len(slots):
        sign = _signs(count, len(slots), generator=gen) * BIG   # [count, pairs]
        rows[:, slots[:, 0]] = sign
        rows[:, slots[:, 1]] = -sign
    return rows.to(device, dtype)


def stand_in(operand: torch.Tensor) -> torch.Tensor:
    """A product's other operand [..., K, N] replaced for a probe: +-1 in its shape, strides,
    dtype and device, the two rows of each of K's `pair_slots` equal, so that a revealing row's
    big terms cancel in every column. An operand whose strides overlap (an expanded one) is
    returned as it is."""
    if any(st == 0 and n > 1 for st, n in zip(operand.stride(), operand.shape)):
        return operand
    gen = torch.Generator().manual_seed(1)
    values = _signs(*operand.shape, generator=gen)   # [..., K, N]
    slots = pair_slots(operand.shape[-2])
    if len(slots):
        values[..., slots[:, 1], :] = values[..., slots[:, 0], :]
    out = torch.empty_strided(tuple(operand.shape), operand.stride(), dtype=operand.dtype,
                              device=operand.device)
    return out.copy_(values)


def _random_rows(count: int, width: int, dtype: torch.dtype, device: torch.device,
                 scale: float | None, seed: int) -> torch.Tensor:
    """A probe's rows: revealing (`scale` None), else random normal values times `scale`."""
    if scale is None:
        return revealing_rows(count, width, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(count, width, generator=gen) * scale).to(device, dtype)


def in_tiles(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, tile: int) -> torch.Tensor:
    """fn over rows [M, K] -> [M, N], `tile` rows a call, zero rows padding the last tile: the
    tiled mode's one loop."""
    m, width = rows.shape
    outs = []
    for start in range(0, m, tile):
        part = rows[start:start + tile]
        if part.shape[0] == tile:
            block = _fresh(part)
        else:
            block = rows.new_zeros(tile, width)
            block[:part.shape[0]] = part
        outs.append(fn(block)[:part.shape[0]])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# A probe's part: a stock call and the rows it is fed, random normal values of a scale, or
# revealing rows (None). Every check of a probe holds on every part.
Part = tuple[Callable[[torch.Tensor], torch.Tensor], float | None]


def parts(fn: Callable, scale: float | None = 1.0, probe: Callable[[], Callable] | None = None,
          reveal: bool = True) -> tuple[Part, ...]:
    """A key's probe: `fn` on random rows of `scale` (fp32 sums show any change of order), and,
    where `reveal`, `probe()` (the stock call on a stand-in operand), else `fn`, on revealing
    rows (a rounded half-precision sum shows it there)."""
    random = ((fn, scale),) if scale is not None else ()
    return random + (((probe() if probe else fn, None),) if reveal else ())


def place_probe(probed: tuple[Part, ...], tile: int, width: int, dtype: torch.dtype,
                device: torch.device) -> str | None:
    """None when, on every part, every row of a [tile, width] tile has the bits it gets alone at
    place 0 of a zero tile; else which places differ."""
    for fn, scale in probed:
        x = _random_rows(tile, width, dtype, device, scale, seed=0)
        full = fn(_fresh(x))
        bad = []
        for place in range(tile):
            alone = torch.zeros_like(x)
            alone[0] = x[place]
            if not _same_rows(fn(alone)[:1], full[place:place + 1]):
                bad.append(place)
        if bad:
            shown = ", ".join(map(str, bad[:6])) + (", ..." if len(bad) > 6 else "")
            return f"{len(bad)} of {tile} places ({shown}) differ from place 0{_on(scale)}"
    return None


def _on(scale: float | None) -> str:
    return " on revealing rows" if scale is None else ""


def _first_failing(fn: Callable, x: torch.Tensor, canon: torch.Tensor, counts: list[int]) -> int | None:
    """The first count of `counts` whose one call over x's first rows differs from `canon`."""
    return next((m for m in counts if not _same_rows(fn(_fresh(x[:m])), canon[:m])), None)


def _find(probed: tuple[Part, ...], width: int, dtype: torch.dtype, device: torch.device,
          ceiling: int) -> Span:
    """Probe a key: its floor (the smallest F of FLOORS that passes the place probe and whose
    one call gives the F-tile bits at every count from F to F + DENSE, on every part), then the
    sample above up to `ceiling`."""
    xs = [_random_rows(FLOORS[-1] + DENSE, width, dtype, device, scale, seed=1) for _, scale in probed]
    calls: list[dict[int, torch.Tensor]] = [{} for _ in probed]
    tried = []
    band = None         # the smallest floor whose dense counts hold up to a band (see above)
    for floor in FLOORS:
        place = place_probe(probed, floor, width, dtype, device)
        if place is not None:
            tried.append(f"{floor}: {place}")
            continue
        failing = []        # each part's first failing count (all parts: a band needs the least)
        for (fn, scale), x, memo in zip(probed, xs, calls):
            canon = in_tiles(fn, x[:floor + DENSE], floor)
            for m in range(floor, floor + DENSE + 1):
                if m not in memo:
                    memo[m] = fn(_fresh(x[:m]))
                if not _same_rows(memo[m], canon[:m]):
                    failing.append((m, _on(scale)))
                    break
        bad = min(failing, default=None)      # (count, " on revealing rows" or "")
        if bad is None:
            small = _small(probed, xs, calls, floor)
            below = f" (1 to {small} rows as they are)" if small else ""
            found = Span(floor, floor + DENSE, floor + DENSE,
                         f"one call, floor {floor}{below}, checked to {floor + DENSE} rows", small)
            found = _extend(probed, found, width, dtype, device, max(ceiling, floor + DENSE))
            return found if band is None else _cheaper(probed[0][0], band, found, width, dtype, device)
        tried.append(f"{floor}: one call of {bad[0]} rows differs{bad[1]}")
        if band is None and bad[0] - 1 > 2 * floor:
            band = Span(floor, bad[0] - 1, bad[0], f"one call from {floor} to {bad[0] - 1} rows, "
                        f"tiles of {bad[0] - 1} above ({bad[0]} rows differ{bad[1]})",
                        tile=bad[0] - 1)
    if band is not None:
        return band
    return Span(None, 0, FLOORS[-1] + DENSE, f"no floor up to {FLOORS[-1]} rows (floor {tried[0]}; "
                f"floor {tried[-1]})")


def _cost_ms(fn: Callable, served: Span, width: int, dtype: torch.dtype, device: torch.device) -> float:
    """Milliseconds a token of the mix costs `served`: one decode row, and a FIRST_CEILING-row
    prefill over its rows (each the fastest of TIMED calls, after a warm-up)."""
    rows = _random_rows(FIRST_CEILING, width, dtype, device, 1.0, seed=2)
    times = []
    for part in (rows[:1], rows):
        call(fn, part, served)
        best = float("inf")
        for _ in range(TIMED):
            start = time.perf_counter()
            call(fn, part, served)
            best = min(best, time.perf_counter() - start)
        times.append(best * 1e3)
    return times[0] + times[1] / FIRST_CEILING


def _cheaper(fn: Callable, band: Span, full: Span, width: int, dtype: torch.dtype,
             device: torch.device) -> Span:
    """The band or the full floor, whichever costs less a token of the mix (`_cost_ms`), its
    `why` saying both costs."""
    costs = [_cost_ms(fn, each, width, dtype, device) for each in (band, full)]
    kept, other = (band, full) if costs[0] <= costs[1] else (full, band)
    said = f"{min(costs):.3g} ms a token of the mix; floor {other.floor}"
    said += f" with tiles of {tile_of(other)}" if other.tile else ""
    return replace(kept, why=f"{kept.why}; {said}: {max(costs):.3g} ms")


def _small(probed: tuple[Part, ...], xs: list[torch.Tensor], calls: list[dict[int, torch.Tensor]],
           floor: int) -> int:
    """The largest S < floor such that a call of every count from 1 to S gives each of its rows
    the bits of that row at place 0 of a `floor`-row call, on every part (0: none)."""
    canons = [in_tiles(fn, x[:floor], floor) for (fn, _), x in zip(probed, xs)]
    for m in range(1, floor):
        for (fn, _), x, memo, canon in zip(probed, xs, calls, canons):
            if m not in memo:
                memo[m] = fn(_fresh(x[:m]))
            if not _same_rows(memo[m], canon[:m]):
                return m - 1
    return floor - 1


def floor_of(fn: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype,
             device: torch.device, probe: Callable[[], Callable] | None = None) -> int | None:
    """The floor of a product (its dense counts only: no sample above, nothing kept) on random
    rows and on revealing rows (through `probe()` where given): what a route's timing weighs a
    whole call by."""
    return _find(parts(fn, 1.0, probe), width, dtype, device, 0).floor


def _extend(probed: tuple[Part, ...], span: Span, width: int, dtype: torch.dtype,
            device: torch.device, high: int) -> Span:
    """The span's sample from its probed count up to `high`, against tiles of its floor, on
    every part."""
    counts = sample(span.probed, high)
    if not counts:
        return span
    failing = []
    for fn, scale in probed:
        x = _random_rows(high, width, dtype, device, scale, seed=high)
        bad = _first_failing(fn, x, in_tiles(fn, x, span.floor), counts)
        if bad is not None:
            failing.append(bad)
    below = f" (1 to {span.small} rows as they are)" if span.small else ""
    if not failing:
        return Span(span.floor, high, high,
                    f"one call, floor {span.floor}{below}, checked to {high} rows", span.small)
    bad = min(failing)
    passed = max([span.ceiling] + [m for m in counts if m < bad])
    return Span(span.floor, passed, high, f"one call from {span.floor} to {passed} rows{below}; "
                f"{bad} rows differ, tiles of {span.floor} above", span.small)


# ---- where verdicts are kept ------------------------------------------------------------------

_lock = threading.RLock()
_spans: dict[tuple, Span] = {}      # (key, widen, threads) -> this process's span


def key_text(key: Hashable, widen: bool) -> str:
    """A probe key in words, e.g. `mm [M, 576] x [576, 192] (strides (1, 576)) bfloat16`."""
    op, width, layout, dtype, *extra = key
    text = f"{op} [M, {width}]"
    if layout is not None:
        text += f" x {list(layout[0])} (strides {layout[1]})"
    text += f" {str(dtype).removeprefix('torch.')}" + (" widened to fp32" if widen else "")
    return text + (f" {tuple(extra)}" if extra else "")


def _path():
    return machine.cache_dir() / STORE


def _wants_more(found: Span, rows: int) -> bool:
    """Whether a call of `rows` rows should extend the span's probe: it has a floor, the call is
    above what was probed, no count has failed yet, and MAX_CEILING is not reached."""
    return (found.floor is not None and rows > found.probed and found.ceiling >= found.probed
            and found.probed < MAX_CEILING)


def probed(key: Hashable, widen: bool) -> Span | None:
    """This process's span of `key` at this thread count, if it has one (nothing probed)."""
    return _spans.get((key, widen, torch.get_num_threads()))


def span(key: Hashable, fn: Callable[[torch.Tensor], torch.Tensor], rows: int, width: int,
         dtype: torch.dtype, device: torch.device, scale: float | None, widen: bool,
         probe: Callable[[], Callable] | None = None, reveal: bool = True) -> Span:
    """The span of `key` at this thread count, covering a call of `rows` rows where it can:
    this process's, else the machine's kept one, else probed now (and kept); extended when `rows`
    is above what was probed. One process probes a key at a time (the others then read it). The
    probe's parts: `parts(fn, scale, probe, reveal)`."""
    name = (key, widen, torch.get_num_threads())
    found = _spans.get(name)       # the common case: one dictionary read, no words made
    if found is not None and not _wants_more(found, rows):
        return found
    with _lock:
        found = _spans.get(name)
        if found is None or _wants_more(found, rows):
            text = key_text(key, widen)
            path, key_of_machine = _path(), machine.machine_key(RULE)
            with contextlib.ExitStack() as hold:
                try:
                    hold.enter_context(machine.locked(path))
                    store = machine.read_json(path)
                except OSError:      # no writable store: this process's own probe, not kept
                    store = None
                kept = (store or {}).get(key_of_machine, {}).get(text)
                if found is None and kept is not None:
                    found = Span(**kept)
                if found is None or _wants_more(found, rows):
                    found = _probe(found, parts(fn, scale, probe, reveal), width, dtype,
                                   device, rows)
                    if store is not None:
                        store.setdefault(key_of_machine, {})[text] = asdict(found)
                        with contextlib.suppress(OSError):
                            machine.write_json(path, store)
        _spans[name] = found
    return found


def _probe(found: Span | None, probed: tuple[Part, ...], width, dtype, device, rows) -> Span:
    if found is None:
        return _find(probed, width, dtype, device, _ceiling_for(rows))
    return _extend(probed, found, width, dtype, device, _ceiling_for(rows))


def call(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, served: Span) -> torch.Tensor:
    """fn over rows [M, K] as the span serves it: padded to the floor (but for its small
    counts), one call, or tiles above the ceiling (`tile_of`)."""
    m = rows.shape[0]
    if m > served.ceiling:
        return in_tiles(fn, rows, tile_of(served))
    if m < served.floor and m > served.small:
        block = rows.new_zeros(served.floor, rows.shape[1])
        block[:m] = rows
        return fn(block)[:m]
    plain = rows.is_contiguous() and rows.storage_offset() == 0
    return fn(rows if plain else _fresh(rows))


def verdicts() -> list[dict]:
    """Every key this process served by span: its words, thread count, floor, ceiling, why."""
    with _lock:
        return [{"call": key_text(key, widen), "threads": threads, **asdict(s)}
                for (key, widen, threads), s in _spans.items()]


def used() -> dict[str, dict]:
    """The spans this process served ("<call> @tN" -> span), as `kept()` names them."""
    with _lock:
        return {f"{key_text(key, widen)} @t{threads}": asdict(s)
                for (key, widen, threads), s in _spans.items()}


def kept() -> dict[str, dict]:
    """The spans kept for this machine at any thread count ("<call> @tN" -> span), read without
    probing (for the environment record)."""
    store = machine.read_json(_path())
    return {f"{text} @t{n}": record for n in range(1, (os.cpu_count() or 1) + 1)
            for text, record in store.get(machine.machine_key(RULE, n), {}).items()}
