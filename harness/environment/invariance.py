"""Kernel comparison: is each implementation of each op the models use bitwise invariant?

This module owns `compare_kernels()`, which runs every implementation of every op (attention
decode and prefill, matmul, RMSNorm, softmax, log-softmax; stock torch, SDPA and eager as
transformers calls them, the Triton kernels, and the batch-invariant modes) through two bitwise
checks. The implementations and their claims live in kvfid.environment.implementations; the
table (`render_table`) and the filed result (`write_result`) in kvfid.reports.invariance_table,
a floor above.

* **batch**: rows computed alone against the same rows inside batches of 2 ... 128 (each batch
  size its own call); for attention a row is a sequence (the batch axis), for the row ops a row of
  the M / rows axis.
* **sequence**: for attention decode, every position of a full prefill against decode steps over
  a growing KV cache; for attention prefill, against chunked prefills; for the row ops, every
  checked row inside one long sequence `[1, T, K]` against the row alone (a decode step).

Bits are compared (so -0.0 differs from +0.0); a difference is reported with the first failing
batch size or position and the max abs difference, never turned into a tolerance. An
implementation that claims an invariance and fails it makes the result's `ok` False, and so does a
deliberately variant twin (kvfid.stacks.twins) that a check fails to catch: that check could not fail.
Whether a stock op is invariant differs between machines (CPU instruction sets, BLAS paths): a
stock row that passes a check is a finding, "stock invariant here", never an error.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from kvfid.environment import envinfo
from kvfid.checks import check_cuda
from kvfid.kernels import DTYPES
from kvfid.states.cache import bits_equal  # noqa: F401 (re-exported: the one bitwise comparison)
from kvfid.environment.measure import BATCH_SIZES, max_abs_diff, randn
from kvfid.environment.probes import probe_stock
from kvfid.environment.tiled import tiled_routes, union_probes
from kvfid.environment.implementations import (  # noqa: F401 (re-exported)
    ATTENTION_OPS, IMPLEMENTATIONS, OPS, Implementation, attention_eager, attention_sdpa,
    attention_triton, log_softmax_triton, matmul_stock, matmul_triton, rms_norm_stock,
    rms_norm_triton, softmax_triton)
from kvfid import kernels
from kvfid.environment.invariance_jobs import in_processes
from kvfid.kernels.invariant import tiled as mode_tiled
from kvfid.kernels.invariant.mode import set_batch_invariant_mode

# quick: tile edges (7/8, 16/17), two tiles (33) and the size where stock fp32 mm differs (7).
QUICK_BATCH_SIZES = (2, 3, 7, 8, 16, 17, 33)


@dataclass(frozen=True)
class Shapes:
    """Sizes of one comparison. The default is SmolLM2-135M's (hidden 576, 9/3 heads, head dim 64);
    the Triton interpreter's cost per attention program sets the lengths (docs/cli.md,
    `kernels`)."""

    n_q_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    decode_context: int = 100  # keys a decode step sees in the batch check
    prefill_len: int = 16  # tokens of each sequence in the prefill batch check (one query tile)
    sequence_len: int = 130  # positions in the prefill-vs-decode check (crosses a 128-key tile)
    chunkings: tuple[tuple[int, int], ...] = ((37, 37), (13, 9))  # (first chunk, later chunks)
    hidden: int = 576
    matmul_out: int = 192  # k_proj / v_proj: 3 KV heads x 64
    softmax_width: int = 2048  # attention scores over a 2k context
    log_softmax_width: int = 4096  # a slice of the 49152-token vocabulary (interpreter cost)
    row_sequence_len: int = 100  # T of the row ops' [1, T, K] sequence
    alone_first: int = 40  # rows 0 .. alone_first-1 (and each batch's last row) are checked alone
    attention_alone_first: int = 16


SHAPES = {
    "full": Shapes(),
    "quick": Shapes(n_q_heads=2, n_kv_heads=1, head_dim=16, decode_context=20, prefill_len=5,
                    sequence_len=24, chunkings=((7, 7), (5, 3)), hidden=48, matmul_out=40,
                    softmax_width=96, log_softmax_width=200, row_sequence_len=24, alone_first=8,
                    attention_alone_first=3),
}


# ---- bitwise comparison ------------------------------------------------------------------------

def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor, as a model step would pass (no view offsets into a pool)."""
    return t.clone(memory_format=torch.contiguous_format)


# ---- the two checks ----------------------------------------------------------------------------

