"""The command line starts without torch, says its version, documents every option and finds a
case by its name; after importing any kvfid subpackage, triton loads with its interpreter selected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvfid import names
from kvfid.cli import main, version
from kvfid.tasks.launch import resolve_case

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "transformers", "numpy")


def _python(code: str, **env) -> dict:
    """Run `code` in a fresh interpreter at the repository root; its last stdout line as JSON."""
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**clean, **env}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_cli_and_asking_for_help_loads_nothing_heavy():
    loaded = _python(
        "import json, sys\n"
        "import kvfid.cli\n"
        "from click.testing import CliRunner\n"
        f"for args in [['--help'], *[[c, '--help'] for c in kvfid.cli.main.commands]]:\n"
        "    assert CliRunner().invoke(kvfid.cli.main, args).exit_code == 0, args\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    assert loaded == []


SUBPACKAGES = ("inputs", "records", "states", "stacks", "tracing", "protocol", "stages", "engines",
               "environment", "diagnoses", "runs", "reports")

# One fresh interpreter imports torch (which loads no triton: the child checks) and forks a child
# per subpackage, so each import starts from a process that has seen no kvfid module and no
# triton, and torch's two seconds of import are paid once, not once per subpackage. Each child
# imports its subpackage, then triton (if the subpackage did not), and reads the switch.
_FORK_EACH = """import json, os, sys
import torch
seen = {}
for package in PACKAGES:
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        before = "triton" in sys.modules or any(m.startswith("kvfid") for m in sys.modules)
        if package:
            __import__("kvfid." + package)
        import triton
        import torch as t
        with os.fdopen(write, "w") as out:
            json.dump([before, os.environ.get("TRITON_INTERPRET"), t.cuda.is_available()], out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as result:
        seen[package] = json.loads(result.read() or "null")
    os.wait()
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def interpreter_selection() -> dict:
    packages = (*SUBPACKAGES, "")      # the control: triton imported without kvfid
    return _python(f"PACKAGES = {packages!r}\n" + _FORK_EACH, CUDA_VISIBLE_DEVICES="")


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_each_subpackage_selects_the_interpreter_before_triton_loads(package, interpreter_selection):
    assert interpreter_selection[package] == [False, "1", False]


def test_control_triton_without_kvfid_leaves_the_interpreter_unselected(interpreter_selection):
    """The check sees a process in which nothing selects the interpreter."""
    assert interpreter_selection[""] == [False, None, False]


def test_version_is_the_distribution_or_setup_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"kvfid {version()}\n"
    assert version() != "unknown" and version()[0].isdigit()


def test_every_option_of_every_command_has_help():
    missing = [f"{name} {param.opts[0]}" for name, command in main.commands.items()
               for param in command.params
               if isinstance(param, click.Option) and not param.help]
    assert missing == []


def test_the_light_names_are_the_registries_names():
    from kvfid.stacks.backends import DTYPES, backend_names
    from kvfid.inputs.models import PRESETS, model_names

    assert tuple(DTYPES) == names.DTYPE_NAMES
    assert backend_names()[:len(names.BACKENDS)] == list(names.BACKENDS)
    assert tuple(PRESETS) == names.PRESET_NAMES and model_names() == list(names.MODEL_NAMES)


def test_a_case_is_found_by_its_name():
    assert resolve_case("smoke") == names.CASES / "smoke.toml"
    assert resolve_case("cases/smoke.toml") == Path("cases/smoke.toml")
    assert "smoke" in names.case_names() and "smollm2-cpu" in names.case_names()


def test_an_unknown_case_name_lists_the_cases_in_one_line(tmp_path):
    result = CliRunner().invoke(main, ["run", "smok", "--db", str(tmp_path / "l.sqlite")])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "unknown case 'smok'" in result.output
    assert "smoke" in result.output and "smollm2-cpu" in result.output
    assert not (tmp_path / "l.sqlite").exists()


def test_kvfid_run_smoke_runs_the_shipped_case(tmp_path):
    result = CliRunner().invoke(main, ["run", "smoke", "--items", "1", "--quiet",
                                       "--db", str(tmp_path / "l.sqlite")])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("run ") and " finished" in result.stdout.splitlines()[0]


@pytest.mark.parametrize("flag, passed", [([], False), (["--allow-different"], True)])
def test_allow_different_reaches_compare(monkeypatch, flag, passed):
    from kvfid.compare import runs as compare

    seen = {}

    def fake(ledgers, a, b, **inputs):
        seen.update(inputs)
        return {"regressed": False}

    monkeypatch.setattr(compare, "compare", fake)
    monkeypatch.setattr(compare, "render_markdown", lambda result: "No regression.")
    result = CliRunner().invoke(main, ["compare", "x", "y", *flag, "--db", "l.sqlite"])
    assert result.exit_code == 0, result.output
    assert seen["allow_different"] is passed
