"""The registry walk (tests/support/registry_walk.py) in the suite: every causal-LM family transformers
registers, built tiny where its config allows (tests/support/registry_sizes.py), one short repro on sdpa
and native+bi in fp32 and bf16 (and on triton+bi in the interpreter for the first family of each
set of mechanisms), and kvfid's live arm against transformers' `generate` (tests/support/generate_check.py)
on sdpa/fp32 and native/bf16+bi: the same tokens and bit-identical logits at every step for every
built family a stack serves. It fails on any internal error (exit 70), on any live arm that is
not generate's, and, on the transformers version the expectations were kept on, on any family
worse than `tests/support/registry_walk.json` keeps it (built; on a +bi stack bit-exact, or not
differing; on any stack not differing functionally); an improvement passes. Run in SHARDS parts
so that pytest's workers share it. To keep new outcomes:
`PYTHONPATH=$PWD/tests/support TRITON_INTERPRET=1 python -m registry_walk --expect`.
"""

from __future__ import annotations

import json

import pytest

import registry_walk as rw

SHARDS = 6


def _expected() -> dict:
    return json.loads(rw.EXPECTED.read_text())


def _triton_elsewhere(expected: dict, mine: set[str]) -> set[tuple[str, ...]]:
    """The mechanism sets whose triton run the expectations give a family of another shard:
    this shard runs triton on the first family of each other set, as one walk would."""
    return {tuple(row["mechanisms"]) for family, row in expected["families"].items()
            if rw.TRITON in row and not row[rw.TRITON].startswith("refused") and family not in mine}


@pytest.mark.parametrize("shard", range(SHARDS))
def test_every_registered_family_walks_without_an_internal_error_or_a_regression(shard):
    import transformers

    expected = _expected()
    mine = set(sorted(rw.registry())[shard::SHARDS])
    rows = rw.walk(only=mine, seen=_triton_elsewhere(expected, mine))
    assert {r["family"] for r in rows} == mine
    internal = [f"{r['family']}: {v}" for r in rows for k, v in r.items() if "INTERNAL" in str(v)]
    assert not internal, "internal errors (exit 70):\n" + "\n".join(internal)
    for row in rows:   # every built family has an outcome on every stack
        assert row["built"] != "built" or all(rw.outcome(row.get(s)) for s in rw.STACKS), row
    unlike = [f"{r['family']} on {s}: {r[f'generate {s}']}" for r in rows if r["built"] == "built"
              for s in rw.GENERATE
              if r[f"generate {s}"] != "bit-exact" and not r[f"generate {s}"].startswith("refused")]
    assert not unlike, "the live arm is not generate's:\n" + "\n".join(unlike)
    if expected["transformers"] != transformers.__version__:
        return   # outcomes kept on another version: only the internal errors are checked here
    worse = rw.regressions(rows, expected)
    assert not worse, "worse than tests/support/registry_walk.json keeps:\n" + "\n".join(worse)


def test_a_below_fp32_difference_is_settled_by_its_fp32_twin():
    rounding, functional = "differs by rounding (layer 0 k, d_rel 3e-07)", "differs functionally (x)"
    low = "differs unsettled (layer 1 k, d_rel 7e-03)"
    assert rw.settled(low, "bit-exact").startswith("differs by rounding")
    assert rw.settled(low, rounding).startswith("differs by rounding")
    assert rw.settled(low, functional).startswith("differs functionally")
    assert rw.settled(low, "refused (exit 3): no") == low and rw.settled(low, None) == low
    assert rw.outcome(rw.settled(low, functional)) == "differs functionally"


def test_a_regression_is_told_from_an_improvement():
    expected = {"families": {"a": {"built": "built", "sdpa/fp32": "differs (layer 0 k)",
                                   "native/fp32+bi": "bit-exact"},
                             "b": {"built": "built", "sdpa/fp32": "differs (layer 0 k)",
                                   "native/fp32+bi": "refused (exit 3): no"}}}
    same = [{"family": "a", "built": "built", "sdpa/fp32": "bit-exact", "native/fp32+bi": "bit-exact"},
            {"family": "b", "built": "built", "sdpa/fp32": "differs (layer 1 v)",
             "native/fp32+bi": "bit-exact"}]
    assert rw.regressions(same, expected) == []
    worse = [{"family": "a", "built": "built", "sdpa/fp32": "refused (exit 3): x",
              "native/fp32+bi": "differs (layer 1 k)"},
             {"family": "b", "built": "not built: ValueError: x"}]
    assert len(rw.regressions(worse, expected)) == 2
    functional = [{"family": "a", "built": "built", "sdpa/fp32": "differs functionally (x)",
                   "native/fp32+bi": "bit-exact"}]   # on a stock stack too
    assert len(rw.regressions(functional, expected)) == 1
