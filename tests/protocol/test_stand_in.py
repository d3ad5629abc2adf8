"""A construction added through the public type only (`kvfid.Construction`: a subclass with its
`read` and how it feeds P) runs everywhere a built-in one does: in `repro` (the command line),
in a case file (`kvfid run`) and through the Python API, with nothing else changed. Control: a
stand-in that feeds P's two halves in the wrong order is caught (its state differs from live)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
from click.testing import CliRunner

import kvfid
from kvfid.cli import main
from kvfid.ledger.store import Ledger
from kvfid.protocol.constructions import Construction, ProtocolError, parse_construction

FAITHFUL = "native/fp32+bi@t1"   # every construction bit-exact with live on it


@dataclass(frozen=True, kw_only=True)
class Halves(kvfid.Construction):
    """P fed in two forward calls: its first half, then the rest."""

    kind: ClassVar[str] = "halves"

    def chunk_sizes(self, prompt_length: int, prefix_length: int) -> list[int]:
        return [prefix_length // 2, prefix_length - prefix_length // 2]


@dataclass(frozen=True, kw_only=True)
class Swapped(kvfid.Construction):
    """The control: P's second half fed before its first (a wrong construction)."""

    kind: ClassVar[str] = "swapped"

    def build(self, runner, at, prompt_length, prefix, vocab_size, layout=None):
        half = len(prefix) // 2
        logits, acceptance, at = Halves().build(runner, at, prompt_length,
                                                prefix[half:] + prefix[:half], vocab_size)
        return logits, acceptance, at


def test_the_stand_in_is_parsed_by_the_one_parser():
    assert parse_construction("halves") == Halves() and Halves().label == "halves"
    assert parse_construction("halves@tp1").label == "halves@tp1"
    assert isinstance(kvfid.parse_construction("halves"), Construction)
    with pytest.raises(ProtocolError, match="unknown arm 'halvesx'"):
        parse_construction("halvesx")


def test_the_stand_in_runs_in_repro_on_the_command_line():
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--prompt", "What is 2+2?",
                                       "--stack", FAITHFUL, "-B", "5", "-S", "3", "--ignore-eos",
                                       "--constructions", "live,halves,swapped",
                                       "--expect", "bit-exact", "--format", "json"])
    assert result.exit_code == 1, result.output   # swapped diverges: the verdict fails
    shown = json.loads(result.stdout)
    compared = {c["b"]: c for c in shown["comparisons"]}
    assert compared["halves"]["cache"]["bit_exact"] and compared["halves"]["suffix"]["identical"]
    assert not compared["swapped"]["cache"]["bit_exact"]


def test_the_stand_in_runs_through_the_api_as_a_value_and_as_a_label():
    options = dict(stack=FAITHFUL, boundary=5, suffix=3, ignore_eos=True)
    by_value = kvfid.repro("tiny-llama", "What is 2+2?", constructions=[parse_construction("live"),
                                                                        Halves()], **options)
    by_label = kvfid.repro("tiny-llama", "What is 2+2?", constructions=["live", "halves"],
                           **options)
    assert by_value.verdict == kvfid_bit_exact() == by_label.verdict
    assert by_value.record.arms["halves"].cache_sha == by_label.record.arms["halves"].cache_sha
    assert by_value.record.arms["halves"].forward_calls == 2 + 2   # two halves, then S - 1 steps
    wrong = kvfid.repro("tiny-llama", "What is 2+2?", constructions=["live", Swapped()], **options)
    assert wrong.verdict == "diverges"
    with pytest.raises(TypeError, match="sequence"):
        kvfid.repro("tiny-llama", "hi", constructions="live,halves", **options)


def kvfid_bit_exact() -> str:
    from kvfid.names import BIT_EXACT

    return BIT_EXACT


CASE = """
name = "stand-in"
model = "tiny-llama"
B = 5
S = 3
ignore_eos = true
constructions = ["live", "halves", "swapped"]

[items]
set = "arith"
n = 1
seed = 0

[stacks]
backends = ["native"]
dtypes = ["fp32"]
batch_invariant = [true]
device = "cpu"
threads = 1

[replicas]
arms = ["halves"]
"""


def test_the_stand_in_runs_in_a_case(tmp_path):
    path, db = tmp_path / "stand-in.toml", tmp_path / "l.sqlite"
    path.write_text(CASE)
    result = CliRunner().invoke(main, ["run", str(path), "--db", str(db), "--quiet"])
    assert result.exit_code == 0, result.output
    with Ledger(db) as ledger:
        (unit,) = [u for u in ledger.units(ledger.run("latest").id) if u.status == "ok"]
    record = unit.record
    assert {"live", "halves", "swapped"} <= set(record.arms)
    compared = {c.b: c for c in record.comparisons}
    assert compared["halves"].bit_exact and not compared["swapped"].bit_exact
    (replica,) = record.replicas
    assert replica.construction == "halves" and replica.comparison.bit_exact