def alone_rows(batch_sizes: Sequence[int], first: int, limit: int) -> list[int]:
    """Rows checked alone: 0 .. first-1 and the last row of every batch (below `limit`)."""
    return sorted(i for i in set(range(first)) | {n - 1 for n in batch_sizes} if i < limit)


def batch_check(call: Callable, pool: Sequence[torch.Tensor], batch_sizes: Sequence[int],
                rows: Sequence[int]) -> tuple[dict, dict[int, torch.Tensor]]:
    """Each of `rows` alone vs the same row in a batch of n (its own call) for each n; returns the
    verdict and the outputs alone (reused by the row ops' sequence check)."""
    alone = {i: call(*(_fresh(t[i:i + 1]) for t in pool)) for i in rows}
    failing = []
    for n in batch_sizes:
        out = call(*(_fresh(t[:n]) for t in pool))
        bad = [i for i in rows if i < n and not bits_equal(out[i:i + 1], alone[i])]
        if bad:
            diff = max(max_abs_diff(out[i:i + 1], alone[i]) for i in bad)
            failing.append({"batch": n, "rows": bad, "max_abs_diff": diff})
    verdict = {
        "invariant": not failing,
        "first_failing_batch": failing[0]["batch"] if failing else None,
        "max_abs_diff": max((f["max_abs_diff"] for f in failing), default=0.0),
        "failing": failing,
        "comparisons": sum(1 for n in batch_sizes for i in rows if i < n),
    }
    return verdict, alone


Pairs = list[tuple[int, torch.Tensor, torch.Tensor]]  # (position, output, reference output)


def _positions_verdict(kind: str, constructions: dict[str, Pairs]) -> dict:
    """Each construction's outputs against the reference, position by position, bit by bit."""
    report, differing, worst = {}, set(), 0.0
    for name, pairs in constructions.items():
        bad = [(t, max_abs_diff(out, ref)) for t, out, ref in pairs if not bits_equal(out, ref)]
        diff = max((d for _, d in bad), default=0.0)
        report[name] = {"differing_positions": [t for t, _ in bad], "max_abs_diff": diff}
        differing.update(t for t, _ in bad)
        worst = diff if math.isnan(diff) else max(worst, diff)
    return {"kind": kind, "invariant": not differing,
            "first_differing_position": min(differing) if differing else None,
            "differing_positions": len(differing),
            "positions_checked": len({t for pairs in constructions.values() for t, _, _ in pairs}),
            "max_abs_diff": worst, "constructions": report}


def _chunk_bounds(length: int, first: int, step: int) -> list[int]:
    return [0] + list(range(first, length, step)) + [length]


def attention_sequence_check(op: str, call: Callable, q, k, v, chunkings) -> dict:
    """Decode: every position by decode steps over a growing cache vs one prefill. Prefill:
    chunked prefills (first chunk, then fixed chunks) vs one prefill. q, k, v: [1, H, T, D]."""
    length = q.shape[2]
    prefill = call(q, k, v)  # [1, Hq, T, D]

    def by_chunks(bounds):
        # The cache a chunk sees is a new contiguous tensor, as a grown KV cache is.
        out = torch.cat([call(_fresh(q[:, :, s:e]), _fresh(k[:, :, :e]), _fresh(v[:, :, :e]))
                         for s, e in zip(bounds, bounds[1:])], dim=2)
        return [(t, out[:, :, t], prefill[:, :, t]) for t in range(length)]

    if op == "attention-decode":
        return _positions_verdict("decode steps vs prefill",
                                  {"decode": by_chunks(list(range(length + 1)))})
    chunked = {f"chunks {a}+{b}": by_chunks(_chunk_bounds(length, a, b)) for a, b in chunkings}
    return _positions_verdict("chunked vs prefill", chunked)


def row_sequence_check(call: Callable, pool: torch.Tensor, length: int,
                       alone: dict[int, torch.Tensor]) -> dict:
    """Rows 0..length-1 as one sequence [1, T, K] vs each row checked alone ([1, K])."""
    sequence = call(_fresh(pool[None, :length]))[0]  # [T, N]
    pairs = [(t, sequence[t:t + 1], alone[t]) for t in sorted(alone) if t < length]
    return _positions_verdict("row in a sequence vs alone", {"sequence": pairs})


# ---- inputs ------------------------------------------------------------------------------------

