"""The run loop: a case's matrix of units, measured into the ledger, and the audit that re-runs it.

A unit is one (item, stack) measurement (`run_item`), or one item's precision crossing
(`run_crossing`, stack `crossing`). `run_case` checks everything it can before any compute
(environment, items, context lengths), loads the model once, then for each stack and each item
measures a unit and writes it in one transaction. `--resume` skips stored units; `--shard I/N`
takes every N-th item, so processes given the same run id fill one run. `audit_run` re-measures a
stored run from its stored case and compares every fingerprint.
"""

from __future__ import annotations

import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness import envinfo
from harness.case import Case, CaseError, stored_case
from harness.items import load_item_set, match_answer
from harness.ledger import Ledger, LedgerError, fingerprints, new_run_id
from harness.models import ModelUnavailable, load_model
from harness.protocol import ProtocolError, run_crossing, run_item

CASES = Path(__file__).resolve().parent.parent / "cases"
GPU_DEFAULT_CASE = CASES / "gpu-qwen2.5-shape.toml"
CPU_DEFAULT_CASE = CASES / "smollm2-cpu.toml"


class EnvironmentUnavailable(RuntimeError):
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
class Shard:
    """Every `count`-th item, starting at `index`."""

    index: int = 0
    count: int = 1

    def takes(self, item_index: int) -> bool:
        return item_index % self.count == self.index


