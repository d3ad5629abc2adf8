"""The run loop: a case's matrix of units, measured into the ledger, and the audit that re-runs it.

A unit is one (item, stack) measurement (`run_item`), or one item's precision crossing
(`run_crossing`). `run_case` checks everything it can before any compute (environment, items,
context lengths; `prepare`), loads the model once, opens the ledger once (a new file only after
the checks), then for each stack and each item measures a unit and writes it in one transaction
(`measure`), holding a lease on the run (kvfid.ledger.lease) so
that a killed run shows as `died`. `--resume` skips stored units; `--shard I/N` takes every N-th
item, so processes given the same run id fill one run. kvfid.runs.audit re-checks a stored run.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvfid.environment import envinfo
from kvfid.environment.tiled import choose_routes
from kvfid.kernels.invariant import whole
from kvfid.runs.case import Case, CaseError
from kvfid.checks import check_cuda, selection_reason
from kvfid.errors import DiskFull, Unavailable
from kvfid.stacks.ranks import shared
from kvfid.stacks.stack import check_supports
from kvfid.protocol.constructions import check_rollback
from kvfid.inputs.items import load_item_set, match_answer
from kvfid.ledger.store import Ledger, LedgerError, new_run_id
from kvfid.ledger.opening import probe
from kvfid.inputs.models import ModelUnavailable, load_model
from kvfid.protocol.protocol import ProtocolError, run_crossing, run_item
from kvfid.records.record import CrossingRecord
from kvfid.diagnoses.replay import replay_unit
from kvfid.names import CASES
from kvfid.runs import program_matrix, replay_matrix
from kvfid.runs.shards import Shard

GPU_DEFAULT_CASE = CASES / "gpu-qwen2.5-shape.toml"
CPU_DEFAULT_CASE = CASES / "smollm2-cpu.toml"


class EnvironmentUnavailable(Unavailable, RuntimeError):
    """The case needs something this machine lacks (a CUDA device, a model package)."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; what was measured is stored and `run_id` can be resumed."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id


def default_case_path() -> Path:
    """The `make bench` case: the GPU shape case when CUDA is present, the SmolLM2 CPU case
    otherwise."""
    return GPU_DEFAULT_CASE if torch.cuda.is_available() else CPU_DEFAULT_CASE


@dataclass(frozen=True)
class Unit:
    """One measurement: an item on a stack, or (`crossing(i)`) an item's precision crossing."""

    item_index: int
    stack: str          # a stack label; a crossing unit is stored under CrossingRecord.UNIT

    @classmethod
    def crossing(cls, item_index: int) -> "Unit":
        return cls(item_index, CrossingRecord.UNIT)

    @property
    def is_crossing(self) -> bool:
        return self.stack == CrossingRecord.UNIT


def plan_units(case: Case, shard: Shard = Shard()) -> list[Unit]:
    """Every unit of the case in run order: for each stack, for each item; then the crossing."""
    items = [i for i in range(case.items.n) if shard.takes(i)]
    units = [Unit(i, stack.label) for stack in case.stacks for i in items if case.takes(stack, i)]
    if case.crossing:
        units += [Unit.crossing(i) for i in items if case.crossing.applies(i)]
    return units


class Matrix:
    """A case bound to its items and model: measures one unit at a time."""

    def __init__(self, case: Case, model=None) -> None:
        self.case = case
        _check_devices(case)
        if case.replay or case.program:
            self.model = model or _load(case)
            self.items = (replay_matrix if case.replay else program_matrix).bind(case, self.model)
            return
        try:
            self.items = load_item_set(case.items.set, case.items.n, case.items.seed)
        except (OSError, ValueError) as err:
            raise CaseError(f"{case.source}: [items] set = {case.items.set!r}: {err}") from None
        self.model = model = model or _load(case)
        longest = 0
        for index, item in enumerate(self.items):   # refuse before any compute
            try:
                prompt = len(model.codec.prompt_ids(item.prompt))
                longest = max(longest, prompt + case.B + case.S)
                case.plan(index).check_fits(prompt, model.context_length)
                match_answer("", item.answer)       # a reference that is not a number raises
            except (ProtocolError, ValueError) as err:
                raise CaseError(f"{case.source}: item {item.id}: {err}") from None
            self._check_transplants(item, prompt + case.B)
        crossing = case.crossing.stacks if case.crossing else ()
        world = case.world
        for stack in (*case.stacks, *crossing):     # a model the stack cannot serve (exit 3)
            check_supports(stack, model, longest)
            if world > stack.tp:                    # its arms at the case's larger TP size
                check_supports(replace(stack, tp=world), model, longest)
        check_rollback(model, case.plan(0).arms)    # a cut a recurrent state cannot take (exit 3)

    def _check_transplants(self, item, prefix_length: int) -> None:
        """Every transplant selection fits the model's layers and this item's boundary prefix."""
        layers = int(self.model.config.num_hidden_layers)
        for spec in self.case.transplants.specs if self.case.transplants else ():
            reason = selection_reason(spec.selection, layers, prefix_length)
            if reason is not None:
                raise CaseError(f"{self.case.source}: [transplants] selections = "
                                f"{spec.selection.label!r} on item {item.id}: {reason}")

    def measure(self, unit: Unit):
        """Measure one unit; the record `run_item` (or `run_crossing`, for a replay case
        `replay_unit`, for a program case `program_matrix.measure`) returns."""
        item = self.items[unit.item_index]
        if self.case.replay:
            return replay_unit(self.model, self.case.stack(unit.stack), item,
                               self.case.replay.constructions)
        if self.case.program:
            return program_matrix.measure(self.model, self.case.stack(unit.stack), item, self.case,
                                          unit.item_index)
        if unit.is_crossing:
            c = self.case.crossing
            return run_crossing(self.model, item, c.reference, c.stacks, self.case.B, self.case.S,
                                c.constructions)
        return run_item(self.model, self.case.stack(unit.stack), item, self.case.plan(unit.item_index),
                        matcher=match_answer, neighbours=self.items)


