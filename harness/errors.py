"""The one error hierarchy of kvfid, and the exit code of each kind.

Every error a user can cause or meet is a `KvfidError` carrying a one-line message and its exit
code; `cli.py` turns them into that line and exit code in one place (0 ok, 1 a verdict failed, 2 usage or bad
input, 3 environment unavailable). Library modules keep their own names for their errors
(`CaseError`, `ProtocolError`, `LedgerError`, ...) by subclassing one of the kinds here, so a
caller may catch either the specific error or the kind.
"""

from __future__ import annotations

import errno

EXIT_OK, EXIT_VERDICT, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 1, 2, 3
EXIT_INTERNAL = 70   # an exception kvfid did not expect: a bug (EX_SOFTWARE); never a verdict


class KvfidError(Exception):
    """Base of every error kvfid reports as one line."""

    exit_code = EXIT_USAGE
    prefix = "error"        # the word before the one line on stderr

    def __str__(self) -> str:  # one line, whatever the cause carried
        return " ".join(super().__str__().split())


class BadInput(KvfidError):
    """A bad option, case file, item set, run id or output place: exit 2."""

    exit_code = EXIT_USAGE


class Unavailable(KvfidError):
    """Something this machine lacks or cannot use: a device, a model, a ledger file that is not
    kvfid's or is damaged, a full disk: exit 3."""

    exit_code = EXIT_ENVIRONMENT


class OutputError(KvfidError):
    """An output could not be written (nothing partial is left); exit 2 for a place that cannot
    be written, 3 for a full or failing disk."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class DiskFull(Unavailable):
    """The disk filled while kvfid wrote (exit 3); what was stored before stays stored."""


class ReadOnly(Unavailable):
    """A file or folder kvfid must write and cannot: a read-only file, folder or file system
    (exit 3)."""


# SQLite's primary result codes (the low byte of an extended code) and errno values for each kind.
_SQLITE_READONLY, _SQLITE_FULL = 8, 13
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_READONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}


def write_failure(err: BaseException, path) -> Unavailable | None:
    """The environment error a failed write of `path` is: DiskFull (SQLITE_FULL, "database or
    disk is full", ENOSPC, EDQUOT) or ReadOnly (SQLITE_READONLY, EROFS, EACCES, EPERM); None for
    any other failure, which stays what it was."""
    code = getattr(err, "sqlite_errorcode", None)       # sqlite3.Error, Python >= 3.11
    primary = code & 0xFF if isinstance(code, int) else None
    text = (err.strerror if isinstance(err, OSError) and err.strerror else None) or str(err)
    if primary == _SQLITE_FULL or "database or disk is full" in text or \
            (isinstance(err, OSError) and err.errno in _FULL_ERRNOS):
        return DiskFull(f"{path}: disk full ({text})")
    if primary == _SQLITE_READONLY or "readonly database" in text or \
            (isinstance(err, OSError) and err.errno in _READONLY_ERRNOS):
        return ReadOnly(f"{path}: read-only, kvfid cannot write there ({text})")
    return None


class Interrupted(KvfidError):
    """Ctrl-C during a run: what was measured is stored; the message says how to resume. Exit 130,
    the shell's code for a SIGINT."""

    exit_code = 130
    prefix = "interrupted"
