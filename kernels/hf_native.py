"""transformers registration of the native CPU attention (kvfid.kernels.attention.native) as
attention implementation "kvfid_native", through kvfid.kernels.hf's kernel-agnostic factory: the same
mask checks, positions and refusals as "kvfid_triton", another kernel behind them."""

from __future__ import annotations

from kvfid.kernels.hf import make_attention, register_kernel
from kvfid.kernels.attention.native import attention_into

NAME = "kvfid_native"
# Every mechanism of the shared interface (kvfid.kernels.hf): the native kernel applies them all,
# and a sparse indexer's selection (`indices`) as the query's visibility.
SERVES: frozenset[str] = frozenset({"sliding_window", "chunked_attention", "softcap", "sinks",
                                    "split_head_dims", "visibility", "sparse_indexer"})


def _native_attention_into(out, q, k, v, **kwargs):
    return attention_into(out, q, k, v, **kwargs)


kvfid_native_attention = make_attention(NAME, _native_attention_into, SERVES, frozenset({"config"}))


def register() -> str:
    """Register the native kernel as "kvfid_native" (idempotent); returns the name."""
    return register_kernel(NAME, kvfid_native_attention)