def _load(case: Case):
    try:
        return load_model(case.model)
    except ModelUnavailable as err:
        raise EnvironmentUnavailable(f"{case.source}: model = {case.model!r}: {err}") from None


def _check_devices(case: Case) -> None:
    wanted = {s.device for s in case.stacks}
    if any(d.startswith("cuda") for d in wanted) and not torch.cuda.is_available():
        raise EnvironmentUnavailable(f"{case.source}: its stacks run on {', '.join(sorted(wanted))}"
                                     f" and no CUDA device is available here")
    for device in sorted(wanted):           # cuda:7 on a machine with fewer devices
        check_cuda(device, f"{case.source}: [stacks] device", EnvironmentUnavailable)


# --------------------------------------------------------------------------- runs

@dataclass
class RunResult:
    run_id: str
    status: str
    measured: int
    skipped: int
    planned: int


@dataclass
class Prepared:
    """A case checked and bound to its model, and the stored run it continues (if any)."""

    case: Case
    matrix: Matrix
    environment: dict
    key: str
    existing: object = None
    run_id: str | None = None


def prepare(case: Case, ledger: Ledger | None, *, items: int | None = None,
            run_id: str | None = None, resume: str | None = None, model=None) -> Prepared:
    """Every check before compute; `ledger` is None when its file does not exist yet."""
    if resume and run_id and resume != run_id:
        raise CaseError("give --resume RUN or --run-id RUN, not two different runs")
    existing = _existing_run(ledger, resume or run_id, must_exist=bool(resume))
    count = items or (existing.item_count if existing else case.items.n)
    if count != case.items.n:
        case = case.with_item_count(count)
    matrix = Matrix(case, model)          # every check that needs no compute happens here
    choose_routes((*case.stacks, *(case.crossing.stacks if case.crossing else ())))
    environment = envinfo.collect()       # after the routes: the record names those the units take
    key = envinfo.environment_key(environment)
    if existing:
        _check_continues(existing, case, key)
    return Prepared(case, matrix, environment, key, existing, run_id)


@contextlib.contextmanager
def opened(db: str | Path, check):
    """The ledger at `db`, opened once: an existing file before `check(ledger)` (which reads its
    runs), a new one only after `check(None)` passed, so a refused case creates no file. Yields
    (ledger, what `check` returned)."""
    path = Path(db)
    probe(path)                           # a file that is not a ledger: refused, untouched
    with contextlib.ExitStack() as stack:
        exists = path.is_file() and path.stat().st_size > 0
        ledger = stack.enter_context(Ledger(path)) if exists else None
        checked = check(ledger)
        if ledger is None:
            ledger = stack.enter_context(Ledger(path))
        yield ledger, checked


def run_case(case: Case, db: str | Path | Ledger, *, items: int | None = None,
             run_id: str | None = None, resume: str | None = None, shard: Shard = Shard(),
             model=None, progress: bool = True) -> RunResult:
    """Measure the case's units (its first `items` items, if given) into the ledger `db` (an
    open Ledger, or its path).

    `resume` continues a stored run of the same case (on its item count unless `items` says
    otherwise); `run_id` names the run, joining it if it exists (shards). Ctrl-C marks the run
    `interrupted`, an error `crashed`; both stay resumable.
    """
    check = lambda ledger: prepare(case, ledger, items=items, run_id=run_id, resume=resume,
                                   model=model)
    if isinstance(db, Ledger):
        return measure(check(db), db, shard, progress)
    with opened(db, check) as (ledger, prepared):
        return measure(prepared, ledger, shard, progress)


