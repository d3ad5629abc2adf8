"""Case files: one matrix run's design as data (TOML -> frozen dataclasses), validated on load.

A case names the model, the item set, B and S, the stacks, the constructions, replicas, the
precision crossing and the transplants (`[[stacks]]`: several products of stacks, each on its
first `items` items). `load_case(path)` refuses a bad file before any compute with a
`CaseError` naming the file, the key, the bad value and the allowed ones; `parse_case` does the
same for case text stored in the ledger. A `[program]` case (kvfid.runs.case_program) measures a
stage program per unit. `Case.plan(index)` gives the `ItemPlan` for
one item, so the run loop never reads TOML.

Transplants are measured on every item (the protocol runs them with the arms); which rows count
is fixed before any result: all divergent rows, plus as controls the exact rows among a seeded
sample of item indices (`Transplants.control_indices`), which the run records.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from kvfid.stacks.backends import DTYPES, backend_names
from kvfid.stacks.stack import Stack, parse_stack
from kvfid.runs.case_fields import CaseError, Validator
from kvfid.runs.case_program import KEYS as PROGRAM_KEYS, ProgramCase, read_program
from kvfid.runs.case_stacks import stack_groups, stack_tables
from kvfid.checks import count_reason
from kvfid.protocol.constructions import construction_reason, parse_construction
from kvfid.inputs.items import item_set_reason, load_item_set
from kvfid.diagnoses.rescore import ALLOWED as REPLAY_ALLOWED
from kvfid.inputs.models import PRESETS, model_names
from kvfid.protocol.protocol import (CONSTRUCTION_HELP, ItemPlan, ProtocolError, TransplantSpec,
                              parse_transplant)


@dataclass(frozen=True)
class ItemSpec:
    """Which items: an item-set spec (`arith`, `arith-easy`, `jsonl:<path>`), how many, and the
    seed. A jsonl set without `n` runs every item of its file, counted when the case loads."""

    set: str
    n: int
    seed: int = 0


@dataclass(frozen=True)
class Replicas:
    """Arms run twice, on the first `items` items (None: all)."""

    arms: tuple[str, ...] = ()
    items: int | None = None

    def applies(self, index: int) -> bool:
        return bool(self.arms) and (self.items is None or index < self.items)


@dataclass(frozen=True)
class Crossing:
    """Fixed-prefix precision crossing: P frozen from `reference`'s live run, then each
    construction built over it in the reference stack at each dtype."""

    reference: Stack
    dtypes: tuple[str, ...]
    constructions: tuple[str, ...] = ("incremental", "prefill")
    items: int | None = None

    @property
    def stacks(self) -> tuple[Stack, ...]:
        return tuple(self.reference.with_dtype(d) for d in self.dtypes)

    def applies(self, index: int) -> bool:
        return self.items is None or index < self.items


@dataclass(frozen=True)
class Transplants:
    """Transplant specs (pairs x selections) and the rule that picks exact control rows."""

    specs: tuple[TransplantSpec, ...]
    controls: int = 0
    seed: int = 0

    def control_indices(self, n_items: int) -> tuple[int, ...]:
        """A seeded sample of item indices, fixed before any result; the exact rows among
        them are the controls (divergent ones count as divergent)."""
        k = min(self.controls, n_items)
        return tuple(sorted(random.Random(self.seed).sample(range(n_items), k)))


@dataclass(frozen=True)
class Replay:
    """A replay case's trajectories (a JSONL file of token ids, read like a `jsonl:` item set:
    relative to the working directory) and the constructions that re-score them."""

    trajectories: str
    constructions: tuple[str, ...] = ("prefill",)


@dataclass(frozen=True)
class Case:
    """One matrix run's design. `text` and `sha` are the file as written (stored with the run)."""

    name: str
    description: str
    model: str
    items: ItemSpec
    B: int
    S: int
    constructions: tuple[str, ...]
    stacks: tuple[Stack, ...]
    replicas: Replicas = Replicas()
    crossing: Crossing | None = None
    transplants: Transplants | None = None
    ignore_eos: bool = False
    source: str = ""
    text: str = ""
    sha: str = ""
    stack_items: tuple[int | None, ...] = ()  # per stack: only the first N items (None: all)
    replay: Replay | None = None              # a replay case: its units are (stack, trajectory)
    program: ProgramCase | None = None        # a program case: each unit one stage program

    def stack(self, label: str) -> Stack:
        """The stack with this label. A label stored before the thread count joined stack labels
        (`sdpa/bf16` for `sdpa/bf16@t1`) names the same stack; KeyError when none matches."""
        for exact in (True, False):
            for stack in self.stacks:
                if label == (stack.label if exact else stack.label.partition("@t")[0]):
                    return stack
        raise KeyError(label)

    def plan(self, index: int) -> ItemPlan:
        """The protocol plan for item `index`."""
        control = bool(self.transplants) and index in self.transplants.control_indices(
            self.items.n)
        return ItemPlan(self.B, self.S, self.constructions,
                        self.replicas.arms if self.replicas.applies(index) else (),
                        self.transplants.specs if self.transplants else (),
                        transplant_rows="all" if control else "divergent", ignore_eos=self.ignore_eos)

    def takes(self, stack: Stack, index: int) -> bool:
        """Whether the matrix measures item `index` on `stack`."""
        limit = self.stack_items[self.stacks.index(stack)] if self.stack_items else None
        return limit is None or index < limit

    def with_item_count(self, n: int) -> "Case":
        """The same case on its first `n` items (`kvfid run --items N`)."""
        if count_reason(n) is not None:
            raise CaseError(f"{self.source}: --items = {n} is not allowed; {count_reason(n)}")
        return replace(self, items=replace(self.items, n=n))

    @property
    def world(self) -> int:
        """How many ranks the case runs on: the largest TP size of its stacks and arms
        (`@tpN`), the crossing's stacks included."""
        crossing = self.crossing.stacks if self.crossing else ()
        arms = [parse_construction(a).at for a in self.constructions]
        return max([s.tp for s in (*self.stacks, *crossing)] + [int(a[2:]) for a in arms if a])

    @property
    def unit_labels(self) -> tuple[str, ...]:
        """The stack labels of the matrix, plus `crossing` when the case has one."""
        return tuple(s.label for s in self.stacks) + (("crossing",) if self.crossing else ())

    def design(self) -> dict:
        """What the run fixes before any result: counts and the transplant control sample."""
        n = self.items.n
        crossing_items = 0
        if self.crossing:
            crossing_items = n if self.crossing.items is None else min(n, self.crossing.items)
        stack_units = sum(sum(self.takes(s, i) for i in range(n)) for s in self.stacks)
        out = {"items": n, "stacks": [s.label for s in self.stacks],
               "crossing_items": crossing_items,
               "units": stack_units + crossing_items, "control_indices": []}
        if self.transplants:
            out["control_indices"] = list(self.transplants.control_indices(self.items.n))
        return out


