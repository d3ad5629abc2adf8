"""Argument checks of kvfid.kernels.attention.kernel: refused before any launch, with one clear line."""

from __future__ import annotations

import torch

from kvfid.kernels import FLOAT_DTYPES, triton_runs_on
from kvfid.kernels.attention.config import MAX_HEAD_DIM


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D q, k, v [B, H, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on batch, heads and length; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    (bq, hq, tq, dq), (bk, hkv, tk, dk) = q.shape, k.shape
    if bq != bk or dq != dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if max(dq, v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported; got {dq} and {v.shape[-1]}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if tq > tk:
        raise ValueError(f"queries ({tq}) must be the last positions of the keys ({tk}): Tq <= Tk")
    if not triton_runs_on(q.device):
        raise ValueError(f"attention: tensors on {q.device} need CUDA or the Triton interpreter "
                         "(TRITON_INTERPRET=1 set before triton is imported)")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention supports {FLOAT_DTYPES} with one dtype for q, k, v; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")


def check_mechanisms(n_q_heads: int, key_start: int, window, chunk, softcap, sinks) -> None:
    if key_start < 0:
        raise ValueError(f"key_start must be >= 0; got {key_start}")
    for name, value in (("window", window), ("chunk", chunk)):
        if value is not None and int(value) < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be > 0; got {softcap}")
    if sinks is not None and tuple(sinks.shape) != (n_q_heads,):
        raise ValueError(f"sinks must be [Hq={n_q_heads}]; got {tuple(sinks.shape)}")


def first_valid_rows(first_valid: torch.Tensor | None, batch: int, key_start: int, kv_len: int,
                 device: torch.device) -> torch.Tensor | None:
    """Validated per-row padding (absolute first valid key) as contiguous int64 [B] on `device`;
    None when there is none."""
    if first_valid is None:
        return None
    if first_valid.shape != (batch,) or first_valid.dtype.is_floating_point:
        raise ValueError(f"first_valid must be integer [B={batch}]; got {first_valid.dtype}"
                         f"{tuple(first_valid.shape)}")
    if bool((first_valid < 0).any()):
        raise ValueError(f"first_valid must be >= 0; got {first_valid.tolist()}")
    # A row padded past every key so far (a chunk of pure padding) has no valid key yet.
    return first_valid.to(device=device, dtype=torch.int64).clamp(max=key_start + kv_len).contiguous()
