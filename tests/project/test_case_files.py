"""The shipped case files read as configuration: a comment line or two, then the keys (what
each case is and its size: docs/cases.md)."""

from pathlib import Path

import pytest

CASES = sorted((Path(__file__).resolve().parents[2] / "cases").glob("*.toml"))


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_a_case_file_opens_with_at_most_two_comment_lines_then_its_keys(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    first_key = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert first_key < 5 and all(line.startswith("#") for line in lines[:first_key]), lines[:6]
    assert first_key <= 2, f"{path.name}: {first_key} comment lines before the first key"


def test_every_shipped_case_is_checked():
    assert {p.name for p in CASES} >= {"smoke.toml", "smollm2-cpu.toml", "paper.toml"}