# --------------------------------------------------------------------------- loading

_TOP = {"name", "description", "model", "B", "S", "constructions", "items", "stacks",
        "replicas", "crossing", "transplants", "ignore_eos", "replay", "program"}
_NOT_REPLAY = ("B", "S", "constructions", "items", "replicas", "crossing", "transplants",
               "ignore_eos")
_TABLES = {
    "items": {"set", "n", "seed"},
    "stacks": {"backends", "dtypes", "batch_invariant", "faithful_recurrence", "compile", "device", "threads", "items", "tp"},
    "replicas": {"arms", "items"},
    "crossing": {"reference", "dtypes", "constructions", "items"},
    "transplants": {"pairs", "selections", "controls", "seed"},
    "replay": {"trajectories", "constructions"},
    "program": PROGRAM_KEYS,
}


def load_case(path: str | Path) -> Case:
    """Read and validate a case file; CaseError names the file, key, value and what is allowed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise CaseError(f"{path}: cannot read the case file ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise CaseError(f"{path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                        f"{err.start}); a case file is UTF-8 TOML") from None
    return parse_case(text, str(path))


def parse_case(text: str, source: str = "<case>", item_count: int | None = None) -> Case:
    """Validate case TOML text (a file's, or one stored in the ledger). `item_count`: the count a
    stored run ran, so a jsonl set without `n` is not counted again from a file that may be gone."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise CaseError(f"{source}: not valid TOML ({err})") from None
    v = Validator(source, _TABLES)
    v.keys(data, _TOP, "")
    for table, allowed in _TABLES.items():
        if table in data:
            for t in stack_tables(v, data) if table == "stacks" else [v.table(data, table)]:
                v.keys(t, allowed, table)

    model = v.required(data, "", "model", str)
    if model not in PRESETS and not (model.startswith("hf:") and len(model) > 3):
        v.fail("", "model", model, ", ".join(model_names()))
    if "replay" in data:
        return _replay_case(v, data, text, source, model, item_count)
    B, S = 0 if "program" in data else v.positive(data, "", "B"), v.positive(data, "", "S")
    constructions = v.constructions(data, "", "constructions", ["live", "prefill", "incremental"])

    items_table = v.table(data, "items")
    item_set = v.check("items", "set", v.required(items_table, "items", "set", str), item_set_reason)
    items = ItemSpec(item_set, _item_count(v, items_table, item_set, item_count),
                     v.integer(items_table, "items", "seed", 0))

    stacks, stack_items = stack_groups(v, data)
    replicas = Replicas()
    if "replicas" in data:
        t = data["replicas"]
        replicas = Replicas(v.constructions(t, "replicas", "arms", None),
                            v.item_count(t, "replicas", "items"))
    program = (read_program(v, data, constructions, replicas.arms) if "program" in data else None)
    crossing = _crossing(v, data["crossing"], stacks[0]) if "crossing" in data else None
    transplants = (_transplants(v, data["transplants"]) if "transplants" in data and not program
                   else None)

    name = v.optional(data, "", "name", str, Path(source).stem)
    return Case(name, v.optional(data, "", "description", str, ""), model, items, B, S,
                constructions, stacks, replicas, crossing, transplants,
                ignore_eos=v.optional(data, "", "ignore_eos", bool, False), source=source, text=text,
                sha=hashlib.sha256(text.encode()).hexdigest(), stack_items=stack_items,
                program=program)


def _replay_case(v: "Validator", data: dict, text: str, source: str, model: str,
                 stored: int | None) -> Case:
    """A replay case: [replay] and the stacks; no live protocol, so no B, S, items or arms."""
    for key in _NOT_REPLAY:
        if key in data:
            raise CaseError(f"{source}: key {key!r} does not apply to a replay case (one with "
                            f"[replay]); its units are (stack, trajectory)")
    t = v.table(data, "replay")
    path = v.required(t, "replay", "trajectories", str)
    if not path:
        v.fail("replay", "trajectories", path, "the path of a JSONL file of trajectories")
    constructions = v.constructions(t, "replay", "constructions", ["prefill"])
    for c in constructions:
        if not parse_construction(c).rescores:
            v.fail("replay", "constructions", c, REPLAY_ALLOWED)
    n = stored if stored is not None else _count_lines(v, path)
    stacks, stack_items = stack_groups(v, data)
    return Case(v.optional(data, "", "name", str, Path(source).stem),
                v.optional(data, "", "description", str, ""), model,
                ItemSpec(f"trajectories:{path}", n), 0, 0, (), stacks, source=source, text=text,
                sha=hashlib.sha256(text.encode()).hexdigest(), stack_items=stack_items,
                replay=Replay(path, constructions))


def _count_lines(v: "Validator", path: str) -> int:
    """The trajectories a replay case runs: the file's non-blank lines (each is read, and refused
    naming its line, when the run loads them with the model's codec)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise CaseError(f"{v.source}: [replay] trajectories = {path!r}: cannot read it ({err})"
                        ) from None
    return v.check("replay", "trajectories", sum(bool(x.strip()) for x in lines), count_reason)


def _item_count(v: "Validator", t: dict, item_set: str, stored: int | None) -> int:
    """`[items] n`; without it a jsonl set counts its file's items (a generated set has no end)."""
    if "n" not in t and not item_set.startswith("jsonl:"):
        raise CaseError(f"{v.source}: missing key [items] n (how many items; a generated set has "
                        f"no end, a jsonl set without n runs every item of its file)")
    if "n" in t:
        return v.check("items", "n", v.positive(t, "items", "n"), count_reason)
    if stored is not None:
        return stored
    try:
        n = len(load_item_set(item_set))
    except ValueError as err:
        raise CaseError(f"{v.source}: [items] set = {item_set!r}: {err}") from None
    return v.check("items", "n", n, count_reason)


def _crossing(v: "Validator", t: dict, like: Stack) -> Crossing:
    """The crossing's reference stack runs on the matrix's device and thread count."""
    text = v.required(t, "crossing", "reference", str)
    try:
        reference = parse_stack(text, like.device, like.threads)
    except ValueError as err:
        v.fail("crossing", "reference", text, f"BACKEND/DTYPE[+bi] with BACKEND in "
               f"{', '.join(backend_names())} and DTYPE in {', '.join(DTYPES)} ({err})")
    constructions = v.constructions(t, "crossing", "constructions", ["incremental", "prefill"])
    if len(constructions) != 2 or any(parse_construction(c).regenerates
                                      or parse_construction(c).needs_neighbours
                                      for c in constructions):
        v.fail("crossing", "constructions", list(constructions),
               'exactly two constructions other than live and cobatched, e.g. ["incremental", "prefill"]')
    return Crossing(reference, v.choices(t, "crossing", "dtypes", list(DTYPES), None),
                    constructions, v.item_count(t, "crossing", "items"))


def _transplants(v: "Validator", t: dict) -> Transplants:
    """Every pair with every selection; each pair and selection checked on its own."""
    pairs = v.strings(t, "transplants", "pairs", None)
    selections = v.strings(t, "transplants", "selections", ["all"])
    for pair in pairs:
        try:
            spec = parse_transplant(f"{pair}:all")
        except ProtocolError as err:
            v.fail("transplants", "pairs", pair, f"RECIPIENT<-DONOR, each one of "
                   f"{CONSTRUCTION_HELP} (selections go in `selections`) ({err})")
        for arm in (spec.recipient, spec.donor):
            v.check("transplants", "pairs", arm, construction_reason)
    for selection in selections:
        try:
            parse_transplant(f"live<-prefill:{selection}")
        except ProtocolError as err:
            v.fail("transplants", "selections", selection, str(err))
    specs = [parse_transplant(f"{pair}:{selection}")
             for pair, selection in itertools.product(pairs, selections)]
    return Transplants(tuple(dict.fromkeys(specs)),
                       v.integer(t, "transplants", "controls", 0, minimum=0),
                       v.integer(t, "transplants", "seed", 0))


def stored_case(run) -> Case:
    """The case a ledger run ran: its stored text, on its stored item count."""
    case = parse_case(run.case_text, f"{run.case_source} (as stored with run {run.id})",
                      run.item_count)
    return case.with_item_count(run.item_count)
