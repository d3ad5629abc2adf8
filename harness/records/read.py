"""Reading a stored record back: schema 3 of any kind in record.RECORD_KINDS, schema 1-2 (the untagged
dicts of earlier ledgers) through kvfid.records.legacy, anything else refused with one
line. It sits above every record module, so all kinds (replay_record's, program's and engine's
too) are registered here.
"""

from __future__ import annotations

import json

from kvfid.records.engine import EngineCheckRecord  # noqa: F401 (registers its kind)
from kvfid.records.engine_load import EngineLoadRecord  # noqa: F401 (registers the load kind)
from kvfid.records.plain import from_plain
from kvfid.records.record import RECORD_KINDS, SCHEMA_VERSION, RecordRefused
from kvfid.records.program import ProgramRecord  # noqa: F401 (registers the program kind)
from kvfid.records.legacy import from_untagged
from kvfid.records.replay_record import ReplayRecord  # noqa: F401 (registers the replay kind)


def from_json(text: str):
    """The record stored as `text`; RecordRefused for another schema or something else."""
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        raise RecordRefused("stored record is not JSON") from None
    return from_dict(data)


def from_dict(data: dict):
    """The record `data` holds (plain JSON data, tagged or, from schema 1-2, untagged)."""
    if not isinstance(data, dict):
        raise RecordRefused(f"a record is a JSON object, not {type(data).__name__}")
    if "schema" not in data:
        return from_untagged(data)
    if data["schema"] != SCHEMA_VERSION:
        raise RecordRefused(f"record schema {data['schema']!r} is not this kvfid's "
                            f"({SCHEMA_VERSION}); read it with the kvfid that wrote it")
    kind = RECORD_KINDS.get(data.get("kind"))
    if kind is None:
        raise RecordRefused(f"unknown record kind {data.get('kind')!r}; known: "
                            f"{', '.join(RECORD_KINDS)}")
    try:
        return from_plain(kind, {k: v for k, v in data.items() if k not in ("schema", "kind")})
    except (TypeError, ValueError) as err:
        raise RecordRefused(f"not a kvfid {kind.KIND} record ({err})") from None
