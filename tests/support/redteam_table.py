"""Count the red-team's checks: tried / clean / tracebacks / hangs / other, per check.

    cd <repo> && TRITON_INTERPRET=1 python tests/support/redteam_table.py

Clean means: the expected exit code, one `error:` line naming what it must name, no traceback,
no hang, no file changed that must not change, no run left unfinished, no partial output.
`other` counts the rest (a wrong exit code, a vague or multi-line message, a changed file).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import redteam  # noqa: E402
import redteam_ledger  # noqa: E402


def _sha(path: Path):
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _count(table, check, outcome, clean):
    row = table.setdefault(check, collections.Counter())
    row["tried"] += 1
    row[f"exit {outcome.exit_code}"] += 1
    kind = ("hangs" if outcome.hang else "tracebacks" if outcome.traceback else
            "clean" if clean else "other")
    row[kind] += 1
    if kind != "clean":
        print(f"  {check}: {kind}: {outcome.args[:6]} -> {outcome.exit_code}: "
              f"{outcome.output.strip()[-200:]}", file=sys.stderr)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvfid-redteam-"))
    os.chdir(tmp)                   # `run --report` writes reports/ here, not in the repo
    table: dict = {}
    start = time.perf_counter()
    for n, (what, data) in enumerate(redteam.case_variants()):
        folder = tmp / "cases" / f"{n:03d}"
        folder.mkdir(parents=True)
        outcome = redteam.run_case_variant(folder, what, data)
        unfinished = [r for r in redteam.runs_left(folder / "ledger.sqlite") if r[1] != "finished"]
        clean = (outcome.exit_code == 0 and not unfinished) or \
            outcome.clean_refusal(folder / "case.toml")
        _count(table, "fuzzed case files", outcome, clean)

    good = tmp / "good" / "ledger.sqlite"
    assert redteam.invoke("run", redteam.SMOKE, "--db", good, "--items", "2",
                          "--quiet").exit_code == 0
    for what, path, expected in redteam.damaged_ledgers(good, tmp / "ledgers"):
        for command, args in redteam.ledger_commands(path, tmp / "out"):
            before = _sha(path), sorted(os.listdir(path.parent))
            outcome = redteam.invoke(*args)
            want = expected[command]
            clean = outcome.exit_code == 0 if want == "ok" else outcome.clean_refusal(
                path, codes=(3,) if want == "refused" else (2,))
            if not (command == "run" and want == "ok"):
                clean = clean and (_sha(path), sorted(os.listdir(path.parent))) == before
            _count(table, "damaged ledgers x runs/show/report/audit/run", outcome, clean)

    for what, args, codes in redteam.repro_inputs(tmp / "repro"):
        outcome = redteam.invoke(*args)
        clean = outcome.exit_code == 0 if codes == (0,) else outcome.clean_refusal(codes=codes)
        _count(table, "bad repro inputs (and 2 good controls)", outcome, clean)

    for n, (what, sql, named) in enumerate(_tampers()):
        copy = tmp / "tamper" / f"{n}.sqlite"
        copy.parent.mkdir(exist_ok=True)
        shutil.copy(good, copy)
        with contextlib.closing(sqlite3.connect(copy)) as conn:
            conn.executescript(sql)
        outcome = redteam.invoke("audit", "latest", "--db", copy, "--quiet")
        clean = (outcome.exit_code == 0 and "PASS" in outcome.output) if named is None else \
            (outcome.exit_code == 1 and named in outcome.output)
        _count(table, "audit after tampering (5 tampers + 1 control)", outcome, clean)

    for what, args, code, full_at in redteam.output_cases(good, tmp / "outputs"):
        with redteam.disk_full_at(full_at):
            outcome = redteam.invoke(*args)
        clean = outcome.clean_refusal(codes=(code,)) and not redteam.partial_files(tmp)
        _count(table, "unwritable or full outputs", outcome, clean)

    with redteam_ledger.read_only_folder(tmp / "ro", {"ledger.sqlite": good}):
        for what, path, args in redteam_ledger.read_only_cases(good, tmp / "ro"):
            before = _sha(tmp / "ro" / "ledger.sqlite"), sorted(os.listdir(tmp / "ro"))
            outcome = redteam.invoke(*args)
            clean = outcome.clean_refusal(path, "read-only", codes=(3,)) and \
                (_sha(tmp / "ro" / "ledger.sqlite"), sorted(os.listdir(tmp / "ro"))) == before
            _count(table, "read-only ledger or full disk (kvfid run)", outcome, clean)
    full = tmp / "full" / "ledger.sqlite"
    with redteam_ledger.ledger_full_after(6):
        outcome = redteam.invoke("run", redteam.SMOKE, "--db", full, "--quiet")
    clean = outcome.clean_refusal(full, "disk full", codes=(3,))
    if clean:
        run_id = outcome.error_lines[0].split("--resume ")[1].strip()
        clean = redteam.invoke("run", redteam.SMOKE, "--db", full, "--resume", run_id,
                               "--quiet").exit_code == 0
    _count(table, "read-only ledger or full disk (kvfid run)", outcome, clean)

    print("| check | tried | clean | tracebacks | hangs | other | exit codes |\n"
          "|---|---|---|---|---|---|---|")
    for check, row in table.items():
        exits = ", ".join(f"{k.split()[1]}: {v}" for k, v in sorted(row.items())
                          if k.startswith("exit "))
        print(f"| {check} | {row['tried']} | {row['clean']} | {row['tracebacks']} | "
              f"{row['hangs']} | {row['other']} | {exits} |")
    print(f"\n{time.perf_counter() - start:.0f} s; scratch files in {tmp}")


def _tampers():
    """(what, SQL, the finding audit must print) on a copy of the two-item smoke ledger."""
    one = "stack = 'sdpa/bf16@t1' AND item_index = 1"
    flip = ("UPDATE units SET record = json_replace(record, '$.comparisons[0].suffix.identical',"
            f" json('false'), '$.comparisons[0].suffix.first_divergence', 0) WHERE {one};")
    return [("control", "", None),
            ("deleted unit", f"DELETE FROM rows WHERE {one}; DELETE FROM units WHERE {one};",
             "stack sdpa/bf16@t1 unit (planned) stored: stored 'yes' now 'missing'"),
            ("flipped record verdict", flip, "suffix_identical (row metrics vs record)"),
            ("changed fingerprint", "UPDATE rows SET fingerprints = json_set(fingerprints, "
             f"'$.cache_sha', 'x') WHERE {one} AND label = 'prefill';",
             "stack sdpa/bf16@t1 boundary prefill cache_sha: stored 'x'"),
            ("deleted row", f"DELETE FROM rows WHERE {one} AND label = 'prefill';",
             "boundary prefill row: stored 'absent'"),
            ("changed row metric", "UPDATE rows SET metrics = json_set(metrics, "
             f"'$.forward_calls', 999) WHERE {one} AND label = 'prefill';",
             "boundary prefill forward_calls (row metrics vs record): stored 999")]


if __name__ == "__main__":
    main()
