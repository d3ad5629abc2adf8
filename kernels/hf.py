"""transformers registration of kvfid's attention kernels as attention implementations.

`make_attention(name, attention_into, serves)` turns any kernel with the shared interface (below)
into the function transformers' `AttentionInterface` calls; `register_kernel` puts it and a mask
function into transformers' public interfaces under one name. `register()` does so for the Triton
kernel as "kvfid_triton" (another module registers the native CPU kernel through the same factory).

The kernel interface: `attention_into(out, q, k, v, *, scale, first_valid, key_start, window,
chunk, softcap, sinks, **options)` writes out [B, Hq, Tq, Dv] (a view with any strides) from
q [B, Hq, Tq, Dqk], k [B, Hkv, Tk, Dqk], v [B, Hkv, Tk, Dv]. Held key j sits at absolute position
`key_start + j` (a sliding-window cache holds only the last keys); queries are the last Tq of them.
`first_valid` [B] is each row's first valid key as an absolute position (left padding); a row works
in its *own* positions (absolute minus its padding). `window`: query p sees keys k with
p - window < k <= p; `chunk`: keys with k // chunk == p // chunk (and k <= p), in own positions;
`softcap`: s = softcap * tanh(s / softcap) on the scaled scores; `sinks` [Hq]: a per-head logit in
the softmax denominator. The kernel applies all of it from positions, so it needs no mask;
`visibility` [B, Tq, Tk] bool (kvfid.kernels.attention.views), when given, is the whole pattern instead.

What the function reads from transformers (5.17 through 5.2x, public names only):
* scaling (None: 1/sqrt(Dqk)), `sliding_window` and `softcap` from the call's kwargs; sinks from
  the `s_aux` kwarg (gpt-oss) or a `sinks` tensor on the module; a chunk size from the module's
  config (`layer_types[layer_idx] == "chunked_attention"`, `attention_chunk_size`; Llama 4);
* positions: transformers 5.2x passes no `cache_position`, and most decoders pass `position_ids`
  through to the attention kwargs: [B or 1, Tq], the queries' own positions (absolute without
  padding; padding-relative in left-padded batches, as generate and kvfid's co-batches build them).
  The last query is always a real token, so row b's held key 0 sits at own position
  `position_ids[b, -1] - (Tk - 1)`: negative while pad keys are still held, positive once a window
  cache has dropped keys. Without position ids the held keys are taken to start at 0 (a full cache),
  and a sliding-window layer is refused;
* a chunked layer (Llama 4's attention call carries no position ids) is computed under its
  visibility, each query in its chunk's coordinates (kvfid.kernels.hf_masks.chunk_visibility): its
  place in its chunk and its row's padding, read from the position ids or else from the mask,
  which states them exactly; the chunk's number is never needed (and cannot be read once a window
  cache has slid). Where the chunk is a multiple of the kernel's key tile (Llama 4's 8192), these
  are the tiles the absolute positions give;
* `indices` [B, Tq, k] (DeepSeek-V3.2 and the other DSA models pass their indexer's top-k keys so
  to every implementation but eager and sdpa, and the plain causal mask beside it): a kernel
  serving "sparse_indexer" computes each query over the keys it both may see and was given, in
  its view's coordinates (a query the indexer did not give itself is computed at its view's last
  coordinate; a padded query, which sees none, is not computed);
* the mask (kvfid.kernels.hf_masks): ours (`kvfid_mask`) builds it the stock `sdpa` way and passes None
  exactly when it is the plain causal pattern. A mask equal to the pattern the kernel applies from
  the positions above (causal, left padding, window) is read as padding; any other mask in
  which each query sees itself and no later key (a visibility mask, e.g. packed branches given to
  the model as a 4-D `attention_mask`) goes to a kernel serving "visibility" as
  `visibility=[B, Tq, Tk]` bool, and is refused on a sliding-window layer, or on a chunked layer
  unless it is the chunk's pattern; anything
  else (right padding, a static cache's unfilled slots, bidirectional masks) is refused before
  compute, as is a mechanism the kernel does not serve (`serves`).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvfid.kernels import KernelRefusal
from kvfid.kernels.hf_masks import kvfid_mask, left_padding, own_starts, place_keys  # noqa: F401  (public here)

# Why a model whose attention is this wrapper cannot be compiled whole (the refusal's reason, read
# by kvfid.stacks.compiled; docs/hazards.md, "A +compile stack on kvfid's own attention").
COMPILE_BREAKS = ("its attention reads positions and the mask on the host (int(own.max()) and "
                  "the mask checks in kernels/hf_masks.py), so torch.compile graph-breaks in every "
                  "layer; the frames dynamo resumes in share transformers' one `wrapped_func` "
                  "code object, which passes dynamo's recompile_limit (8) and from then on runs "
                  "eagerly, so a +compile stack would measure a mix of compiled and eager code")
NAME = "kvfid_triton"
# Mechanism names the Triton kernel serves (kvfid.stacks.serving.MECHANISMS; the harness reads
# this before compute and refuses a model with a layer mechanism not listed); the factory refuses
# any other active one before calling the kernel.
# "visibility": a mask other than the positions' pattern (kvfid.kernels.hf_masks), taken as it is.
SERVES: frozenset[str] = frozenset({"sliding_window", "chunked_attention", "softcap", "sinks",
                                    "split_head_dims", "visibility", "sparse_indexer"})
# The Triton kernel's own options (its variant twins, a tiling), given in `kernel_options`.
OPTIONS: frozenset[str] = frozenset({"align_own", "align_absolute", "config"})


kvfid_triton_mask = kvfid_mask  # the name tests and older callers use


def layer_mechanisms(module: torch.nn.Module, kwargs: dict) -> dict:
    """The per-layer attention mechanisms of a call: window, chunk, softcap, sinks (None if absent)."""
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    chunk = None
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer is not None and layer < len(layer_types) \
            and layer_types[layer] == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
    return {"window": kwargs.get("sliding_window"), "chunk": chunk, "softcap": kwargs.get("softcap"),
            "sinks": sinks}


def _refuse(name: str, what: str) -> KernelRefusal:
    return KernelRefusal(f"{name}: {what} is not supported by this kernel")


def _check_keywords(name: str, kwargs: dict, kernel_options: dict, options: frozenset[str]) -> None:
    """Refuse a kernel option the kernel does not take, a near miss of the keyword
    `kernel_options` itself, and a kernel option (or a near miss of one) given as a plain keyword:
    each would pass through as a transformers keyword and be dropped. Other keywords are
    transformers' (each family passes its own: `s_aux`, `position_ids`, ...) and pass through unread.
    A set of names that passed once passes without another look (every layer of every step
    passes the same ones)."""
    _check_names(name, frozenset(kwargs), frozenset(kernel_options or ()), options)


@functools.lru_cache(maxsize=256)
def _check_names(name: str, kwargs: frozenset[str], kernel_options: frozenset[str],
                 options: frozenset[str]) -> None:
    if unknown := sorted(kernel_options - options):
        raise ValueError(f"{name}: unknown kernel option {unknown[0]!r}; allowed: {_listed(options)}")
    for keyword in sorted(kwargs):
        if difflib.get_close_matches(keyword, ("kernel_options",), n=1, cutoff=0.75):
            raise ValueError(f"{name}: keyword {keyword!r} looks like a misspelling of kernel_options "
                             f"(allowed in it: {_listed(options)})")
        if keyword in options or difflib.get_close_matches(keyword, options, n=1, cutoff=0.75):
            raise ValueError(f"{name}: keyword {keyword!r} looks like a kernel option; give it in "
                             f"kernel_options (allowed: {_listed(options)})")


def _listed(names: frozenset[str]) -> str:
    return ", ".join(sorted(names)) or "none"


def make_attention(name: str, attention_into: Callable, serves: frozenset[str],
                   options: frozenset[str] = frozenset()) -> Callable:
    """The AttentionInterface function of a kernel with the shared `attention_into` interface that
    serves the mechanisms named in `serves` and takes the extra keywords named in `options`."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, *,
                  kernel_options: dict | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """query [B, Hq, T, Dqk], key [B, Hkv, S, Dqk], value [B, Hkv, S, Dv] -> ([B, T, Hq, Dv],
        None). `kernel_options` go to the kernel as they are (tests: its variant twins)."""
        _check_keywords(name, kwargs, kernel_options or {}, options)
        batch, n_q_heads, q_len, _ = query.shape
        kv_len, v_dim = key.shape[2], value.shape[-1]
        if dropout:
            raise KernelRefusal(f"{name}: attention dropout ({dropout}) is not supported; use the model "
                                 "in eval mode")
        if kwargs.get("position_bias") is not None:
            raise _refuse(name, "an additive position bias")
        if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
            raise KernelRefusal(f"{name}: only causal (decoder) attention is supported")
        mech = layer_mechanisms(module, kwargs)
        if mech["window"] is not None and mech["window"] >= kv_len:
            mech["window"] = None  # covers every key a query can see: plain causal attention
        for mechanism, active, what in (
                ("sliding_window", mech["window"] is not None,
                 f"sliding-window attention (window {mech['window']} < {kv_len} keys)"),
                ("chunked_attention", mech["chunk"] is not None, "block-local (chunked) attention"),
                ("softcap", mech["softcap"] is not None, "logit softcapping"),
                ("sinks", mech["sinks"] is not None, "attention sinks"),
                ("split_head_dims", v_dim != query.shape[-1], "different q/k and v head dims")):
            if active and mechanism not in serves:
                raise _refuse(name, what)
        selection = kwargs.get("indices")   # a sparse indexer's keys per query (DeepSeek-V3.2)
        if selection is not None and "sparse_indexer" not in serves:
            raise _refuse(name, "a sparse indexer's selection of keys (`indices`)")
        placed = place_keys(name, attention_mask, kwargs.get("position_ids"), batch, q_len, kv_len,
                            mech["window"], mech["chunk"], serves, query.device, selection)
        for local in ("window", "chunk"):   # read from the mask, or taken into the visibility
            mech[local] = placed.pop(local, mech[local])
        # Padded query positions (and queries that see no key) are not computed by the kernel:
        # zeros, not uninitialized memory.
        computes_all = placed.get("first_valid") is None and placed.get("visibility") is None
        empty = torch.empty if computes_all else torch.zeros
        out = empty((batch, q_len, n_q_heads, v_dim), dtype=query.dtype, device=query.device)
        attention_into(out.transpose(1, 2), query, key, value,  # writes a [B, Hq, T, Dv] view
                       scale=scaling, **placed, **mech, **(kernel_options or {}))
        return out, None

    attention.__name__ = attention.__qualname__ = f"{name}_attention"
    return attention


def register_kernel(name: str, attention: Callable) -> str:
    """Register an attention function and kvfid's mask function under `name` (idempotent)."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, kvfid_mask)
    return name


def _triton_attention_into(out, q, k, v, **kwargs):
    from kvfid.kernels.attention.kernel import attention_into  # triton loads only when the kernel is called

    return attention_into(out, q, k, v, **kwargs)


kvfid_triton_attention = make_attention(NAME, _triton_attention_into, SERVES, OPTIONS)


def register() -> str:
    """Register the Triton kernel as "kvfid_triton" (idempotent); returns the name."""
    return register_kernel(NAME, kvfid_triton_attention)
