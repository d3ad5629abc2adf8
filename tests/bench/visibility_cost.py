"""What the kernels' visibility-mask path costs against causal attention at the same shape.

Run: PYTHONPATH=. python tests/bench/visibility_cost.py [--kernel native|triton] [--repeats N]
A packed stage program (prompt, 3 branches, a merge; each branch sees the prompt and itself, the
merge everything) against plain causal attention over the same number of keys, SmolLM2's
attention shape (9 query heads, 3 KV heads, head dim 64), fp32, one thread: the prefill of the
whole program and one decode step at its end. Wall time by time.perf_counter per call (the mask
path includes its host-side plan), the two called in turn; median of the repeats, and the
ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvfid import kernels
from kvfid.kernels.attention import kernel as triton_attention
from kvfid.kernels.attention import native
from kvfid.kernels.attention.reference import segment_mask

PROGRAM = {"prompt": 128, "branches": (96, 96, 96), "merge": 96}  # 512 tokens


def program_mask() -> torch.Tensor:
    lens = [PROGRAM["prompt"], *PROGRAM["branches"], PROGRAM["merge"]]
    seg = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])[None]
    sees = torch.eye(len(lens), dtype=torch.bool)
    sees[:, 0] = sees[-1] = True
    return segment_mask(seg, sees)  # [1, T, T]


def medians_s(fns, repeats: int) -> list[float]:
    """Median seconds of each function, called in turn in every repeat (so a shared machine's
    load falls on all of them alike), after one warm-up call each."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernel", choices=("native", "triton"), default="native")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    attention = native.attention if args.kernel == "native" else triton_attention.attention
    mask = program_mask()
    total = mask.shape[-1]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, total, 64, generator=gen) for h in (9, 3, 3))
    cases = {"prefill": (q, mask), "decode": (q[:, :, -1:], mask[:, -1:])}
    print(f"{args.kernel}, fp32, Hq 9 / Hkv 3 / D 64, {total} keys, {args.repeats} repeats, 1 thread")
    for name, (queries, visibility) in cases.items():
        causal, masked = medians_s([lambda: attention(queries, k, v),
                                    lambda: attention(queries, k, v, visibility=visibility)],
                                   args.repeats)
        print(f"{name:8s} causal {causal * 1e3:9.2f} ms  mask {masked * 1e3:9.2f} ms  "
              f"ratio {masked / causal:5.2f}")


if __name__ == "__main__":
    main()
