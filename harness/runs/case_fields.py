"""Typed reads from a parsed case file: every failure names the file, the key, the value and
what is allowed (`CaseError`, exit 2)."""

from __future__ import annotations

from kvfid.protocol.constructions import construction_reason
from kvfid.errors import BadInput
from kvfid.protocol.protocol import CONSTRUCTION_HELP, ProtocolError, parse_construction


class CaseError(BadInput, ValueError):
    """A case file that cannot be run: bad TOML, unknown key, bad value."""


def is_int(value) -> bool:
    """An integer that is not a bool (TOML `true` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


class Validator:
    """Typed reads from the parsed TOML; every failure names file, key, value, allowed."""

    def __init__(self, source: str, tables: dict[str, set[str]]) -> None:
        self.source = source
        self.tables = tables    # {table: its allowed keys}

    def fail(self, table: str, key: str, value, allowed: str):
        where = f"[{table}] {key}" if table else key
        raise CaseError(f"{self.source}: {where} = {value!r} is not allowed; allowed: {allowed}")

    def check(self, table: str, key: str, value, reason):
        """`value` when `reason(value)` (a kvfid.checks rule) finds nothing wrong."""
        why = reason(value)
        if why is not None:
            self.fail(table, key, value, why.removeprefix("allowed: "))
        return value

    def keys(self, data: dict, allowed: set[str], table: str) -> None:
        for key in data:
            if key not in allowed:
                where = f"[{table}] " if table else ""
                raise CaseError(f"{self.source}: unknown key {where}{key!r}; allowed: "
                                f"{', '.join(sorted(allowed))}")

    def table(self, data: dict, name: str) -> dict:
        if name not in data:
            raise CaseError(f"{self.source}: missing table [{name}]; it takes "
                            f"{', '.join(sorted(self.tables[name]))}")
        if not isinstance(data[name], dict):
            self.fail("", name, data[name], f"a table [{name}]")
        return data[name]

    def required(self, data: dict, table: str, key: str, kind: type):
        if key not in data:
            where = f"[{table}] {key}" if table else key
            raise CaseError(f"{self.source}: missing key {where}")
        return self.optional(data, table, key, kind, None)

    def optional(self, data: dict, table: str, key: str, kind: type, default):
        value = data.get(key, default)
        if value is not default and not isinstance(value, kind):
            self.fail(table, key, value, f"a {kind.__name__}")
        return value

    def integer(self, data: dict, table: str, key: str, default: int, minimum=None) -> int:
        value = data.get(key, default)
        if not is_int(value) or (minimum is not None and value < minimum):
            self.fail(table, key, value, "an integer" + (f" >= {minimum}" if minimum is not None
                                                        else ""))
        return value

    def positive(self, data: dict, table: str, key: str) -> int:
        if key not in data:
            where = f"[{table}] {key}" if table else key
            raise CaseError(f"{self.source}: missing key {where}")
        return self.integer(data, table, key, 0, minimum=1)

    def item_count(self, data: dict, table: str, key: str) -> int | None:
        value = data.get(key, "all")
        if value == "all":
            return None
        if not is_int(value) or value < 0:
            self.fail(table, key, value, '"all" or a non-negative integer (the first N items)')
        return value

    def strings(self, data: dict, table: str, key: str, default) -> tuple[str, ...]:
        value = data.get(key, default)
        if value is None:
            raise CaseError(f"{self.source}: missing key [{table}] {key}")
        if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
            self.fail(table, key, value, "a non-empty list of strings")
        return tuple(value)

    def choices(self, data: dict, table: str, key: str, allowed: list[str], default):
        values = self.strings(data, table, key, default)
        for value in values:
            if value not in allowed:
                self.fail(table, key, value, ", ".join(allowed))
        return tuple(dict.fromkeys(values))

    def constructions(self, data: dict, table: str, key: str, default) -> tuple[str, ...]:
        labels = []
        for value in self.strings(data, table, key, default):
            try:
                labels.append(parse_construction(value).label)
            except ProtocolError:
                self.fail(table, key, value, CONSTRUCTION_HELP)
            self.check(table, key, labels[-1], construction_reason)
        return tuple(dict.fromkeys(labels))
