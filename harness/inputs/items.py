"""Item sets: the prompts a case runs, and the deterministic matcher that scores answers.

An item is one prompt (text, before the chat template) with an optional reference answer. This
module owns the built-in arithmetic set (generated from a seed, so it needs no data files), the
JSON Lines loader for user sets, the `arith` / `jsonl:<path>` spec that case files name, and
`match_answer`, the one rule by which an arm's suffix is judged right or wrong.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from kvfid.checks import MAX_ITEMS, prompt_reason

ARITH_DEFAULT_N = 50  # `arith` without n: small enough for CPU runs of a real model


@dataclass(frozen=True)
class Item:
    id: str
    prompt: str
    answer: str | None = None


# --- built-in arithmetic set -------------------------------------------------------------------

_NAMES = ("Tom", "Ana", "Ravi", "Mei", "Omar", "Lena", "Kofi", "Sara", "Ivan", "Yuki")


def _direct(rng: random.Random) -> tuple[str, int]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        return f"What is {a}*{b}?", a * b
    if kind == 1:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return f"What is {a} + {b}?", a + b
    if kind == 2:
        a, b = rng.randint(10, 500), rng.randint(10, 500)
        return f"What is {a} - {b}?", a - b  # may be negative: the matcher reads a minus sign
    if kind == 3:
        a, b, c = rng.randint(2, 60), rng.randint(2, 20), rng.randint(2, 20)
        return f"What is {a} + {b} * {c}?", a + b * c
    a, b, c = rng.randint(11, 40), rng.randint(3, 30), rng.randint(1, 99)
    return f"What is {a}*{b} - {c}?", a * b - c


def _word(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(_NAMES)
    kind = rng.randrange(5)
    if kind == 0:
        per_box, boxes = rng.randint(6, 24), rng.randint(3, 12)
        given = rng.randint(1, per_box * boxes - 1)
        return (f"A box holds {per_box} pencils. {name} buys {boxes} boxes and gives away {given} "
                f"pencils. How many pencils does {name} have left?", per_box * boxes - given)
    if kind == 1:
        have, bags, per_bag = rng.randint(2, 30), rng.randint(2, 9), rng.randint(3, 15)
        return (f"{name} has {have} apples and buys {bags} bags with {per_bag} apples in each bag. "
                f"How many apples does {name} have now?", have + bags * per_bag)
    if kind == 2:
        speed, hours, extra = rng.randint(40, 120), rng.randint(2, 8), rng.randint(5, 90)
        return (f"A train travels at {speed} km per hour for {hours} hours, then {extra} km more. "
                f"How many km does it travel in total?", speed * hours + extra)
    if kind == 3:
        weekly, weeks = rng.randint(5, 60), rng.randint(3, 20)
        spent = rng.randint(1, weekly * weeks - 1)
        return (f"{name} saves {weekly} dollars every week for {weeks} weeks, then spends "
                f"{spent} dollars on a bike. How many dollars does {name} have left?",
                weekly * weeks - spent)
    size, groups = rng.randint(2, 12), rng.randint(3, 40)
    return (f"A class of {size * groups} students is split into groups of {size}. "
            f"How many groups are there?", groups)


_THINGS = ("apples", "books", "pencils", "marbles", "stickers", "cards")


def _easy(rng: random.Random) -> tuple[str, int]:
    """One addition of two one-digit numbers in a sentence: SmolLM2-135M answers it in a sentence
    of 15-28 tokens, so the answer falls after a boundary of about 12 tokens."""
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    verb = rng.choice(("buys", "gets"))
    return (f"{name} has {a} {things} and {verb} {b} more {things}. "
            f"How many {things} does {name} have now?", a + b)


def arith_items(n: int, seed: int = 0, easy: bool = False) -> list[Item]:
    """n arithmetic and two-step word problems with integer answers, deterministic in seed.

    Items are drawn one after another from random.Random(seed), skipping repeated prompts, so
    arith_items(k, s) is a prefix of arith_items(n, s) for k <= n. `easy`: one-step additions of
    one-digit numbers only (the `arith-easy` set), which a 135M model gets right often enough
    for correctness to be a signal.
    """
    if n < 0:
        raise ValueError(f"arith_items needs n >= 0, got {n}")
    rng = random.Random(seed)
    items, seen = [], set()
    while len(items) < n:
        make = _easy if easy else _word if rng.random() < 0.5 else _direct
        prompt, answer = make(rng)
        if prompt in seen:  # a repeated item would count twice in every rate
            continue
        seen.add(prompt)
        prefix = "arith-easy" if easy else "arith"
        items.append(Item(id=f"{prefix}-{len(items):04d}", prompt=prompt, answer=str(answer)))
    return items


# --- JSON Lines sets ---------------------------------------------------------------------------

_JSONL_KEYS = ("id", "prompt", "answer")


def jsonl_items(path: str | Path) -> list[Item]:
    """Items from a JSON Lines file: one object per line with `prompt`, optional `answer` and `id`.

    Blank lines are skipped; the default id is `jsonl-<line number>`; an answer must be a number.
    A bad line raises ValueError naming the file and line.
    """
    items, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            item = _parse_line(line, f"{path}:{lineno}", default_id=f"jsonl-{lineno}")
            if item.id in seen:
                raise ValueError(f"{path}:{lineno}: id {item.id!r} already used "
                                 f"on line {seen[item.id]}")
            seen[item.id] = lineno
            items.append(item)
    return items


def _parse_line(line: str, where: str, default_id: str) -> Item:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_JSONL_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {list(_JSONL_KEYS)}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: `prompt` is required and must be a non-empty string")
    if prompt_reason(prompt) is not None:
        raise ValueError(f"{where}: `prompt` {prompt_reason(prompt)}")
    answer = _text_field(obj, "answer", where, None)
    if answer is not None and _reference(answer) is None:
        # Refused here, not mid-run: match_answer compares numbers only.
        raise ValueError(f"{where}: `answer` {answer!r} is not a number; "
                         f"leave it out for items that are not scored")
    return Item(id=_text_field(obj, "id", where, default_id), prompt=prompt, answer=answer)


def _text_field(obj: dict, key: str, where: str, default: str | None) -> str | None:
    """A string or integer field as a string (JSON `42` and `"42"` mean the same answer)."""
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{where}: `{key}` must be a string or an integer, got {value!r}")
    return str(value)


# --- specs -------------------------------------------------------------------------------------

ITEM_SETS = ("arith", "arith-easy", "jsonl:<path>")


def item_set_reason(spec: str) -> str | None:
    """Why spec names no item set (None when it names one): what case files and options check."""
    if spec in ("arith", "arith-easy") or (spec.startswith("jsonl:") and spec[len("jsonl:"):]):
        return None
    return f"allowed: {', '.join(ITEM_SETS)}"


def load_item_set(spec: str, n: int | None = None, seed: int = 0) -> list[Item]:
    """Load an item set by spec: `arith`, `arith-easy` (seeded, n items) or `jsonl:<path>`
    (the first n lines' items, or every item when n is None).

    For the generated sets n defaults to ARITH_DEFAULT_N; a jsonl set with fewer than n items is
    an error.
    """
    if n is not None and not 0 <= n <= MAX_ITEMS:
        raise ValueError(f"item count {n} is not allowed; allowed: 0 to {MAX_ITEMS}")
    if item_set_reason(spec) is not None:
        raise ValueError(f"unknown item set {spec!r}; valid forms: {', '.join(ITEM_SETS)}")
    if spec in ("arith", "arith-easy"):
        return arith_items(ARITH_DEFAULT_N if n is None else n, seed, easy=spec == "arith-easy")
    path = spec[len("jsonl:"):]
    try:
        items = jsonl_items(path)
    except OSError as err:
        raise ValueError(f"{path}: cannot read the item set ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte at offset {err.start})") from None
    if n is None:
        return items
    if n > len(items):
        raise ValueError(f"{path} has {len(items)} items, fewer than the {n} asked for")
    return items[:n]


# --- matcher -----------------------------------------------------------------------------------

# A number: optional minus (ASCII or U+2212) not glued to a preceding word or digit, so `3-5`
# reads as 3 and 5; digits with optional 1,234-style thousands groups; optional decimals.
_NUMBER = re.compile(
    r"(?:(?<![\w.])[-\u2212])?"
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?:\.\d+)?"
)


def _number(token: str) -> Decimal:
    return Decimal(token.replace(",", "").replace("\u2212", "-"))


def _reference(answer: str) -> Decimal | None:
    """The reference answer as a finite number, or None when it is not one."""
    try:
        value = _number(answer.strip())
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def match_answer(text: str, answer: str | None) -> bool | None:
    """True when the last number in text equals the reference answer; None when answer is None.

    A number may carry a leading minus and 1,234-style thousands separators; `3.0` equals `3`,
    `3.5` does not. No number in text gives False. The reference must itself be a number.
    """
    if answer is None:
        return None
    expected = _reference(answer)
    if expected is None:
        raise ValueError(f"reference answer {answer!r} is not a number")
    found = _NUMBER.findall(text)
    return bool(found) and _number(found[-1]) == expected
