"""Long-context decode, split path against the unsplit kernel: what `make gpu-check` measures.

For B=1 at LONG_CONTEXT keys (compile_plan.LONG_SHAPES heads, bf16) it times one decode step of
the attention kernel with its GPU config (split into segments) and with the same config unsplit
(`segment=0`), beside the roofline floor, and checks the split decode's bits against the split
prefill's last position. Prints one JSON line per shape. `--dry-run`: the interpreter at toy
sizes (a segment of 64 keys), to prove the script runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time


def _time_us(fn, repeats: int, cuda: bool) -> float:
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def measure(head_dim: int, group: int, context: int, dry_run: bool) -> dict:
    import torch

    from kvfid.environment.roofline import GPUS, Work, floor_us
    from kvfid.kernels.attention.kernel import AttentionConfig, attention, config_for

    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    split = config_for(device, dtype, head_dim) if cuda else AttentionConfig(
        block_n=32, max_tile_rows=64, num_warps=4, num_stages=1, use_dot=False, segment=64)
    unsplit = dataclasses.replace(split, segment=0)
    n_kv = 2
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, n_kv * group, 1, head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(1, n_kv, context, head_dim, generator=gen).to(device, dtype) for _ in "kv")
    repeats = 20 if cuda else 2
    split_us = _time_us(lambda: attention(q, k, v, config=split), repeats, cuda)
    unsplit_us = _time_us(lambda: attention(q, k, v, config=unsplit), repeats, cuda)
    # Bits: the decode step equals the same position inside a longer construction (a 40-query
    # chunk ending there), on the split path.
    q_chunk = torch.randn(1, n_kv * group, 40, head_dim, generator=gen).to(device, dtype)
    q_chunk[:, :, -1:] = q
    chunked = attention(q_chunk, k, v, config=split)[:, :, -1:]
    decode = attention(q, k, v, config=split)
    h200 = next(g for g in GPUS if g.name == "H200")
    work = Work("", 2 * n_kv * context * head_dim * 2, 4 * n_kv * group * context * head_dim)
    return {"shape": f"B1 Hq{n_kv * group} Hkv{n_kv} D{head_dim} Tk{context}",
            "device": torch.cuda.get_device_name(device) if cuda else "interpreter",
            "unsplit_us": round(unsplit_us, 1), "split_us": round(split_us, 1),
            "speedup": round(unsplit_us / split_us, 2), "segment": split.segment,
            "h200_floor_us": floor_us(work, h200, True)["floor_us"],
            "decode_equals_chunk_bits": bool(torch.equal(decode, chunked))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="interpreter, toy sizes")
    args = parser.parse_args(argv)
    import kvfid  # noqa: F401  (the package selects the interpreter before triton loads)
    from kvfid.environment.compile_plan import LONG_CONTEXT, LONG_SHAPES

    shapes = ((16, 2),) if args.dry_run else LONG_SHAPES
    ok = True
    for head_dim, group in shapes:
        result = measure(head_dim, group, 200 if args.dry_run else LONG_CONTEXT, args.dry_run)
        ok &= result["decode_equals_chunk_bits"]
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
