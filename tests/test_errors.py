"""The one error hierarchy: each kind's exit code, one line on stderr, the traceback only with
KVFID_DEBUG=1, and an unexpected exception reported as a bug (exit 70), never as a verdict."""

import pytest
from click.testing import CliRunner

from harness.tasks import ledger_views
from harness.runs.case import CaseError
from harness.cli import main
from harness.errors import BadInput, OutputError, Unavailable
from harness.runs.ledger import LedgerError
from harness.runs.ledger_file import LedgerRefused
from harness.protocol.models import ModelUnavailable


@pytest.mark.parametrize("error,code", [
    (BadInput("bad\ninput"), 2), (CaseError("c.toml: [items] n"), 2), (LedgerError("no run"), 2),
    (Unavailable("no GPU"), 3), (LedgerRefused("l.sqlite: foreign"), 3),
    (ModelUnavailable("hf:x"), 3), (OutputError("full", 3), 3), (OutputError("denied"), 2),
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
    from harness.errors import Interrupted

    def stop(db):
        raise Interrupted("`kvfid run smoke --resume r1` continues run r1")

    monkeypatch.setattr(ledger_views, "list_runs", stop)
    result = CliRunner().invoke(main, ["runs"])
    assert result.exit_code == 130
    assert result.output == "interrupted: `kvfid run smoke --resume r1` continues run r1\n"
