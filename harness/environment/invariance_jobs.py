"""The kernel comparison's rows measured in several processes (`compare_kernels(jobs=N)`).

Each (op, implementation, dtype) row is one independent measurement on one torch thread, so N
processes on N cores give the same rows N times sooner. `in_processes` deals the rows out
costliest first (the caller's `cost`: the Triton rows, which run in the interpreter without CUDA)
to whichever process is free and puts the results back in the given order. Processes are spawned
(a fresh interpreter each: no torch state forked from this one); `work` must be a module-level
function, which the processes import by name.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed


def in_processes(work, items: list, jobs: int, *, cost=None, args: tuple = (),
                 done=None) -> list:
    """[work(item, *args) for item in items], computed in `jobs` spawned processes; `done(item,
    result)` is called as each one finishes."""
    order = sorted(range(len(items)), key=lambda i: cost(items[i])) if cost else range(len(items))
    results: list = [None] * len(items)
    with ProcessPoolExecutor(max_workers=jobs,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(work, items[i], *args): i for i in order}
        for future in as_completed(futures):
            index = futures[future]
            results[index] = future.result()
            if done:
                done(items[index], results[index])
    return results
