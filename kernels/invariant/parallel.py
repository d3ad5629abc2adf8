"""Tensor-parallel-invariant products: a linear layer's bits that do not depend on how many ranks
share it.

A row-parallel layer (attention `o_proj`, MLP `down_proj`) sharded over N ranks multiplies each
rank's slice of the reduction axis and adds the N partial sums: another association of the sum
than one GEMM's K loop, so its bits depend on N. Here the reduction axis is cut into `SEGMENTS`
fixed segments at absolute offsets; each segment's product is computed alone by the model's
GEMM in the model's dtype (a bf16 one accumulates in fp32 and rounds once, as each rank's
partial sum does in a stock TP=8 engine), and the segment sums are added in fp32 in one fixed
pairwise tree, rounded to the model's dtype once. (Segment products in fp32, from exact copies,
cost several times a bf16 prefill: docs/hazards.md, "Tensor parallel: the segment products'
dtype".) A rank holding segments [r*G/N, (r+1)*G/N) computes the same
segment products (the same call shapes), so gathering every rank's segment sums and adding them
in that tree gives the bits one process computing all G gives, for every N dividing G.

A column-parallel layer (q/k/v, gate/up, the vocabulary-parallel LM head) splits output columns,
which adds nothing up; but a GEMM kernel may choose its blocking from the number of columns, so
a column's bits could depend on the width of the call. Its invariant form is the output cut into
`SEGMENTS` fixed pieces, each computed alone and concatenated. Where a probe on this machine
shows that one call over a run of pieces gives the bits of the pieces computed alone (whether it
does is the kernel's property, never assumed), that run is one call (`pieces_agree`).

The products go through torch's `F.linear`, so under the batch-invariant mode
(kvfid.kernels.invariant.mode) each call's rows are batch-invariant too. Who holds which
segments and how sums travel between ranks is the caller's business (kvfid.stacks.tp, the
faithful vLLM engine); this module computes and adds.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from kvfid.kernels.invariant.whole import revealing_rows, stand_in

SEGMENTS = 8   # fixed segments of a reduction axis, or pieces of an output axis (TP sizes 1, 2, 4, 8)


def segment_count(width: int) -> int:
    """How many fixed segments an axis of `width` is cut into: SEGMENTS where it divides the
    width, else the largest divisor of SEGMENTS that does (1: the axis whole)."""
    return math.gcd(width, SEGMENTS)


def tp_reason(width: int, size: int, what: str) -> str | None:
    """Why an axis of `width` cannot be shared TP-invariantly by `size` ranks, or None."""
    count = segment_count(width)
    if count % size:
        return (f"{what} of {width} is cut into {count} fixed segment(s), which {size} ranks "
                f"cannot share evenly")
    return None


def cut(weight: torch.Tensor, count: int, dim: int) -> list[torch.Tensor]:
    """`weight` cut into `count` equal pieces along `dim`, each a fresh contiguous tensor (as a
    frozen Parameter: the batch-invariant mode keeps one fp32 copy of a Parameter per version)."""
    return [torch.nn.Parameter(piece.clone(memory_format=torch.contiguous_format),
                               requires_grad=False)
            for piece in weight.chunk(count, dim)]


# Where the segments' inputs start in their one buffer: a multiple of any allocator's alignment
# (the CPU's 64 bytes, CUDA's 512), so each is aligned as a fresh tensor of its own would be.
ALIGN_BYTES = 512


def segment_inputs(rows: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """rows [M, count * S] -> `count` contiguous [M, S] tensors, segment i's columns, copied once
    into one buffer with each segment starting on an ALIGN_BYTES boundary: each is laid out as a
    fresh contiguous copy of its own would be."""
    m, width = rows.shape[0], rows.shape[1] // count
    unit = max(1, ALIGN_BYTES // rows.element_size())
    stride = -(-(m * width) // unit) * unit                                  # elements per segment
    buffer = rows.new_empty(count * stride)
    inputs = buffer.as_strided((count, m, width), (stride, width, 1))       # [count, M, S]
    inputs.copy_(rows.unflatten(1, (count, width)).transpose(0, 1))
    return inputs.unbind(0)


def segment_products(x: torch.Tensor, segments: list[torch.Tensor]) -> torch.Tensor:
    """x [..., len(segments) * S] times each weight segment [N, S] alone (each input segment a
    contiguous [rows, S] tensor, `segment_inputs`: one matrix product per segment):
    [len(segments), ..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])                                     # [M, K]
    out = torch.stack([F.linear(part, weight)
                       for part, weight in zip(segment_inputs(rows, len(segments)), segments)])
    return out.view(len(segments), *x.shape[:-1], out.shape[-1])


def tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts [G, ...] added in one fixed pairwise tree: ((p0 + p1) + (p2 + p3)) + ... (an odd
    last part is carried up a level as it is); each level's pairs in one element-wise add."""
    level = parts
    while level.shape[0] > 1:
        even = level.shape[0] // 2 * 2
        summed = level[0:even:2] + level[1:even:2]                       # pair i: parts 2i, 2i+1
        level = torch.cat([summed, level[even:]]) if even < level.shape[0] else summed
    return level[0]


def row_reduce(sums: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """Every segment's sum [G, ..., N] (in segment order) -> the layer's output in `dtype`: the
    fixed tree in fp32, one rounding, then the bias."""
    out = tree_sum(sums.float()).to(dtype)
    return out if bias is None else out + bias


_lock = threading.Lock()
_agree: dict[tuple, bool] = {}


def pieces_agree(pieces: list[torch.Tensor], dtype: torch.dtype, bias: bool) -> bool:
    """Whether one F.linear over the concatenated pieces gives the bits of each piece's F.linear
    alone, on random rows and weights and on revealing rows over stand-in weights
    (kvfid.kernels.invariant.whole, "What a probe feeds"); probed once per shapes, dtype, bias,
    thread count and mode."""
    from kvfid.kernels.invariant.mode import batch_invariant_mode

    key = (tuple(tuple(p.shape) for p in pieces), dtype, bias, torch.get_num_threads(),
           batch_invariant_mode())
    with _lock:
        if key in _agree:
            return _agree[key]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, pieces[0].shape[1], generator=gen).to(dtype)
    weights = [torch.randn(p.shape, generator=gen).to(dtype) for p in pieces]
    biases = [torch.randn(p.shape[0], generator=gen).to(dtype) if bias else None for p in pieces]
    revealing = revealing_rows(3, pieces[0].shape[1], dtype, torch.device("cpu"), seed=0)
    stand_ins = [stand_in(w.t()).t() for w in weights]   # [n_i, K]: pairs equal along K
    zeros = [torch.zeros_like(b) if bias else None for b in biases]
    same = _concatenated_agrees(x, weights, biases) and _concatenated_agrees(revealing, stand_ins, zeros)
    with _lock:
        _agree[key] = same
    return same


def _concatenated_agrees(x: torch.Tensor, weights: list[torch.Tensor], biases: list) -> bool:
    """One F.linear of x over the concatenated weights against each weight's alone, bitwise."""
    joined = F.linear(x, torch.cat(weights), torch.cat(biases) if biases[0] is not None else None)
    alone = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)
    return bool((joined.contiguous().view(torch.uint8) == alone.contiguous().view(torch.uint8)).all())


def column_product(x: torch.Tensor, pieces: list[torch.Tensor], whole: torch.Tensor,
                   bias: torch.Tensor | None, agree: bool | None = None) -> torch.Tensor:
    """x [..., K] times the output pieces [n_i, K] (`whole` is their concatenation): one call
    where `pieces_agree` says it gives the pieces' bits (`agree`: its answer, known already),
    else each piece alone, concatenated."""
    if agree is None:
        agree = len(pieces) == 1 or pieces_agree(pieces, x.dtype, bias is not None)
    rows = x.reshape(-1, x.shape[-1])          # [M, K]: a matrix product, as the probe's
    if agree:
        out = F.linear(rows, whole, bias)
    else:
        biases = bias.split([p.shape[0] for p in pieces]) if bias is not None else [None] * len(pieces)
        out = torch.cat([F.linear(rows, w, b) for w, b in zip(pieces, biases)], -1)
    return out.view(*x.shape[:-1], out.shape[-1])
