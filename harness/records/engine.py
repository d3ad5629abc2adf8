"""The record of one `kvfid engine-check`: the ledger stores it like a run's unit, typed and frozen.

One `EngineCheckRecord` holds what was measured (the engine and its version, model, dtype,
prompts x tokens, the chunk, faithful or stock, the engine's batch-invariant switch and the note on it) and one
`EngineRow` per pair of the engine's constructions: continuation tokens compared, those whose
fp32 logprob bits differ, max |delta logprob|, items exact, and with `--kv` its `EngineKV` (the
engine states read from the engine's paged cache: first bad layer and position, elements, max |diff|,
max ULP, d_rel, d_rel per layer). Its own module because record.py is full; it registers its
kind in record.RECORD_KINDS, and kvfid.records.read imports it, so a stored engine check reads back
wherever records are read (`to_json` / `read.from_json`, like every record).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from kvfid.records.plain import from_plain
from kvfid.records.record import RECORD_KINDS, to_json


@dataclass(frozen=True)
class EngineKV:
    """One row's engine states, pairs compared bitwise over their common positions
    (engine_kv.compare_rows): the worst item's d_rel, per layer the worst of K and V."""

    items: int
    items_exact: int
    first_bad_layer: int | None = None
    first_position: int | None = None
    n_diff: int = 0
    max_abs: float = 0.0
    max_ulp: int = 0
    d_rel: float = 0.0
    positions: int = 0
    d_rel_per_layer: tuple[float, ...] = ()
    d_rel_aggregation: str = ""

    @property
    def exact(self) -> bool:
        return self.items_exact == self.items and self.n_diff == 0


@dataclass(frozen=True)
class EngineRow:
    """Two of the engine's constructions on the same tokens (engine_check._compare); `diverged`:
    items whose greedy tokens diverge (compared up to there), `served_tokens`: positions the
    prefix cache served (no logprob there)."""

    construction: str
    tokens: int
    differ: int
    max_abs: float
    items_exact: int
    items: int
    diverged: int | None = None
    served_tokens: int | None = None
    kv: EngineKV | None = None
    # An fp8 cache: `kv` compares the stored bytes (as fp8) and the scales; this, the same states
    # dequantized (fp32(stored) * scale), so a difference is counted in both formats.
    kv_dequantized: EngineKV | None = None

    @property
    def exact(self) -> bool:
        return self.differ == 0 and (self.kv is None or self.kv.exact) and \
            (self.kv_dequantized is None or self.kv_dequantized.exact)


@dataclass(frozen=True)
class EngineCheckRecord:
    """One `kvfid engine-check`: what ran, and a row per pair of constructions."""

    KIND: typing.ClassVar[str] = "engine-check"

    model: str
    dtype: str
    engine: str                               # the engine and its version: "vllm 0.32.0"
    prompts: int
    tokens: int
    chunk: int
    rows: tuple[EngineRow, ...] = ()
    folder: str = ""
    item_set: str = "arith"
    batch_invariant: bool = False
    batch_invariant_note: str | None = None
    faithful: bool = False
    kv: bool = False
    wall_s: float = 0.0
    status: str = "ok"
    threads: int | None = None                # the engines' torch threads (None: the engine's own)
    block_size: int = 32                      # the KV block in tokens the engines ran with
    tp: int = 1                               # the TP size compared with TP=1 (1: no TP rows)
    engine_name: str = "vllm"                 # the engine's name in kvfid.engines.registry
    attention: str = ""                       # the engine's attention implementation ("": its default)
    kv_cache_dtype: str = "auto"              # the paged cache's stored format (auto: the model's dtype)

    @property
    def exact(self) -> bool:
        """Every row bit-exact (logprobs and, with `kv`, the engine states)."""
        return all(r.exact for r in self.rows)

    @property
    def label(self) -> str:
        """The engine as a stack label: `vllm 0.32.0/bf16`, `+faithful`, `+batch-invariant` (its switch)."""
        return (f"{self.engine}/{self.dtype}" + ("+faithful" if self.faithful else "")
                + ("+batch-invariant" if self.batch_invariant else "")
                + (f"+kv:{self.kv_cache_dtype}" if self.kv_cache_dtype != "auto" else ""))

    def to_json(self, indent: int | None = None) -> str:
        return to_json(self, indent)


def from_result(result: dict) -> EngineCheckRecord:
    """The record of an engine check's plain JSON data (its fields, as the record spells them)."""
    return from_plain(EngineCheckRecord, result)


RECORD_KINDS[EngineCheckRecord.KIND] = EngineCheckRecord
