"""`kvfid`: the command line. Thin: each command parses, calls one library function, prints.

Machine-readable output goes to stdout (`--format json`); logs and progress to stderr. The
commands are declared in kvfid.commands (environment, diagnose, runs) and import the library
only when they run, so `kvfid --help` loads no torch. Exit codes, mapped here in one place from
kvfid.errors: 0 ok, 1 a fidelity or regression verdict failed, 2 usage error or bad input, 3
environment unavailable (130 interrupted, 70 a bug). Every error is one line on stderr;
KVFID_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import click

from kvfid.commands import diagnose, environment, runs
from kvfid.errors import EXIT_INTERNAL, KvfidError

DISTRIBUTION = "kvfid"


def version() -> str:
    """The installed distribution's version, else setup.py's (a checkout run in place)."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        setup = Path(__file__).resolve().parents[1] / "setup.py"
        found = re.search(r'version="([^"]+)"', setup.read_text()) if setup.is_file() else None
        return found.group(1) if found else "unknown"


def _show_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"kvfid {version()}")
        ctx.exit(0)


def _one_line(ctx: click.Context, prefix: str, text: str, code: int) -> None:
    click.echo(f"{prefix}: {text}", err=True)
    ctx.exit(code)


class _Kvfid(click.Group):
    """The `kvfid` group: every KvfidError becomes one line and its exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KvfidError as err:
            if os.environ.get("KVFID_DEBUG") == "1":
                raise
            _one_line(ctx, err.prefix, str(err), err.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as err:    # a bug: still one line, unless KVFID_DEBUG=1
            if os.environ.get("KVFID_DEBUG") == "1":
                raise
            text = " ".join(f"{type(err).__name__}: {err}".split())
            _one_line(ctx, "internal error (a bug in kvfid)",
                      f"{text}; KVFID_DEBUG=1 shows the traceback", EXIT_INTERNAL)


@click.group(cls=_Kvfid, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_show_version, help="Print kvfid's version and exit.")
def main() -> None:
    """kvfid: is a rebuilt KV state the live state? Per kernel, precision and stack."""


for _command in [*environment.COMMANDS, *diagnose.COMMANDS, *runs.COMMANDS]:
    main.add_command(_command)


if __name__ == "__main__":
    main()
