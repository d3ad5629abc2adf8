"""The one error hierarchy: each kind's exit code, one line on stderr, the traceback only with
KVFID_DEBUG=1, and an unexpected exception reported as a bug (exit 70), never as a verdict."""

import errno
import sqlite3

import pytest
from click.testing import CliRunner

from kvfid.tasks import ledger_views
from kvfid.runs.case import CaseError
from kvfid.cli import main
from kvfid.errors import (BadInput, DiskFull, OutputError, ReadOnly, Unavailable,
                            write_failure)
from kvfid.ledger.store import LedgerError
from kvfid.ledger.opening import LedgerRefused
from kvfid.inputs.models import ModelUnavailable


@pytest.mark.parametrize("error,code", [
    (BadInput("bad\ninput"), 2), (CaseError("c.toml: [items] n"), 2), (LedgerError("no run"), 2),
    (Unavailable("no GPU"), 3), (LedgerRefused("l.sqlite: foreign"), 3),
    (ModelUnavailable("hf:x"), 3), (OutputError("full", 3), 3), (OutputError("denied"), 2),
    (DiskFull("l.sqlite: disk full"), 3), (ReadOnly("l.sqlite: read-only"), 3),
])
def test_each_kind_has_its_exit_code_and_one_line(monkeypatch, error, code):
    def fail(db):
        raise error

    monkeypatch.setattr(ledger_views, "list_runs", fail)
    result = CliRunner().invoke(main, ["runs"])
    assert result.exit_code == code
    assert result.output.count("\n") == 1 and result.output.startswith("error: ")


def test_a_bug_is_one_line_exit_70_and_debug_shows_it(monkeypatch):
    def bug(db):
        raise KeyError("units")

    monkeypatch.setattr(ledger_views, "list_runs", bug)
    result = CliRunner().invoke(main, ["runs"])
    assert result.exit_code == 70 and result.output.startswith("internal error (a bug in kvfid)")
    assert result.output.count("\n") == 1
    monkeypatch.setenv("KVFID_DEBUG", "1")
    debug = CliRunner().invoke(main, ["runs"])
    assert isinstance(debug.exception, KeyError)     # raised through: Python prints it


def test_an_interrupted_run_is_one_line_and_exit_130(monkeypatch):
    from kvfid.errors import Interrupted

    def stop(db):
        raise Interrupted("`kvfid run smoke --resume r1` continues run r1")

    monkeypatch.setattr(ledger_views, "list_runs", stop)
    result = CliRunner().invoke(main, ["runs"])
    assert result.exit_code == 130
    assert result.output == "interrupted: `kvfid run smoke --resume r1` continues run r1\n"


def _sqlite_failure(tmp_path, limit_pages: bool):
    """The error SQLite itself raises writing a ledger that is full (max_page_count reached, as
    SQLITE_FULL on a full disk) or opened read-only."""
    tmp_path.mkdir()
    db = tmp_path / "l.sqlite"
    with sqlite3.connect(db) as setup:
        setup.execute("CREATE TABLE t (x TEXT)")
    conn = (sqlite3.connect(db) if limit_pages else
            sqlite3.connect(f"file:{db}?mode=ro", uri=True))
    if limit_pages:
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        conn.execute(f"PRAGMA max_page_count={pages}")
    try:
        with conn:
            conn.execute("INSERT INTO t VALUES (?)", ("x" * 100_000,))
    except sqlite3.OperationalError as err:
        return err
    finally:
        conn.close()
    raise AssertionError("the write succeeded")


def test_sqlite_and_os_write_failures_map_to_environment_kinds(tmp_path):
    full = write_failure(_sqlite_failure(tmp_path / "a", True), "l.sqlite")
    assert isinstance(full, DiskFull) and full.exit_code == 3
    assert str(full) == "l.sqlite: disk full (database or disk is full)"
    read_only = write_failure(_sqlite_failure(tmp_path / "b", False), "l.sqlite")
    assert isinstance(read_only, ReadOnly)
    assert "attempt to write a readonly database" in str(read_only)
    assert isinstance(write_failure(OSError(errno.ENOSPC, "No space left"), "f"), DiskFull)
    assert isinstance(write_failure(OSError(errno.EROFS, "Read-only file system"), "f"), ReadOnly)
    assert write_failure(sqlite3.OperationalError("no such table: t"), "f") is None
    assert write_failure(KeyError("x"), "f") is None


def test_a_kernel_refusal_met_inside_a_forward_is_exit_3_not_a_crash():
    """What the checks before compute cannot see in a config (a model passing an additive
    position bias to its attention: inkling_text in transformers 5.24) is refused by the kernel
    during the forward; the Runner reports it as Unavailable (exit 3), never as exit 70."""
    import torch

    from kvfid.protocol.decode import Runner
    from kvfid.kernels import KernelRefusal, hf_native

    class BiasedAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, input_ids, **kwargs):
            q = torch.randn(1, 2, input_ids.shape[1], 8)
            hf_native.kvfid_native_attention(self, q, q, q, None, position_bias=torch.zeros(1),
                                             position_ids=torch.arange(input_ids.shape[1])[None])
            raise AssertionError("the kernel served an additive position bias")

    with pytest.raises(KernelRefusal):                       # the kernel's own refusal ...
        BiasedAttention()(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(Unavailable, match="cannot serve this model: kvfid_native: an additive "
                                          "position bias") as caught:   # ... reported as one
        Runner(BiasedAttention()).full_logits(torch.zeros(1, 3, dtype=torch.long))
    assert caught.value.exit_code == 3