def measure(prepared: Prepared, ledger: Ledger, shard: Shard = Shard(),
            progress: bool = True) -> RunResult:
    """Measure the prepared case's units not yet stored into `ledger`."""
    case, matrix, key = prepared.case, prepared.matrix, prepared.key
    run = start_run(prepared, ledger)
    stored = ledger.stored_units(run.id)
    units = plan_units(case, shard)
    todo = [u for u in units if (u.item_index, u.stack) not in stored]
    shared((case.items.n, todo))             # a TP run's other ranks measure them too
    ledger.set_status(run.id, "running")
    ledger.hold(run.id)
    if progress:
        print(f"kvfid run {run.id}: {case.name} on {key}; {len(todo)} units to measure, "
              f"{len(units) - len(todo)} already stored", file=sys.stderr)
    measured = 0
    bar = progress_bar(len(todo), case.name, progress)
    try:
        for unit in todo:
            item = matrix.items[unit.item_index]
            bar.set_postfix_str(f"{unit.stack} {item.id}")
            record = matrix.measure(unit)
            measured += ledger.write_unit(run.id, unit.item_index, item.id, unit.stack,
                                          record, key)
            ledger.hold(run.id)       # the heartbeat `runs` reads
            bar.update()
        # The whole-call spans this process's units were served by (kvfid.kernels.invariant.whole),
        # beside those of the run's other processes.
        ledger.note_environment(run.id, "whole_calls", whole.used(), merge=True)
    except KeyboardInterrupt:
        ledger.set_status(run.id, "interrupted")
        raise RunInterrupted(run.id) from None
    except DiskFull as err:             # the status too may not fit; the units stored stay
        with contextlib.suppress(DiskFull):
            ledger.set_status(run.id, "crashed", f"DiskFull: {err}")
        raise DiskFull(f"{err}; run {run.id} keeps its {len(stored) + measured} stored units: "
                       f"free space, then --resume {run.id}") from None
    except Exception as err:
        ledger.set_status(run.id, "crashed", f"{type(err).__name__}: {err}")
        raise
    finally:
        bar.close()
        with contextlib.suppress(DiskFull):     # a lease left behind dies with this process
            ledger.release(run.id)
    status = ledger.finish(run.id)
    return RunResult(run.id, status, measured, len(units) - len(todo), len(units))


def follow(case: Case) -> None:
    """A rank other than 0 of a TP run: the units rank 0 measures (their item count and list
    received from it), measured with it on the same checked model; rank 0 alone writes the
    ledger."""
    count, todo = shared(None)
    case = case.with_item_count(count) if count != case.items.n else case
    matrix = Matrix(case)
    choose_routes((*case.stacks, *(case.crossing.stacks if case.crossing else ())))
    for unit in todo:
        matrix.measure(unit)


def _existing_run(ledger: Ledger | None, run_id: str | None, must_exist: bool):
    """The stored run to continue or join, None to start one."""
    if run_id is None:
        return None
    if ledger is None:
        if must_exist:
            raise LedgerError(f"no run {run_id!r} (no ledger file yet)")
        return None
    if not (must_exist or ledger.has_run(run_id)):
        return None
    run = ledger.run(run_id)
    leases = ledger.leases(run.id)
    live = [lease for lease in leases if lease.alive()]
    if must_exist and run.status == "running" and live:
        raise LedgerError(f"run {run.id} is still being measured ({live[0].text()}); "
                          f"wait for it, or stop that process first")
    if must_exist and run.status == "running" and leases:
        print(f"kvfid: run {run.id} died ({leases[0].text()}); resuming it", file=sys.stderr)
    return run


def start_run(prepared: Prepared, ledger: Ledger):
    """The run `prepared` measures into: the stored one it continues, else a new one (or, when
    another shard created the same run id first, that run)."""
    if prepared.existing:
        return prepared.existing
    try:
        return ledger.create_run(prepared.run_id or new_run_id(), prepared.case,
                                 prepared.environment, prepared.key)
    except sqlite3.IntegrityError:
        run = ledger.run(prepared.run_id)
        _check_continues(run, prepared.case, prepared.key)
        return run


def _check_continues(run, case: Case, key: str) -> None:
    if (run.case_sha, run.item_count) != (case.sha, case.items.n):
        raise CaseError(f"run {run.id} stored another case ({run.case_source}, "
                        f"{run.item_count} items); {case.source} with {case.items.n} items "
                        f"cannot continue it")
    if run.environment_key != key:
        raise LedgerError(f"run {run.id} was measured on {run.environment_key}; this machine is "
                          f"{key}. Start a new run here and compare the two")


def progress_bar(total: int, name: str, enabled: bool):
    """A tqdm bar on stderr (disabled when `enabled` is false)."""
    from tqdm import tqdm   # lazy: a progress bar on a terminal only

    return tqdm(total=total, desc=name, unit="unit", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)
