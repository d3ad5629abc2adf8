"""`kvfid audit`: is the stored run the run its plan asked for, unchanged, and does it reproduce?

Three checks, each finding named by item, stack and field:
1. plan: every unit the stored case plans is stored, and no other (a deleted unit is caught);
2. records: each unit's record still has the SHA-256 it was written with, and the rows table
   (metrics and fingerprints) is still the projection of that record (a verdict flipped inside a
   stored record, or a fingerprint changed in the rows, is caught without any compute);
3. re-run: every stored unit is measured again from the stored case and every fingerprint
   compared; on the same environment key all must match, on another the differences are the
   regression report.
The ledger is only read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvfid.environment import envinfo
from kvfid.records.read import from_json
from kvfid.runs.case import stored_case
from kvfid.ledger.store import Ledger
from kvfid.ledger.opening import record_sha
from kvfid.runs.matrix import Matrix, Unit, plan_units, progress_bar
from kvfid.ledger.rows import fingerprints, record_rows


@dataclass(frozen=True)
class Difference:
    """One finding: where (item, stack, row kind and label), which field, stored vs now."""

    item_index: int
    item_id: str
    stack: str
    kind: str
    label: str
    field: str
    stored: object
    now: object

    def text(self) -> str:
        """One line: item, stack, row, field, stored vs now."""
        return (f"item {self.item_id} (#{self.item_index}) stack {self.stack} {self.kind} "
                f"{self.label} {self.field}: stored {_short(self.stored)} now {_short(self.now)}")


def _short(value) -> str:
    return f"{value[:16]}…" if isinstance(value, str) and len(value) > 24 else repr(value)


@dataclass
class AuditResult:
    """What an audit found: plan and record findings (`integrity`), re-run `differences`."""

    run_id: str
    stored_key: str
    current_key: str
    units: int = 0
    fingerprints: int = 0
    checked_records: int = 0
    pending: int = 0        # planned units a run that is not finished has not stored yet
    integrity: list[Difference] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)

    @property
    def same_environment(self) -> bool:
        """The re-run happened on the stored run's environment key."""
        return self.stored_key == self.current_key

    @property
    def passed(self) -> bool:
        """Nothing missing, nothing changed, every fingerprint reproduced."""
        return not self.differences and not self.integrity

    def text(self) -> str:
        """The audit as `kvfid audit` prints it."""
        where = ("the same environment" if self.same_environment else
                 f"another environment (stored {self.stored_key})")
        lines = [f"audit of run {self.run_id}: {self.checked_records} stored records checked "
                 f"against the plan and their checksums; {self.units} units re-run on "
                 f"{self.current_key}, {where}; {self.fingerprints} fingerprints compared"]
        if self.pending:
            lines.append(f"note: the run is not finished; {self.pending} planned units are not "
                         f"stored yet (`kvfid run CASE --resume {self.run_id}`)")
        if self.passed:
            return "\n".join(lines + ["PASS: every planned unit is stored, every record is "
                                      "unchanged, every fingerprint matches"])
        if self.integrity:
            lines.append(f"FAIL: the stored run is not what was measured "
                         f"({len(self.integrity)} findings)")
            lines += ["  " + d.text() for d in self.integrity]
        if self.differences:
            verdict = ("FAIL: the stored run does not reproduce here" if self.same_environment
                       else "REGRESSION: these fingerprints changed between the environments")
            lines.append(f"{verdict} ({len(self.differences)} differences)")
            lines += ["  " + d.text() for d in self.differences]
        return "\n".join(lines)


