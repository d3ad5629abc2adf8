"""The faithful transformers engine: its continuous batching with kvfid's attention and the
batch-invariant mode inside, through transformers' own extension point, never a patch.

transformers' continuous batching runs one packed forward per step: every scheduled request's new
tokens in one sequence, each request's keys (its cached positions read from the paged cache, then
its new ones) in one key sequence, `cu_seq_lens_q` / `cu_seq_lens_k` saying where each request's
part starts, and a block mask over the whole. Under `sdpa` one call attends the packed sequence
under that mask, so a request's bits depend on its neighbours and on how its positions were
split into steps. The faithful attention (the `sdpa` name, overridden in the attention
interface's local mapping for the engine's life and restored after) computes each request's
queries over its own keys alone, by kvfid's native tile math
(kvfid.kernels.attention.native.attention: fixed key tiles aligned to absolute positions, the
same bits for a position whether it comes in a prefill, a chunk or a decode step); the
batch-invariant mode makes every product, norm and softmax a row's own. A request then has the
bits it has alone, in any batch, split in any chunks, or read from shared blocks.

Served: full causal attention (no sliding window, chunked layers, sinks or soft caps: refused by
name as the engine starts).
"""

from __future__ import annotations

import contextlib

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvfid.kernels.attention.native import attention
from kvfid.kernels.invariant.complex_products import makes_complex
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.stacks.stack import Stack

NAME = "sdpa"       # the implementation continuous batching accepts on a CPU, overridden here


def unserved(config) -> str | None:
    """Why the faithful attention cannot serve this model config (None: it can)."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)}: the faithful attention here serves full attention only"
    for name in ("sliding_window", "attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, name, None):
            return f"{name}={getattr(config, name)}: not served by the faithful attention here"
    return None


def per_request_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """Each request of a packed step attended alone: query [1, Hq, Tq_total, D] and key/value
    [1, Hkv, Tk_total, D] cut by `cu_seq_lens_q` / `cu_seq_lens_k`; a request's queries are the
    last positions of its keys. Returns [1, Tq_total, Hq, D] (transformers' layout)."""

    cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        part = attention(query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], scale=scaling)
        out[:, q0:q1] = part.transpose(1, 2)                      # [1, Tq_i, Hq, D]
    return out, None


@contextlib.contextmanager
def installed(model, dtype: str):
    """The faithful engine for a manager started on `model` within the block: the attention
    interface's `sdpa` is the per-request native attention, the batch-invariant mode is on (the
    native stack's implementation); both restored on exit."""


    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had, previous = NAME in local, local.get(NAME)
    ALL_ATTENTION_FUNCTIONS[NAME] = per_request_attention
    try:
        with set_batch_invariant_mode(True, impl=Stack("native", dtype, batch_invariant=True).batch_invariant_impl,
                                      complex_products=makes_complex(model)):
            yield
    finally:
        if had:
            local[NAME] = previous
        else:
            local.pop(NAME, None)
