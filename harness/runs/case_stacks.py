"""The stacks of a case file: `[stacks]` (one product of backends x dtypes x batch-invariant
modes on one device and thread count) or `[[stacks]]` (several such tables, the union of their
products, each optionally on only its first `items` items, so an expensive stack can run on a few
items beside the others). Reads through the case loader's validator, so every refusal names the
file, the key, the value and what is allowed.
"""

from __future__ import annotations

import itertools

from kvfid.stacks.backends import DTYPES, backend_names
from kvfid.stacks.stack import Stack
from kvfid.checks import MAX_TP, device_reason, threads_reason, tp_reason


def stack_tables(v, data: dict) -> list[dict]:
    """`[stacks]` (one table) or `[[stacks]]` (a non-empty list of tables)."""
    tables = data.get("stacks")
    ok = isinstance(tables, list) and tables and all(isinstance(t, dict) for t in tables)
    return tables if ok else [v.table(data, "stacks")]


def stack_groups(v, data: dict) -> tuple[tuple[Stack, ...], tuple[int | None, ...]]:
    """The union of the stack tables' products, and each stack's item limit (() when none has
    one; None: all items)."""
    groups = [(product_stacks(v, t), v.item_count(t, "stacks", "items"))
              for t in stack_tables(v, data)]
    stacks = tuple(s for group, _ in groups for s in group)
    for s in stacks:
        if stacks.count(s) > 1:
            v.fail("stacks", "backends", s.label, "each stack in one [[stacks]] table only")
    limits = tuple(n for group, n in groups for _ in group)
    return stacks, limits if any(n is not None for n in limits) else ()


def product_stacks(v, t: dict) -> tuple[Stack, ...]:
    """backends x dtypes x batch-invariant modes x compile x TP sizes, on one device and thread
    count."""
    backends = v.choices(t, "stacks", "backends", backend_names(), None)
    dtypes = v.choices(t, "stacks", "dtypes", list(DTYPES), None)
    modes = t.get("batch_invariant", [False])
    if not isinstance(modes, list) or not modes or not all(isinstance(m, bool) for m in modes):
        v.fail("stacks", "batch_invariant", modes, "a non-empty list of true/false")
    compiled = t.get("compile", [False])
    if not isinstance(compiled, list) or not compiled or not all(isinstance(c, bool) for c in compiled):
        v.fail("stacks", "compile", compiled, "a non-empty list of true/false")
    faithful = t.get("faithful_recurrence", [None])   # absent: the stack's default (+bi steps)
    if "faithful_recurrence" in t and (not isinstance(faithful, list) or not faithful
                                       or not all(isinstance(f, bool) for f in faithful)):
        v.fail("stacks", "faithful_recurrence", faithful, "a non-empty list of true/false")
    sizes = t.get("tp", [1])
    sizes = [sizes] if isinstance(sizes, int) and not isinstance(sizes, bool) else sizes
    if not isinstance(sizes, list) or not sizes or any(tp_reason(n) for n in sizes):
        v.fail("stacks", "tp", t.get("tp"), "a TP size or a non-empty list of them (1 to "
               f"{MAX_TP}; the model sharded over that many ranks)")
    device = v.optional(t, "stacks", "device", str, "cpu")
    v.check("stacks", "device", device, device_reason)
    threads = t.get("threads")
    if threads is not None:
        v.check("stacks", "threads", threads, threads_reason)
    # A case that names TP sizes runs TP stacks, `tp = 1` included (`@tp1`: with the mode, the
    # TP-invariant products at size 1, what its larger sizes are compared against).
    return tuple(Stack(b, d, bi, device, threads, c, faithful_recurrence=fr, tp=n, tp_named="tp" in t)
                 for b, d, bi, fr, c, n in itertools.product(backends, dtypes, dict.fromkeys(modes),
                                                             dict.fromkeys(faithful),
                                                             dict.fromkeys(compiled),
                                                             dict.fromkeys(sizes)))
