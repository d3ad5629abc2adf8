"""The implementations of each op that the kernel comparison checks, and what each one claims.

This module owns `IMPLEMENTATIONS`: (op, name) -> `Implementation`, for every op the models use
(attention decode and prefill, matmul, RMSNorm, softmax, log-softmax): stock torch, SDPA and eager
as transformers calls them, the Triton kernels, the stock ops under the batch-invariant modes, and
each op's deliberately variant twin (kvfid.stacks.twins), the control that shows the checks can fail on
any machine. Each entry says which invariances (batch, sequence) it claims; kvfid.environment.invariance
checks them.
A test may replace an entry (monkeypatch.setitem).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvfid.stacks import twins
from kvfid.kernels.attention.kernel import attention
from kvfid.kernels.invariant.matmul import matmul
from kvfid.kernels.invariant.norm import rms_norm
from kvfid.kernels.invariant.softmax import log_softmax, softmax

OPS = ("attention-decode", "attention-prefill", "matmul", "rms-norm", "softmax", "log-softmax")
ATTENTION_OPS = OPS[:2]


@dataclass(frozen=True)
class Implementation:
    """One way of computing an op. `run` takes the op's inputs (attention: q, k, v; row ops: x and
    the op's parameters); `mode` is the batch-invariant mode it runs under (None: none)."""

    op: str
    name: str
    run: Callable[..., torch.Tensor]
    claims_batch: bool
    claims_sequence: bool
    mode: str | None = None
    triton: bool = False  # runs Triton kernels (in the interpreter on CPU: checked on fewer rows)
    cpu_skip: str | None = None  # why it runs on CUDA only (None: runs everywhere)
    control: bool = False  # a deliberately variant twin: both checks must see it differ


# ---- the implementations -----------------------------------------------------------------------

def _transformers_attention(forward: Callable, q, k, v, mask) -> torch.Tensor:
    """Call transformers' attention function as a Llama layer does; [B, T, H, D] back to [B, H, T, D]."""
    layer = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], is_causal=True, training=False)
    out, _ = forward(layer, q, k, v, mask, scaling=1.0 / math.sqrt(q.shape[-1]), dropout=0.0)
    return out.transpose(1, 2)


def _causal(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[1, 1, q_len, kv_len] bool, True = attend: queries are the last q_len positions."""
    q_pos = torch.arange(q_len, device=device) + (kv_len - q_len)
    return (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]


def attention_sdpa(q, k, v) -> torch.Tensor:
    """transformers' `sdpa` with the mask its mask function gives: none for a decode step or a
    full prefill (is_causal), a boolean mask for a chunk over a longer cache."""
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = None if q_len in (1, kv_len) else _causal(q_len, kv_len, q.device)
    return _transformers_attention(sdpa_attention_forward, q, k, v, mask)


def attention_eager(q, k, v) -> torch.Tensor:
    """transformers' `eager` (matmul, softmax in fp32, matmul) with its additive float mask."""
    # lazy: loads tokenizers and a model family: only here
    from transformers.models.llama.modeling_llama import eager_attention_forward

    allowed = _causal(q.shape[2], k.shape[2], q.device)
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    mask.masked_fill_(~allowed, torch.finfo(q.dtype).min)
    return _transformers_attention(eager_attention_forward, q, k, v, mask)


def attention_triton(q, k, v) -> torch.Tensor:
    return attention(q, k, v)


def attention_native(q, k, v) -> torch.Tensor:
    # lazy: `attention` is also this module's name
    from kvfid.kernels.attention.native import attention

    return attention(q, k, v)


def matmul_stock(x, weight) -> torch.Tensor:
    return F.linear(x, weight)  # a bias-free projection, as in Llama / SmolLM2


def matmul_triton(x, weight) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return matmul(rows, weight.t()).reshape(*x.shape[:-1], weight.shape[0])


def rms_norm_stock(x, weight, eps) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward (fp32 variance by `mean`, weight applied in x's dtype),
    called on the weight directly, so no module is built per call."""
    # lazy: loads tokenizers and a model family: only here
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward(SimpleNamespace(weight=weight, variance_epsilon=eps), x)


def rms_norm_triton(x, weight, eps) -> torch.Tensor:
    return rms_norm(x, weight, eps)


def softmax_triton(x) -> torch.Tensor:
    return softmax(x, -1)


def log_softmax_triton(x) -> torch.Tensor:
    return log_softmax(x, -1)


def _softmax_stock(x) -> torch.Tensor:
    return torch.softmax(x, -1)


def _log_softmax_stock(x) -> torch.Tensor:
    return torch.log_softmax(x, -1)


def _registry() -> dict[tuple[str, str], Implementation]:
    impls = []
    for op in ATTENTION_OPS:
        impls += [
            Implementation(op, "sdpa", attention_sdpa, False, False),
            Implementation(op, "eager", attention_eager, False, False),
            # What an `eager/...+bi` stack runs: on CPU the rowwise mode, on CUDA the Triton mode.
            Implementation(op, "eager+rowwise-mode", attention_eager, True, False, mode="rowwise"),
            Implementation(op, "eager+triton-mode", attention_eager, True, False, mode="triton",
                           triton=True, cpu_skip="a Triton bmm and softmax per head: too slow for "
                                                 "the interpreter"),
            Implementation(op, "eager+tiled-mode", attention_eager, True, False, mode="tiled"),
            Implementation(op, "triton", attention_triton, True, True, triton=True),
            # The native CPU path of the same contract: fixed-shape stock bmm tiles.
            Implementation(op, "native", attention_native, True, True),
            Implementation(op, "twin", twins.attention_twin, False, False, control=True),
        ]
    row_ops = {"matmul": (matmul_stock, matmul_triton, twins.matmul_twin),
               "rms-norm": (rms_norm_stock, rms_norm_triton, twins.rms_norm_twin),
               "softmax": (_softmax_stock, softmax_triton, twins.softmax_twin),
               "log-softmax": (_log_softmax_stock, log_softmax_triton, twins.log_softmax_twin)}
    for op, (stock, triton, twin) in row_ops.items():
        impls += [
            Implementation(op, "stock", stock, False, False),
            Implementation(op, "triton", triton, True, True, triton=True),
            # The stock op under the modes, as a `+bi` stack runs it. For matmul and the softmaxes
            # the Triton mode calls the very kernel of the row above; RMSNorm goes through `mean`.
            Implementation(op, "triton-mode", stock, True, True, mode="triton", triton=True,
                           cpu_skip=None if op == "rms-norm" else "the `triton` row's kernel call, "
                                                                  "repeated; interpreter time saved"),
            Implementation(op, "rowwise-mode", stock, True, True, mode="rowwise"),
            # Fixed tiles of rows per stock call, each shape probed here first (kvfid.kernels.invariant.tiled).
            Implementation(op, "tiled-mode", stock, True, True, mode="tiled"),
            Implementation(op, "twin", twin, False, False, control=True),
        ]
    return {(i.op, i.name): i for i in impls}


# (op, implementation name) -> Implementation; a test may replace an entry (monkeypatch.setitem).
IMPLEMENTATIONS = _registry()
