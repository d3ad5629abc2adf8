"""One of each in the tests: one builder of tiny models (tests/support/families.py;
tests/support/mode_models.py builds through it) and no block of the attention kernels' tests
written twice (the shared checks live in tests/support/helpers.py)."""

from __future__ import annotations

import ast
import io
import keyword
import tokenize
from pathlib import Path

import torch

import families
import mode_models

TESTS = Path(__file__).resolve().parents[1]
MODE_MODELS = TESTS / "support" / "mode_models.py"
RUN = 6   # lines: a block this long written twice is a repeated block


def shapes(path: Path) -> list[str]:
    """Each code line's shape: names, numbers and strings replaced, so a block copied with other
    names or values still matches; blank lines, comments, docstrings and imports left out."""
    lines: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        text = ("N" if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string) else
                "0" if tok.type == tokenize.NUMBER else "S" if tok.type == tokenize.STRING else tok.string)
        lines.setdefault(tok.start[0], []).append(text)
    shaped = [" ".join(t) for _, t in sorted(lines.items())]
    return [line for line in shaped if line not in ("S", "", ")", "]")
            and not line.startswith(("import ", "from "))]


def repeated_runs(a: Path, b: Path, run: int = RUN) -> list[tuple[str, ...]]:
    """The runs of `run` consecutive code-line shapes that stand in both files."""
    windows = lambda lines: {tuple(lines[i:i + run]) for i in range(len(lines) - run + 1)}
    return sorted(windows(shapes(a)) & windows(shapes(b)))


def test_no_block_of_the_attention_kernel_tests_is_written_twice():
    runs = repeated_runs(TESTS / "attention" / "test_kernel_attention.py",
                         TESTS / "attention" / "test_kernel_attention_native.py")
    assert runs == [], runs[0]


def test_the_check_finds_a_block_copied_with_other_names(tmp_path):
    block = "def f(x):\n    y = x + 1\n    z = y * 2\n    if z:\n        w = z - y\n    return w\n"
    (tmp_path / "a.py").write_text(block)
    (tmp_path / "b.py").write_text(block.replace("y", "u").replace("1", "7"))
    assert repeated_runs(tmp_path / "a.py", tmp_path / "b.py")


def test_mode_models_come_from_the_one_builder():
    """mode_models constructs no config or model itself: its models are families'."""
    calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
             for node in ast.walk(ast.parse(MODE_MODELS.read_text(encoding="utf-8")))
             if isinstance(node, ast.Call)}
    assert not {c for c in calls if c.endswith("Config") or c in ("from_config", "from_pretrained")}
    assert "model" in calls
    ours, theirs = mode_models.build("qwen3_moe", dtype=torch.float32), families.model("qwen3-moe")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
