"""README and docs/: every command shown is a real command with real options, every link
resolves inside the repository, and nothing points outside it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from kvfid.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Options documented as part of issue 10 while another change adds them to the CLI; once
# harness/cli.py has them this set must be emptied (the test then checks them like any other).
PENDING: set = set()   # (command, option) a page may show before it exists; none now


def shown_commands(text: str) -> list[list[str]]:
    """`kvfid ...` lines (and `torchrun ... -m kvfid.cli ...`) of the code blocks, continuation
    lines joined, and `kvfid ...` code spans of the prose, as argument lists without the program
    name (a placeholder such as `kvfid COMMAND --help` is left out)."""
    commands = [shlex.split(span)[1:] for span in re.findall(r"(?<!`)`(kvfid [^`]+)`", text)
                if not span.split()[1].isupper()]
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        lines = block.replace("\\\n", " ").splitlines()
        if any(line.startswith("$ ") for line in lines):    # a session: the rest is output
            lines = [line for line in lines if line.startswith("$ ")]
        for line in lines:
            line = line.removeprefix("$ ").strip()
            if line.startswith("kvfid "):
                commands.append(shlex.split(line, comments=True)[1:])
            elif " -m kvfid.cli " in line:
                commands.append(shlex.split(line.split(" -m kvfid.cli ", 1)[1], comments=True))
    return commands


def test_pages_show_commands():
    assert len([c for page in PAGES for c in shown_commands(page.read_text())]) >= 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_shown_command_and_option_exists(page):
    for args in shown_commands(page.read_text()):
        if args[0].startswith("-"):                         # `kvfid --help`, `kvfid --version`
            assert args[0] in {p.opts[0] for p in main.params} | {"--help"} \
                or ("", args[0]) in PENDING, f"{page.name}: kvfid {args[0]}"
            continue
        name, rest = args[0], args[1:]
        assert name in main.commands, f"{page.name}: `kvfid {name}` is not a command"
        command = main.commands[name]
        options = {o for p in command.params if isinstance(p, click.Option)
                   for o in p.opts + p.secondary_opts} | {"-h", "--help"}
        for arg in rest:
            if arg.startswith("-") and not re.fullmatch(r"-\d.*", arg):
                option = arg.split("=", 1)[0]
                assert option in options or (name, option) in PENDING, \
                    f"{page.name}: `kvfid {name}` has no option {option}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve_inside_the_repository(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path = (page.parent / target).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"{page.name}: broken link {target}"
    for outside in ("../shared", "DESIGN.md", "STYLE.md", "/work/"):
        assert outside not in text, f"{page.name} refers to {outside}, outside the repository"


def module_purposes(root: Path) -> dict[str, str | None]:
    """Each module of harness/ and kernels/ and the first line of what it says it holds."""
    import ast

    return {str(p.relative_to(root)): (ast.get_docstring(ast.parse(p.read_text())) or "").strip()
            .split("\n")[0] or None
            for folder in ("harness", "kernels") for p in sorted((root / folder).rglob("*.py"))}


def test_every_module_opens_with_what_it_holds():
    """docs/architecture.md is the map (floors, rooms, where a change goes); each file's purpose
    is its own docstring, so it cannot drift from a copy."""
    silent = [path for path, said in module_purposes(ROOT).items() if said is None]
    assert not silent, silent


def test_control_a_module_without_a_docstring_is_named(tmp_path):
    (tmp_path / "harness").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "harness" / "said.py").write_text('"""What it holds."""\n')
    (tmp_path / "harness" / "silent.py").write_text("x = 1\n")
    assert module_purposes(tmp_path) == {"harness/said.py": "What it holds.",
                                         "harness/silent.py": None}