def audit_run(db: str | Path, run_id: str, *, items: int | None = None, model=None,
              progress: bool = True) -> AuditResult:
    """Check a stored run against its plan and its records, then re-run every stored unit (the
    first `items` items only, if given) and compare every fingerprint."""
    with Ledger(db, readonly=True) as ledger:
        run = ledger.run(run_id)
        stored = ledger.stored_rows(run.id)
        texts = ledger.record_texts(run.id)
        ids = {(u.item_index, u.stack): u.item_id for u in ledger.units(run.id)}
    case = stored_case(run)
    matrix = Matrix(case, model)
    result = AuditResult(run.id, run.environment_key,
                         envinfo.environment_key(envinfo.collect()))
    item_id = lambda index: (matrix.items[index].id if 0 <= index < len(matrix.items)
                             else f"#{index}")
    planned = plan_units(case)
    _check_plan(result, planned, set(ids), item_id, finished=run.status == "finished")
    for index, stack, text, sha in texts:
        result.checked_records += 1
        _check_record(result, index, ids[(index, stack)], stack, text, sha,
                      stored.get((index, stack), {}))
    order = {unit: n for n, unit in enumerate(planned)}
    keys = sorted((k for k in ids if Unit(*k) in order and (items is None or k[0] < items)),
                  key=lambda k: order[Unit(*k)])
    bar = progress_bar(len(keys), f"audit {run.id}", progress)
    for index, stack in keys:
        bar.set_postfix_str(f"{stack} {ids[(index, stack)]}")
        now = fingerprints(matrix.measure(Unit(index, stack)))
        before = {row: prints for row, (_, prints) in stored.get((index, stack), {}).items()}
        result.units += 1
        _compare_prints(result, index, ids[(index, stack)], stack, before, now)
        bar.update()
    bar.close()
    return result


def _check_plan(result: AuditResult, planned: list[Unit], stored: set, item_id,
                finished: bool) -> None:
    """A finished run holds every planned unit; any run holds no unit outside its plan."""
    want = {(u.item_index, u.stack) for u in planned}
    if not finished:        # a partial, interrupted or running run: what is missing is pending
        result.pending = len(want - stored)
        want &= stored
    for index, stack in sorted(want - stored, key=lambda k: (k[1], k[0])):
        result.integrity.append(Difference(index, item_id(index), stack, "unit", "(planned)",
                                           "stored", "yes", "missing"))
    for index, stack in sorted(stored - want, key=lambda k: (k[1], k[0])):
        result.integrity.append(Difference(index, item_id(index), stack, "unit", "(not planned)",
                                           "stored", "no", "present"))


def _check_record(result: AuditResult, index: int, item: str, stack: str, text: str,
                  sha: str | None, rows: dict) -> None:
    """The record's checksum, then every row against the record's own projection."""
    if sha is not None and record_sha(text) != sha:
        result.integrity.append(Difference(index, item, stack, "record", "(whole)", "sha256",
                                           sha, record_sha(text)))
    try:
        projected = {(kind, label): (metrics, prints)
                     for kind, label, metrics, prints in record_rows(from_json(text))}
    except (ValueError, KeyError, TypeError) as err:
        result.integrity.append(Difference(index, item, stack, "record", "(whole)", "readable",
                                           "yes", f"no ({type(err).__name__})"))
        return
    projected = _as_stored(projected)
    for row in sorted(set(rows) | set(projected)):
        old, new = rows.get(row), projected.get(row)
        if old is None or new is None:
            result.integrity.append(Difference(index, item, stack, *row, "row",
                                               "absent" if old is None else "present",
                                               "absent" if new is None else "present"))
            continue
        for part, stored_part, record_part in zip(("metrics", "fingerprints"), old, new):
            for name in sorted(set(stored_part) | set(record_part)):
                if stored_part.get(name) != record_part.get(name):
                    result.integrity.append(Difference(
                        index, item, stack, *row, f"{name} (row {part} vs record)",
                        stored_part.get(name), record_part.get(name)))


def _as_stored(projected: dict) -> dict:
    """A projection round-tripped through JSON, as the rows table stores it."""
    return {row: json.loads(json.dumps(value)) for row, value in projected.items()}


def _compare_prints(result: AuditResult, index: int, item: str, stack: str, before: dict,
                    now: dict) -> None:
    for row in sorted(set(before) | set(now)):
        old, new = before.get(row), now.get(row)
        if old is None or new is None:
            result.differences.append(Difference(index, item, stack, *row, "row",
                                                 "absent" if old is None else "present",
                                                 "absent" if new is None else "present"))
            continue
        for name in sorted(set(old) | set(new)):
            result.fingerprints += 1
            if old.get(name) != new.get(name):
                result.differences.append(Difference(index, item, stack, *row, name,
                                                     old.get(name), new.get(name)))
