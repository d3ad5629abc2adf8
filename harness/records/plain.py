"""Frozen dataclasses to plain JSON-able data and back, following the classes' type hints.

A field may be a scalar, a dataclass, `X | None`, `tuple[X, ...]`, `dict[str, X]` or a free-form
`dict`; JSON lists come back as tuples, ints as floats where the hint says float. Unknown fields
are refused (ValueError), so data of another shape is never read as if it fitted; a field an
earlier version wrote and this one dropped is named in the class's `RETIRED` and skipped.
"""

from __future__ import annotations

import dataclasses
import types
import typing


def as_plain(value):
    """Frozen dataclasses (nested in dicts, tuples) as plain JSON-able data."""
    if dataclasses.is_dataclass(value):
        return {f.name: as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: as_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_plain(v) for v in value]
    return value


def from_plain(kind, value):
    """`value` (plain JSON data) as the type `kind`, following its type hints."""
    if value is None:
        return None
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"record fields take one type or None, not {kind}")
        return from_plain(options[0], value)
    if origin is tuple:
        return tuple(from_plain(args[0], v) for v in value)
    if origin is dict:
        return {k: from_plain(args[1], v) for k, v in value.items()}
    if dataclasses.is_dataclass(kind):
        hints, retired = _hints(kind), getattr(kind, "RETIRED", frozenset())
        unknown = set(value) - set(hints) - retired
        if unknown:
            raise ValueError(f"{kind.__name__} has no field(s) {', '.join(sorted(unknown))}")
        return kind(**{name: from_plain(hints[name], v) for name, v in value.items()
                       if name not in retired})
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


_HINTS: dict[type, dict] = {}


def _hints(kind: type) -> dict:
    if kind not in _HINTS:
        hints = typing.get_type_hints(kind)
        _HINTS[kind] = {f.name: hints[f.name] for f in dataclasses.fields(kind)}
    return _HINTS[kind]
