"""The red-team's ledgers kvfid cannot write: a read-only file, a read-only folder, a disk that
fills during a run. Shared by tests/commands/test_redteam.py and tests/support/redteam_table.py.

Read-only is real: as root (which writes past file modes) the folder is a tmpfs mounted read-only;
otherwise its modes are cleared. Where root cannot mount, `writable` answers as for another user
(the one place kvfid asks), and `how` says so. A full disk is SQLite's own: the ledger connection
gets `PRAGMA max_page_count` a few pages above its size at opening, so a later write fails with
SQLITE_FULL, "database or disk is full", exactly as when the disk has no room.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from redteam import SMOKE


@contextlib.contextmanager
def read_only_folder(folder: Path, files: dict[str, Path]):
    """`folder` holding copies of `files` ({name: source}), read-only for this process; yields how
    (`tmpfs ro`, `chmod`, or `as if not root`)."""
    folder.mkdir(parents=True)
    if os.geteuid() != 0:
        for name, source in files.items():
            shutil.copy(source, folder / name)
            (folder / name).chmod(0o444)
        folder.chmod(0o555)
        try:
            yield "chmod"
        finally:
            folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    for name, source in files.items():
        shutil.copy(source, folder / name)
    if not mounted:
        from kvfid.ledger import opening as ledger_file

        original = ledger_file.writable
        ledger_file.writable = lambda path: not Path(path).resolve().is_relative_to(folder.resolve())
        try:
            yield "as if not root"
        finally:
            ledger_file.writable = original
        return
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True, capture_output=True)
        yield "tmpfs ro"
    finally:
        subprocess.run(["umount", str(folder)], check=True, capture_output=True)


@contextlib.contextmanager
def ledger_full_after(pages: int):
    """Every ledger opened for writing holds `pages` more pages than it has, then is full."""
    from kvfid.ledger import store as ledger

    original = ledger.connect

    def limited(path, *, write):
        db, version = original(path, write=write)
        if write:
            (count,) = db.execute("PRAGMA page_count").fetchone()
            db.execute(f"PRAGMA max_page_count={count + pages}")
        return db, version

    ledger.connect = limited
    try:
        yield
    finally:
        ledger.connect = original


def read_only_cases(good: Path, folder: Path) -> list[tuple[str, Path, list]]:
    """(what, the ledger path to name, `kvfid run` args) into a read-only file or folder; the
    caller holds `folder` read-only (read_only_folder(folder, {"ledger.sqlite": good}))."""
    run = lambda db: ["run", SMOKE, "--db", db, "--items", "1", "--quiet"]
    return [("read-only ledger file", folder / "ledger.sqlite", run(folder / "ledger.sqlite")),
            ("new ledger in a read-only folder", folder / "new.sqlite", run(folder / "new.sqlite")),
            ("new ledger under a read-only folder", folder / "a" / "new.sqlite",
             run(folder / "a" / "new.sqlite"))]