def parse_shard(text: str) -> Shard:
    """`I/N` with 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"bad shard {text!r}; expected I/N, e.g. 0/2") from None
    if not 0 <= index < count:
        raise ValueError(f"bad shard {text!r}; need 0 <= I < N")
    return Shard(index, count)


@dataclass(frozen=True)
class Unit:
    item_index: int
    stack: str          # a stack label, or `crossing`


def plan_units(case: Case, shard: Shard = Shard()) -> list[Unit]:
    """Every unit of the case in run order: for each stack, for each item; then the crossing."""
    items = [i for i in range(case.items.n) if shard.takes(i)]
    units = [Unit(i, stack.label) for stack in case.stacks for i in items if case.takes(stack, i)]
    if case.crossing:
        units += [Unit(i, "crossing") for i in items if case.crossing.applies(i)]
    return units


class Matrix:
    """A case bound to its items and model: measures one unit at a time."""

    def __init__(self, case: Case, model=None) -> None:
        self.case = case
        self.stacks = {stack.label: stack for stack in case.stacks}
        _check_devices(case)
        try:
            self.items = load_item_set(case.items.set, case.items.n, case.items.seed)
        except (OSError, ValueError) as err:
            raise CaseError(f"{case.source}: [items] set = {case.items.set!r}: {err}") from None
        if model is None:
            try:
                model = load_model(case.model)
            except ModelUnavailable as err:
                raise EnvironmentUnavailable(str(err)) from None
        self.model = model
        for index, item in enumerate(self.items):   # refuse before any compute
            try:
                case.plan(index).check_fits(len(model.codec.prompt_ids(item.prompt)),
                                            model.context_length)
                match_answer("", item.answer)       # a reference that is not a number raises
            except (ProtocolError, ValueError) as err:
                raise CaseError(f"{case.source}: item {item.id}: {err}") from None

    def measure(self, unit: Unit) -> dict:
        """Measure one unit; the record `run_item` (or `run_crossing`) returns."""
        item = self.items[unit.item_index]
        if unit.stack == "crossing":
            c = self.case.crossing
            return run_crossing(self.model, item, c.reference, c.stacks, self.case.B, self.case.S,
                                c.constructions)
        return run_item(self.model, self.stacks[unit.stack], item, self.case.plan(unit.item_index),
                        matcher=match_answer)


def _check_devices(case: Case) -> None:
    wanted = {s.device for s in case.stacks}
    if any(d.startswith("cuda") for d in wanted) and not torch.cuda.is_available():
        raise EnvironmentUnavailable(f"{case.source}: its stacks run on {', '.join(sorted(wanted))}"
                                     f" and no CUDA device is available here")


# --------------------------------------------------------------------------- runs

@dataclass
class RunResult:
    run_id: str
    status: str
    measured: int
    skipped: int
    planned: int


def run_case(case: Case, db: str | Path, *, items: int | None = None, run_id: str | None = None,
             resume: str | None = None, shard: Shard = Shard(), model=None,
             progress: bool = True) -> RunResult:
    """Measure the case's units (its first `items` items, if given) into the ledger at `db`.

    `resume` continues a stored run of the same case (on its item count unless `items` says
    otherwise); `run_id` names the run, joining it if it exists (shards). Ctrl-C marks the run
    `interrupted`, an error `crashed`; both stay resumable.
    """
    if resume and run_id and resume != run_id:
        raise CaseError("give --resume RUN or --run-id RUN, not two different runs")
    existing = _existing_run(db, resume or run_id, must_exist=bool(resume))
    count = items or (existing.item_count if existing else case.items.n)
    if count != case.items.n:
        case = case.with_item_count(count)
    matrix = Matrix(case, model)          # every check that needs no compute happens here
    environment = envinfo.collect()
    key = envinfo.environment_key(environment)
    if existing:
        _check_continues(existing, case, key)
    with Ledger(db) as ledger:
        run = existing or _create_or_join(ledger, run_id, case, environment, key)
        stored = ledger.stored_units(run.id)
        units = plan_units(case, shard)
        todo = [u for u in units if (u.item_index, u.stack) not in stored]
        ledger.set_status(run.id, "running")
        if progress:
            print(f"kvfid run {run.id}: {case.name} on {key}; {len(todo)} units to measure, "
                  f"{len(units) - len(todo)} already stored", file=sys.stderr)
        measured = 0
        bar = _progress(len(todo), case.name, progress)
        try:
            for unit in todo:
                item = matrix.items[unit.item_index]
                bar.set_postfix_str(f"{unit.stack} {item.id}")
                record = matrix.measure(unit)
                measured += ledger.write_unit(run.id, unit.item_index, item.id, unit.stack,
                                              record, key)
                bar.update()
        except KeyboardInterrupt:
            ledger.set_status(run.id, "interrupted")
            raise RunInterrupted(run.id) from None
        except Exception as err:
            ledger.set_status(run.id, "crashed", f"{type(err).__name__}: {err}")
            raise
        finally:
            bar.close()
        status = ledger.finish(run.id)
    return RunResult(run.id, status, measured, len(units) - len(todo), len(units))


def _existing_run(db: str | Path, run_id: str | None, must_exist: bool):
    """The stored run to continue or join, None to start one (the file is not created here)."""
    if run_id is None:
        return None
    if not Path(db).is_file():
        if must_exist:
            raise LedgerError(f"{db}: no run {run_id!r} (no ledger file yet)")
        return None
    with Ledger(db) as ledger:
        if must_exist or ledger.has_run(run_id):
            return ledger.run(run_id)
    return None


def _create_or_join(ledger: Ledger, run_id: str | None, case: Case, environment: dict, key: str):
    """A new run; when another shard created the same run id first, that run."""
    try:
        return ledger.create_run(run_id or new_run_id(), case, environment, key)
    except sqlite3.IntegrityError:
        run = ledger.run(run_id)
        _check_continues(run, case, key)
        return run


def _check_continues(run, case: Case, key: str) -> None:
    if (run.case_sha, run.item_count) != (case.sha, case.items.n):
        raise CaseError(f"run {run.id} stored another case ({run.case_source}, "
                        f"{run.item_count} items); {case.source} with {case.items.n} items "
                        f"cannot continue it")
    if run.environment_key != key:
        raise LedgerError(f"run {run.id} was measured on {run.environment_key}; this machine is "
                          f"{key}. Start a new run here and compare the two")


def _progress(total: int, name: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="unit", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)


# --------------------------------------------------------------------------- audit

@dataclass(frozen=True)
class Difference:
    item_index: int
    item_id: str
    stack: str
    kind: str
    label: str
    field: str
    stored: object
    now: object

    def text(self) -> str:
        return (f"item {self.item_id} (#{self.item_index}) stack {self.stack} {self.kind} "
                f"{self.label} {self.field}: stored {_short(self.stored)} now {_short(self.now)}")


def _short(value) -> str:
    return f"{value[:16]}…" if isinstance(value, str) and len(value) > 24 else repr(value)


@dataclass
class AuditResult:
    run_id: str
    stored_key: str
    current_key: str
    units: int = 0
    fingerprints: int = 0
    differences: list[Difference] = field(default_factory=list)

    @property
    def same_environment(self) -> bool:
        return self.stored_key == self.current_key

    @property
    def passed(self) -> bool:
        return not self.differences

    def text(self) -> str:
        where = ("the same environment" if self.same_environment else
                 f"another environment (stored {self.stored_key})")
        head = (f"audit of run {self.run_id}: {self.units} units re-run on {self.current_key}, "
                f"{where}; {self.fingerprints} fingerprints compared")
        if self.passed:
            return head + "\nPASS: every fingerprint matches"
        verdict = ("FAIL: the stored run does not reproduce here" if self.same_environment else
                   "REGRESSION: these fingerprints changed between the environments")
        return "\n".join([head, f"{verdict} ({len(self.differences)} differences)"]
                         + ["  " + d.text() for d in self.differences])


def audit_run(db: str | Path, run_id: str, *, items: int | None = None, model=None,
              progress: bool = True) -> AuditResult:
    """Re-run every stored unit of a run (the first `items` items only, if given) from the stored
    case and compare every fingerprint with the stored ones."""
    with Ledger(db) as ledger:
        run = ledger.run(run_id)
        stored = ledger.stored_fingerprints(run.id)
        ids = {(u.item_index, u.stack): u.item_id for u in ledger.units(run.id)}
    case = stored_case(run)
    matrix = Matrix(case, model)
    result = AuditResult(run.id, run.environment_key,
                         envinfo.environment_key(envinfo.collect()))
    order = {unit: n for n, unit in enumerate(plan_units(case))}
    keys = sorted((k for k in stored if items is None or k[0] < items),
                  key=lambda k: order.get(Unit(*k), len(order)))
    bar = _progress(len(keys), f"audit {run.id}", progress)
    for index, stack in keys:
        bar.set_postfix_str(f"{stack} {ids[(index, stack)]}")
        now = fingerprints(matrix.measure(Unit(index, stack)))
        before = stored[(index, stack)]
        result.units += 1
        for row in sorted(set(before) | set(now)):
            old, new = before.get(row), now.get(row)
            if old is None or new is None:
                result.differences.append(Difference(index, ids[(index, stack)], stack, *row,
                                                     "row", "absent" if old is None else "present",
                                                     "absent" if new is None else "present"))
                continue
            for name in sorted(set(old) | set(new)):
                result.fingerprints += 1
                if old.get(name) != new.get(name):
                    result.differences.append(Difference(index, ids[(index, stack)], stack, *row,
                                                         name, old.get(name), new.get(name)))
        bar.update()
    bar.close()
    return result
