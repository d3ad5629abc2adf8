"""The red-team's checks as data: mutated case files, damaged ledgers, bad `repro` inputs and
bad output places, and one runner that tells a clean refusal from a traceback or a hang.

`tests/commands/test_redteam.py` asserts the properties on them; `tests/support/redteam_table.py` counts them
(tried / clean / tracebacks / hangs) for the closing note.
"""

from __future__ import annotations

import contextlib
import random
import signal
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

from kvfid.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "cases" / "smoke.toml"
BASELINE = ROOT / "reports" / "baseline-cpu.sqlite"


class Hang(Exception):
    """A command ran past its time limit."""


@dataclass
class Outcome:
    """What one command did: exit code, output, and whether it showed a traceback or hung."""

    args: list
    exit_code: int | None
    output: str
    traceback: bool
    hang: bool

    @property
    def error_lines(self) -> list[str]:
        """The `error:` lines of the output."""
        return [line for line in self.output.splitlines() if line.startswith("error:")]

    def clean_refusal(self, *names: str, codes=(2, 3)) -> bool:
        """Exit 2 or 3 with exactly one error line that names each of `names`."""
        return (self.exit_code in codes and not self.traceback and len(self.error_lines) == 1
                and all(str(n) in self.error_lines[0] for n in names))


@contextlib.contextmanager
def _alarm(seconds: int):
    def stop(*_):
        raise Hang(f"no answer after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def invoke(*args, timeout_s: int = 120) -> Outcome:
    """`kvfid ARGS` in this process (click's runner), bounded in time."""
    args = [str(a) for a in args]
    with _alarm(timeout_s):
        result = CliRunner().invoke(main, args)
    error = result.exception
    hang = isinstance(error, Hang)
    traceback = (not hang and error is not None and not isinstance(error, SystemExit)) or \
        "Traceback" in result.output or "internal error" in result.output
    return Outcome(args, None if hang else result.exit_code, result.output, traceback, hang)


def runs_left(db: Path) -> list[tuple[str, str]]:
    """(id, status) of every run in a ledger file, read without writing it."""
    if not db.is_file() or db.stat().st_size == 0:
        return []
    with contextlib.closing(sqlite3.connect(f"file:{db}?immutable=1", uri=True)) as conn:
        return conn.execute("SELECT id, status FROM runs").fetchall()


# --------------------------------------------------------------------------- case files

_TARGETED = [   # the red-team's named inputs: (what, old text of smoke.toml, new text)
    ("transplant layers 0-99", 'selections = ["all"]', 'selections = ["layers=0-99"]'),
    ("transplant positions", 'selections = ["all"]', 'selections = ["positions=0-99999"]'),
    ("threads 2**40", "threads = 1 ", "threads = 1099511627776 "),
    ("items n 1e9", "n = 3", "n = 1000000000"),
    ("device mps", 'device = "cpu"', 'device = "mps"'),
    ("device bogus", 'device = "cpu"', 'device = "cuda:x"'),
    ("model hf missing", 'model = "tiny-llama"', 'model = "hf:/nonexistent/model"'),
    ("jsonl missing", 'set = "arith"', 'set = "jsonl:/nonexistent.jsonl"'),
    ("jsonl directory", 'set = "arith"', 'set = "jsonl:/tmp"'),
    ("batched huge", '"batched:2"', '"batched:100000"'),
    ("B beyond context", "B = 6", "B = 100000"),
    ("S zero", "S = 6", "S = 0"),
    ("B float", "B = 6", "B = 1.5"),
    ("B string", "B = 6", 'B = "6"'),
    ("transplant pair huge batch", '"live<-prefill"', '"live<-batched:99999"'),
    ("crossing reference bogus", 'reference = "sdpa/bf16"', 'reference = "x/y"'),
]
_VALUES = ["0", "-1", "1", "2", "3", "2147483648", "1099511627776", "1e9", "1.5", "true", "nan",
           "inf", '"x"', '""', "[]", "[1]", '["x"]', "{}", '"all"', '["layers=0-99"]',
           '["positions=0-99999"]', '["layers=1-3+keys"]', '["batched:100000"]', '"cuda:7"',
           '"hf:/nonexistent"', '["live", "chunked:0"]', '"jsonl:"', '[true, false]']
_SMALL_VALID = {"0", "1", "2", "3", '"all"', "[true, false]", '["layers=1-3+keys"]'}


def case_variants(count: int = 200, seed: int = 0) -> list[tuple[str, bytes]]:
    """The targeted inputs, the bad encodings, then `count` seeded random mutations of
    smoke.toml (a value replaced, a line dropped or duplicated, bytes flipped)."""
    base = SMOKE.read_text(encoding="utf-8")
    out = [(what, base.replace(old, new, 1).encode()) for what, old, new in _TARGETED]
    out += [("empty file", b""), ("NUL bytes", b"\x00" * 16), ("binary", bytes(range(256))),
            ("UTF-16", base.encode("utf-16")),
            ("latin-1 byte", base.replace("tiny-llama, 3", "caf\xe9, 3").encode("latin-1")),
            ("not TOML", b"this is [not toml"), ("valid control", base.encode())]
    rng = random.Random(seed)
    lines = base.splitlines()
    settings = [i for i, line in enumerate(lines) if " = " in line and not line.startswith("#")]
    while len(out) < count + len(_TARGETED) + 7:
        new = list(lines)
        kind = rng.choice(["value", "value", "value", "drop", "duplicate", "bytes"])
        i = rng.choice(settings)
        if kind == "value":
            key = new[i].split(" = ")[0]
            value = rng.choice(_VALUES)
            if key.strip() in ("B", "S") and value == "3":
                value = "2"
            new[i] = f"{key} = {value}"
            what = f"{key.strip()} = {value}"
        elif kind == "drop":
            what = f"drop {new.pop(i).split(' = ')[0].strip()}"
        elif kind == "duplicate":
            new.insert(i, new[i])
            what = f"duplicate {new[i].split(' = ')[0].strip()}"
        data = "\n".join(new).encode()
        if kind == "bytes":
            at = rng.randrange(len(data))
            data = data[:at] + bytes([rng.randrange(128, 256)]) + data[at + 1:]
            what = f"byte flip at {at}"
        out.append((f"mutation {len(out)}: {what}", data))
    return out


def run_case_variant(folder: Path, name: str, data: bytes) -> Outcome:
    """Write a variant and `kvfid run` it on one item into its own ledger."""
    case = folder / "case.toml"
    case.write_bytes(data)
    return invoke("run", case, "--db", folder / "ledger.sqlite", "--items", "1", "--quiet")


# --------------------------------------------------------------------------- damaged ledgers

def damaged_ledgers(good: Path, folder: Path) -> list[tuple[str, Path, dict]]:
    """(what, path, {command: expected}) for 19 damaged or unusual ledger files made from `good`
    (a schema 3 ledger holding one tiny run). Expected: `ok` (exit 0), `refused` (exit 3, bytes
    unchanged) or `usage` (exit 2: no file, a directory)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = good.read_bytes()
    rng = random.Random(0)
    made = []

    def file(what, content, read="refused", write="refused", **only):
        path = folder / f"{len(made):02d}" / "ledger.sqlite"
        path.parent.mkdir()
        path.write_bytes(content)
        made.append((what, path, _expected(read, write, only)))
        return path

    def edited(what, sql, read="refused", write="refused", **only):
        path = file(what, data, read, write, **only)
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.executescript(sql)
        return path

    (folder / "missing").mkdir()
    made.append(("missing file", folder / "missing" / "ledger.sqlite",
                 _expected("usage", "ok", {})))
    (folder / "dir" / "ledger.sqlite").mkdir(parents=True)
    made.append(("a directory", folder / "dir" / "ledger.sqlite", _expected("usage", "usage", {})))
    file("0-byte file", b"", "refused", "ok")
    file("text file", b"runs,units\n1,2\n", "refused")
    file("random bytes", rng.randbytes(8192), "refused")
    file("first 50 bytes", data[:50], "refused")
    file("first half", data[: len(data) // 2], "refused")
    middle = len(data) // 2
    file("4 KiB random in the middle", data[:middle] + rng.randbytes(4096) + data[middle + 4096:],
         "refused")
    file("header magic damaged", b"SQLite format 2\x00" + data[16:], "refused")
    edited("user_version 99", "PRAGMA user_version=99;")
    edited("foreign runs table", "DROP TABLE rows; DROP TABLE units; DROP TABLE runs; "
                                 "CREATE TABLE runs (a, b);")
    edited("no rows table", "DROP TABLE rows;")
    edited("schema 2 stamp on schema 1 tables", "ALTER TABLE units DROP COLUMN record_sha; "
                                                "DROP TABLE leases; DROP TABLE engine_checks; "
                                                "PRAGMA user_version=2;")
    edited("damaged record JSON", "UPDATE units SET record = '{' WHERE rowid = 1;",
           runs="ok", run="ok")   # listing and adding runs never read a stored record
    edited("foreign database", "DROP TABLE rows; DROP TABLE units; DROP TABLE runs; "
                               "DROP TABLE leases; DROP TABLE engine_checks; "
                               "PRAGMA user_version=0; "
                               "CREATE TABLE people (name TEXT); INSERT INTO people VALUES ('x');")
    edited("empty SQLite database", "DROP TABLE rows; DROP TABLE units; DROP TABLE runs; "
                                    "DROP TABLE leases; DROP TABLE engine_checks; "
                                    "PRAGMA user_version=0; VACUUM;",
           "refused", "ok")
    edited("schema 1 ledger", "ALTER TABLE units DROP COLUMN record_sha; DROP TABLE leases; "
                              "DROP TABLE engine_checks; PRAGMA user_version=1;", "ok", "ok")
    edited("schema 2 ledger", "DROP TABLE engine_checks; PRAGMA user_version=2;", "ok", "ok")
    file("schema 3 ledger (control)", data, "ok", "ok")
    return made


COMMANDS = ("runs", "show", "report", "audit", "run")


def _expected(read: str, write: str, only: dict) -> dict:
    return {c: only.get(c, write if c == "run" else read) for c in COMMANDS}


def ledger_commands(db: Path, out: Path) -> list[tuple[str, list]]:
    """The five commands the red-team ran on every damaged ledger."""
    return [("runs", ["runs", "--db", db]), ("show", ["show", "latest", "--db", db]),
            ("report", ["report", "latest", "--db", db, "--out", out]),
            ("audit", ["audit", "latest", "--db", db, "--items", "1", "--quiet"]),
            ("run", ["run", SMOKE, "--db", db, "--items", "1", "--quiet"])]


# --------------------------------------------------------------------------- repro inputs

def repro_inputs(folder: Path) -> list[tuple[str, list, tuple]]:
    """(what, args, allowed exit codes) for bad `kvfid repro` inputs and a few good controls."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bad.jsonl").write_text('{"prompt": "x"}\nnot json\n')
    (folder / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (folder / "surrogate.jsonl").write_text('{"prompt": "\\ud800"}\n')
    (folder / "two.jsonl").write_text('{"prompt": "What is 2+2?", "answer": 4}\n{"prompt": "y"}\n')
    for name, config in (("garbage", "{not json"), ("empty", ""), ("weightless",
                         '{"model_type": "llama", "hidden_size": 8}'), ("unknown", "{}")):
        (folder / f"hf-{name}").mkdir(exist_ok=True)
        (folder / f"hf-{name}" / "config.json").write_text(config)
    (folder / "hf-none").mkdir(exist_ok=True)
    base = ["repro", "--model", "tiny-llama", "-B", "2", "-S", "2"]
    p = [*base, "--prompt", "What is 2+2?"]
    usage, env = (2,), (3,)
    cases = [
        ("device mps", [*p, "--device", "mps"], usage), ("device bogus", [*p, "--device", "x"],
                                                         usage),
        ("device cuda:x", [*p, "--device", "cuda:x"], usage),
        ("device cuda:99", [*p, "--device", "cuda:99"], env),
        ("threads 0", [*p, "--threads", "0"], usage), ("threads -1", [*p, "--threads", "-1"], usage),
        ("threads 2**40", [*p, "--threads", str(2 ** 40)], usage),
        ("item 1e8", [*base, "--item-set", "arith", "--item", "100000000"], usage),
        ("item -1", [*base, "--item-set", "arith", "--item", "-1"], usage),
        ("item-set without item", [*base, "--item-set", "arith"], usage),
        ("item past a jsonl's end", [*base, "--item-set", f"jsonl:{folder}/two.jsonl", "--item",
                                     "5"], usage),
        ("jsonl missing", [*base, "--item-set", "jsonl:/nonexistent.jsonl", "--item", "0"], usage),
        ("jsonl directory", [*base, "--item-set", f"jsonl:{folder}", "--item", "0"], usage),
        ("jsonl bad line", [*base, "--item-set", f"jsonl:{folder}/bad.jsonl", "--item", "0"],
         usage),
        ("jsonl not UTF-8", [*base, "--item-set", f"jsonl:{folder}/latin1.jsonl", "--item", "0"],
         usage),
        ("jsonl lone surrogate", [*base, "--item-set", f"jsonl:{folder}/surrogate.jsonl",
                                  "--item", "0"], usage),
        ("item-set unknown", [*base, "--item-set", "csv:x", "--item", "0"], usage),
        ("prompt and item-set", [*p, "--item-set", "arith", "--item", "0"], usage),
        ("neither prompt nor item-set", base, usage),
        ("empty prompt", [*base, "--prompt", ""], usage),
        ("blank prompt", [*base, "--prompt", "   "], usage),
        ("prompt not UTF-8", [*base, "--prompt", "caf\udce9"], usage),
        ("model unknown", [*p, "--model", "gpt-9"], usage), ("model hf:", [*p, "--model", "hf:"],
                                                             usage),
        ("hf missing folder", [*p, "--model", "hf:/nonexistent"], env),
        ("hf no config", [*p, "--model", f"hf:{folder}/hf-none"], env),
        ("hf garbage config", [*p, "--model", f"hf:{folder}/hf-garbage"], env),
        ("hf empty config", [*p, "--model", f"hf:{folder}/hf-empty"], env),
        ("hf weightless config", [*p, "--model", f"hf:{folder}/hf-weightless"], env),
        ("hf config {}", [*p, "--model", f"hf:{folder}/hf-unknown"], env),
        ("transplant layers 0-99", [*p, "--transplant", "live<-prefill:layers=0-99"], usage),
        ("transplant positions", [*p, "--transplant", "live<-prefill:positions=0-99999"], usage),
        ("transplant reversed range", [*p, "--transplant", "live<-prefill:layers=3-1"], usage),
        ("transplant unknown arm", [*p, "--transplant", "live<-bogus"], usage),
        ("transplant no arrow", [*p, "--transplant", "live-prefill"], usage),
        ("arms batched huge", [*p, "--arms", "live,batched:100000"], usage),
        ("arms chunked:0", [*p, "--arms", "live,chunked:0"], usage),
        ("replicas bogus", [*p, "--replicas", "bogus"], usage),
        ("cross int4", [*p, "--cross", "int4"], usage),
        ("B 0", [*p, "-B", "0"], usage), ("S -1", [*p, "-S", "-1"], usage),
        ("B 1e9", [*p, "-B", "1000000000"], usage),
        ("backend x", [*p, "--backend", "x"], usage), ("dtype x", [*p, "--dtype", "x"], usage),
        ("stack x", [*p, "--stack", "x"], usage),
        ("stack and dtype disagree", [*p, "--stack", "sdpa/fp32", "--dtype", "bf16"], usage),
        ("control: prompt", p, (0,)),
        ("control: arith item", [*base, "--item-set", "arith", "--item", "7"], (0,)),
    ]
    return cases


# --------------------------------------------------------------------------- outputs

def output_cases(good: Path, folder: Path) -> list[tuple[str, list, int, int | None]]:
    """(what, args, expected exit, the write that fails with ENOSPC or None) for bad output
    places: under a regular file, in /proc, and a disk that fills at the Nth file written."""
    folder.mkdir(parents=True, exist_ok=True)
    blocker = folder / "a-file"
    blocker.write_text("")
    report = lambda out: ["report", "latest", "--db", good, "--out", out]
    compare = lambda out: ["compare", "latest", "latest", "--db", good, "--out", out,
                           "--reports", folder]
    return [("report under a file", report(blocker / "x"), 2, None),
            ("compare under a file", compare(blocker / "x"), 2, None),
            ("report into /proc", report("/proc/kvfid-reports"), 2, None),
            ("report, disk full at its 2nd file", report(folder / "r2"), 3, 2),
            ("report, disk full at the index", report(folder / "r4"), 3, 4),
            ("compare, disk full at its 3rd file", compare(folder / "c3"), 3, 3),
            ("run --report, disk full", ["run", SMOKE, "--db", folder / "l.sqlite", "--items",
                                         "1", "--quiet", "--report"], 3, 1)]


@contextlib.contextmanager
def disk_full_at(n: int | None):
    """The `n`-th output file written fails half-way with ENOSPC (None: no failure)."""
    from kvfid import outputs

    original, calls = outputs.write_text, []

    def write(path, text):
        calls.append(path)
        if len(calls) == n:
            path.write_text(text[: len(text) // 2])
            raise OSError(28, "No space left on device", str(path))
        original(path, text)

    outputs.write_text = write
    try:
        yield
    finally:
        outputs.write_text = original


def partial_files(folder: Path) -> list[Path]:
    """Temporary or half-written outputs left under `folder`."""
    return [p for p in folder.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