def _row_op_inputs(op: str, shapes: Shapes, pool_rows: int, gen: torch.Generator):
    """(pool [rows, K] in fp32, params in fp32 or plain numbers) for a row op."""
    if op == "matmul":
        # Weights scaled like a trained projection's, so outputs are of order one.
        return (randn(gen, pool_rows, shapes.hidden),
                (randn(gen, shapes.matmul_out, shapes.hidden, scale=shapes.hidden ** -0.5),))
    if op == "rms-norm":
        return randn(gen, pool_rows, shapes.hidden), (1 + 0.1 * randn(gen, shapes.hidden), 1e-5)
    width = shapes.softmax_width if op == "softmax" else shapes.log_softmax_width
    return randn(gen, pool_rows, width, scale=3.0), ()


def _cast(t, dtype, device):
    return t.to(device=device, dtype=dtype) if isinstance(t, torch.Tensor) else t


def _run_one(impl: Implementation, dtype: torch.dtype, device: torch.device, shapes: Shapes,
             batch_sizes: Sequence[int], seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    pool_rows = max(batch_sizes)
    # Every row is checked alone, except where the Triton interpreter makes that too slow.
    sampled = impl.triton and device.type != "cuda"
    if impl.op in ATTENTION_OPS:
        h_q, h_kv, d = shapes.n_q_heads, shapes.n_kv_heads, shapes.head_dim
        kv_len = shapes.decode_context if impl.op == "attention-decode" else shapes.prefill_len
        q_len = 1 if impl.op == "attention-decode" else kv_len
        pool = [randn(gen, pool_rows, h_q, q_len, d).to(device, dtype),  # q: the last q_len positions
                *(randn(gen, pool_rows, h_kv, kv_len, d).to(device, dtype) for _ in "kv")]
        rows = alone_rows(batch_sizes, shapes.attention_alone_first if sampled else pool_rows, pool_rows)
        batch, _ = batch_check(impl.run, pool, batch_sizes, rows)
        seq = [randn(gen, 1, h, shapes.sequence_len, d).to(device, dtype) for h in (h_q, h_kv, h_kv)]
        sequence = attention_sequence_check(impl.op, impl.run, *seq, shapes.chunkings)
    else:
        pool, params = _row_op_inputs(impl.op, shapes, max(pool_rows, shapes.row_sequence_len), gen)
        pool = pool.to(device, dtype)
        params = tuple(_cast(p, dtype, device) for p in params)
        call = lambda x: impl.run(x, *params)  # noqa: E731
        limit = max(pool_rows, shapes.row_sequence_len)
        rows = alone_rows(batch_sizes, shapes.alone_first if sampled else limit, limit)
        rows = sorted(set(rows) | {shapes.row_sequence_len - 1})
        batch, alone = batch_check(call, [pool], batch_sizes, rows)
        sequence = row_sequence_check(call, pool, shapes.row_sequence_len, alone)
    if impl.control:
        ok = not batch["invariant"] and not sequence["invariant"]
    else:
        ok = ((batch["invariant"] or not impl.claims_batch)
              and (sequence["invariant"] or not impl.claims_sequence))
    return {"op": impl.op, "impl": impl.name, "dtype": next(k for k, v in DTYPES.items() if v == dtype),
            "mode": impl.mode, "control": impl.control,
            "claims": {"batch": impl.claims_batch, "sequence": impl.claims_sequence},
            "rows_alone": len(rows), "batch": batch, "sequence": sequence, "ok": ok}


def measure_rows(pairs, device: str, shapes: Shapes, batch_sizes: Sequence[int], seed: int,
                 progress: Callable[[str], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Each (op, implementation name, dtype) of `pairs` through `_run_one`, in order; the rows and
    the tiled-mode call shapes probed in this process on the way (kvfid.kernels.invariant.tiled)."""
    rows = []
    for op, name, dtype in pairs:
        impl = IMPLEMENTATIONS[op, name]
        if progress:
            progress(f"{op} / {name} / {dtype}")
        with set_batch_invariant_mode(impl.mode is not None, impl=impl.mode or "triton"):
            tick = time.perf_counter()
            row = _run_one(impl, DTYPES[dtype], torch.device(device), shapes, batch_sizes, seed)
        row["seconds"] = round(time.perf_counter() - tick, 3)
        rows.append(row)
    return rows, mode_tiled.verdicts()


def _row_in_a_process(pair, device, shapes, batch_sizes, seed, threads):
    """One row and the tiled-mode probes of its process (a worker of `_rows_in_processes`)."""
    if threads is not None:
        torch.set_num_threads(threads)
    with torch.inference_mode():
        rows, probes = measure_rows([pair], device, shapes, batch_sizes, seed)
    return rows[0], probes


def _rows_in_processes(pairs, device, shapes, batch_sizes, seed, threads, jobs, progress):
    """`measure_rows` over `jobs` processes: the same rows in the same order, and the union of
    the processes' tiled-mode probes (each call shape once). The Triton rows go first."""
    def done(pair, result):
        if progress:
            progress(f"{' / '.join(pair)} ({result[0]['seconds']:.1f} s)")
    found = in_processes(_row_in_a_process, pairs, jobs, done=done,
                         cost=lambda pair: not IMPLEMENTATIONS[pair[0], pair[1]].triton,
                         args=(device, shapes, batch_sizes, seed, threads))
    return [row for row, _ in found], union_probes(*(some for _, some in found))


# ---- the comparison ----------------------------------------------------------------------------

def compare_kernels(dtypes: Sequence[str] = ("bf16", "fp32"), device: str = "cpu", quick: bool = False,
                    *, ops: Sequence[str] | None = None, impls: Sequence[str] | None = None,
                    batch_sizes: Sequence[int] | None = None, threads: int | None = None,
                    seed: int = 0, progress: Callable[[str], None] | None = None,
                    jobs: int = 1) -> dict:
    """Run every (op, implementation, dtype) through the batch and sequence checks.

    Returns a JSON-ready dict: `ok` (False when an implementation fails an invariance it claims),
    `rows` (one per op x implementation x dtype), `skipped` (implementations not run here and why),
    the shapes, the environment record and its key, and the duration. `quick`: small shapes and
    QUICK_BATCH_SIZES (for tests); batch sizes default to BATCH_SIZES otherwise. `stock_probes`:
    stock mm and SDPA searched over a grid of shapes for a witness of variance (kvfid.environment.probes).
    `tiled_routes`: the tiled mode's tile and dtype route per dtype on this machine (kvfid.kernels.invariant.route).
    `jobs` > 1: the rows measured in that many processes (kvfid.environment.invariance_jobs).
    """
    names = {name for _, name in IMPLEMENTATIONS}
    checks = (("dtypes", dtypes, DTYPES), ("ops", ops, OPS), ("implementations", impls, names))
    for what, given, valid in checks:
        if given is not None and set(given) - set(valid):
            raise ValueError(f"unknown {what} {sorted(set(given) - set(valid))}; valid: {', '.join(valid)}")
    check_cuda(device, "device")
    torch_device = torch.device(device)
    shapes = SHAPES["quick" if quick else "full"]
    if batch_sizes is None:
        batch_sizes = QUICK_BATCH_SIZES if quick else BATCH_SIZES
    selected = [i for i in IMPLEMENTATIONS.values()
                if (ops is None or i.op in ops) and (impls is None or i.name in impls)]
    on_cpu = torch_device.type != "cuda"

    def why_not(impl: Implementation) -> str | None:
        if impl.triton and not kernels.triton_runs_on(torch_device):
            return f"Triton cannot take {device} tensors in this process (no TRITON_INTERPRET=1)"
        return f"{impl.cpu_skip}; runs on CUDA" if impl.cpu_skip and on_cpu else None

    skipped = [{"op": i.op, "impl": i.name, "why": why_not(i)} for i in selected if why_not(i)]
    selected = [i for i in selected if not why_not(i)]

    started = time.perf_counter()
    pairs = [(impl.op, impl.name, dtype) for impl in selected for dtype in dtypes]
    with contextlib.ExitStack() as restore:
        if threads is not None:
            restore.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(threads)
        restore.enter_context(torch.inference_mode())
        environment = envinfo.collect()
        if jobs > 1:
            rows, tiled_probes = _rows_in_processes(pairs, device, shapes, batch_sizes, seed,
                                                    threads, jobs, progress)
        else:
            rows, tiled_probes = measure_rows(pairs, device, shapes, batch_sizes, seed, progress)
        stock_probes = probe_stock(dtypes, device)
        threads_used = torch.get_num_threads()
        routes = tiled_routes(any(i.mode == "tiled" for i in selected), dtypes, torch_device)
    return {
        "ok": all(r["ok"] for r in rows),
        "device": str(torch_device),
        "quick": quick,
        "dtypes": list(dtypes),
        "batch_sizes": list(batch_sizes),
        "threads": threads_used,
        "shapes": asdict(shapes),
        "rows": rows,
        "stock_probes": stock_probes,
        "tiled_probes": tiled_probes,
        "tiled_routes": routes,
        "skipped": skipped,
        "duration_s": round(time.perf_counter() - started, 3),
        "environment": environment,
        "environment_key": envinfo.environment_key(environment),
    }
