"""Comments and docstrings state decisions and invariants, not the lab notebook.

A timing, a measured speed ratio, a git revision or a date in a comment goes stale the day the code
or the machine changes; measurements behind a workaround live in docs/hazards.md, timings in the
generated reports (`kvfid times`). This scans every comment and docstring of harness/ and kernels/
(and the comment lines of the Makefile and .ci/run) for them, with control strings each rule must
flag and near misses it must not.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest


def _root() -> Path:
    here = Path(__file__).resolve()
    return next(p for p in here.parents if (p / "setup.py").is_file() and (p / "harness").is_dir())


ROOT = _root()

# A number with a unit of time ("3.4 s", "57 s", "2 minutes", "12 ms").
TIMING = re.compile(r"(?<![\w.\[])\d+(?:[.,]\d+)?\s?(?:ms|µs|us|ns|s|secs?|seconds?|min|minutes?"
                    r"|hours?|CPU-s)(?![\w-])")
# A measured speed ratio: "costs about 1.2x", "took 30x", "ran 1.5x as long".
RATIO = re.compile(r"\b(?:costs?|took|takes|ran|runs|measured)\s+(?:about\s+)?\d+(?:\.\d+)?x\b")
# A git revision: 7 to 40 hex digits with a digit and a letter, not part of a word or a path.
REVISION = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/])")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
RULES = {"timing": TIMING, "ratio": RATIO, "revision": REVISION, "date": DATE}


def findings(text: str) -> list[str]:
    """The rules `text` breaks, with the matching words: ["timing: 3.4 s", ...]."""
    return [f"{name}: {m.group(0)}" for name, rule in RULES.items() for m in rule.finditer(text)]


def python_notes(path: Path) -> list[tuple[int, str]]:
    """Every comment and docstring line of a Python file, with its line number."""
    source = path.read_text(encoding="utf-8")
    notes = [(tok.start[0], tok.string) for tok in
             tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                notes += [(first.lineno + i, line)
                          for i, line in enumerate(first.value.value.splitlines())]
    return notes


def shell_notes(path: Path) -> list[tuple[int, str]]:
    """The comment lines of a Makefile or a shell script."""
    return [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if line.lstrip().startswith("#") and not line.startswith("#!")]


def violations(files: list[Path], read) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}: {', '.join(found)}: {text.strip()}"
            for path in files for n, text in read(path) if (found := findings(text))]


@pytest.mark.parametrize("text", [
    "# took 3.4 s on the AVX-512 EPYC",
    "# 57 s against 64 s apart",
    "# the suite's 6 minutes",
    "costs about 1.2x one row",
    "measured at 291c1b5, before 5624d02",
    "# since 03c4d94 a compiled stack",
    "on 2026-12-04",
])
def test_each_rule_flags_its_control(text):
    assert findings(text), text


@pytest.mark.parametrize("text", [
    "the 95% Wilson interval",
    "transformers 5.2x passes no `cache_position`",
    "# kvfid within 1.3x of stock",
    "[576, 1536] shapes, 8 warps, 64 rows",
    "sha256 of the record (hashlib.sha256(...).hexdigest())",
    "kvfid.kernels.attention.native",
    "0x7fffffff",
    "`step_s` seconds per planned gap step",
])
def test_near_misses_pass(text):
    assert not findings(text), findings(text)


def test_python_notes_reads_comments_and_docstrings(tmp_path):
    """The reader sees a docstring's later lines and a trailing comment, not a string literal."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""One.\n\nTook 3 s at 291c1b5."""\n\n\ndef f():\n    """Two."""\n'
                      '    x = "12 s"  # 4 ms here\n    return x\n')
    notes = python_notes(sample)
    assert (3, "Took 3 s at 291c1b5.") in notes and (8, "# 4 ms here") in notes
    assert not any("12 s" in text for _, text in notes)
    assert len(violations([sample], python_notes)) == 2


def test_harness_and_kernels_quote_no_timing_or_revision():
    files = sorted((ROOT / "harness").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    assert len(files) > 100
    found = violations(files, python_notes)
    assert not found, ("state the decision and the invariant; move the measurement to "
                       "docs/hazards.md or a report:\n" + "\n".join(found))


def test_makefile_and_ci_comments_quote_no_timing_or_revision():
    found = violations([ROOT / "Makefile", ROOT / ".ci" / "run"], shell_notes)
    assert not found, ("state the decision and the invariant; move the measurement to "
                       "docs/hazards.md or a report:\n" + "\n".join(found))


HAZARD_POINTER = re.compile(r"hazards\.md\)?,?\s*\"([^\"]+)\"")


def hazard_pointers(text: str) -> set[str]:
    """The hazard titles a text points to (`docs/hazards.md, "Title"`), across wrapped comment lines."""
    flat = re.sub(r"\s*\n\s*(?:#+\s*)?", " ", text)
    return {" ".join(title.split()) for title in HAZARD_POINTER.findall(flat)}


def test_every_pointer_to_a_hazard_names_one_that_exists():
    """A comment that moved its measurement to docs/hazards.md names a bullet that holds it."""
    hazards = (ROOT / "docs" / "hazards.md").read_text(encoding="utf-8")
    titles = {" ".join(t.split()).rstrip(".") for t in re.findall(r"^- \*\*(.+?)\*\*", hazards, re.M)}
    assert hazard_pointers('x (docs/hazards.md, "A full\n    # disk").') == {"A full disk"}
    assert "A full disk" in titles and "No such hazard" not in titles   # the control
    files = [*(ROOT / "harness").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"),
             *(ROOT / "tests").rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md",
             ROOT / "Makefile", ROOT / ".ci" / "run"]
    pointed = {(path.relative_to(ROOT), title) for path in files
               if path.resolve() != Path(__file__).resolve()
               for title in hazard_pointers(path.read_text(encoding="utf-8"))}
    assert len(pointed) >= 10
    missing = sorted(f"{path}: {title!r}" for path, title in pointed if title not in titles)
    assert not missing, "no such bullet in docs/hazards.md:\n" + "\n".join(missing)
