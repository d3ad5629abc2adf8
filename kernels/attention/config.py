"""The attention kernel's fixed tilings: a function of (arch, dtype, head dim class: up to 64, up
to 128, above), never of the batch or a length (kvfid.kernels.attention.kernel's invariance
argument)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import triton

from kvfid.kernels import FLOAT_DTYPES, gpu_arch, uses_tl_dot

BLOCK_M = 16  # query positions per tile (per query head of the group), on every path


@dataclass(frozen=True)
class AttentionConfig:
    """One execution path's fixed tiling: a function of (arch, dtype), never of batch or length."""

    block_n: int  # keys per tile; a multiple of BLOCK_M (see the module docstring)
    max_tile_rows: int  # query rows per program: group heads are split into chunks of this many
    num_warps: int
    num_stages: int
    use_dot: bool = True
    segment: int = 0  # keys per segment of the split path (a multiple of block_n; 0: no split)


# The interpreter is faster with fewer, larger key tiles; warps and stages mean nothing there.
INTERPRETER_CONFIG = AttentionConfig(block_n=128, max_tile_rows=64, num_warps=4, num_stages=1,
                                     use_dot=False)
# Sized for H100/H200 (and A100) with `kvfid compile`: no config spills, shared memory well within
# the limit. bf16/fp16: 64 query rows (4 heads of a GQA group) share each 64-key tile, 8 warps on
# every arch (4 spill at head dim 128). fp32 keeps IEEE
# products on the CUDA cores: 32 rows x 16 keys over 8 warps (32 keys left an 8-24 B stack on
# sm_80 and sm_100 at head dim 128).
# The GPU configs take the split path: 1024-key segments. A B=1 decode at 32k keys then runs 32
# programs per (KV head, group chunk), 64-256 for 2-8 KV heads on a 132-SM H200 (docs/gpu.md),
# at the cost of 1024 keys' K/V (256-512 KB at head dim 64-128) read per 32 KB state written.
SEGMENT = 1024
_HALF = {"sm_80": AttentionConfig(block_n=64, max_tile_rows=64, num_warps=8, num_stages=2, segment=SEGMENT),
         # sm_90: 4 warps (one warp group) spilled at head dim 128 once windows and the
         # fully-masked-tile identity were added (255 registers); 8 use 190-220.
         "sm_90": AttentionConfig(block_n=64, max_tile_rows=64, num_warps=8, num_stages=2, segment=SEGMENT),
         # sm_100: the padding-aware kernel spilled 8 B with 4 warps and 2 stages.
         "sm_100": AttentionConfig(block_n=64, max_tile_rows=64, num_warps=8, num_stages=1, segment=SEGMENT)}
# fp32: sm_80 and sm_90 take one stage (two left an 8 B spill for the padded prefill: sm_80 before
# windows, sm_90 after); sm_100 two (one spilled there). sm_90 stacks 16 query rows, not 32: with
# 32, triton 3.6 (the GPU image's) left an 8 B spill in its decode, prefill and padded configs.
_FP32 = {arch: AttentionConfig(block_n=16, max_tile_rows=16 if arch == "sm_90" else 32,
                               num_warps=8, num_stages=2 if arch == "sm_100" else 1,
                               segment=SEGMENT) for arch in _HALF}
CONFIGS = {(arch, dtype): _FP32[arch] if dtype == torch.float32 else _HALF[arch]
           for arch in _HALF for dtype in FLOAT_DTYPES}
# Head dims up to 64 (Qwen2.5-0.5B's 14/2 heads, gpt-oss): 128 query rows, so a GQA group of up
# to 8 heads shares each key tile in one program (group 7 otherwise runs as two 4-head chunks,
# each streaming its KV head's whole cache). Checked by `kvfid compile` (no spills on sm_80, sm_90
# and sm_100); a group of at most 4 keeps the same binary as CONFIGS' (the same GROUP_TILE).
_NARROW_HALF = {arch: replace(config, max_tile_rows=128) for arch, config in _HALF.items()}
NARROW_CONFIGS = {(arch, dtype): _FP32[arch] if dtype == torch.float32 else _NARROW_HALF[arch]
                  for arch in _HALF for dtype in FLOAT_DTYPES}
# Head dims above 128 (up to 256: Gemma): fewer query rows and keys per tile, so the fp32
# accumulator and the Q tile fit in registers without spilling.
_WIDE_HALF = {arch: AttentionConfig(block_n=32, max_tile_rows=32, num_warps=8, num_stages=1, segment=SEGMENT)
              for arch in _HALF}
_WIDE_FP32 = {arch: AttentionConfig(block_n=16, max_tile_rows=16, num_warps=8, num_stages=1, segment=SEGMENT)
              for arch in _HALF}
WIDE_CONFIGS = {(arch, dtype): _WIDE_FP32[arch] if dtype == torch.float32 else _WIDE_HALF[arch]
                for arch in _HALF for dtype in FLOAT_DTYPES}


def config_for(device: torch.device, dtype: torch.dtype, head_dim: int = 128) -> AttentionConfig:
    """The fixed tiling on `device` for `dtype` and the layer's widest head dim: a function of the
    execution path and the model, never of batch or length."""
    if not uses_tl_dot(device):
        return INTERPRETER_CONFIG
    return config_table(head_dim)[(_arch(device), dtype)]


def config_table(head_dim: int) -> dict:
    """The (arch, dtype) -> config table for a layer's widest head dim."""
    return WIDE_CONFIGS if head_dim > 128 else NARROW_CONFIGS if head_dim <= 64 else CONFIGS


@lru_cache(maxsize=None)
def _arch(device: torch.device) -> str:
    """gpu_arch, asked once per device (a launch-path call: no driver query per layer)."""
    return gpu_arch(device)


@lru_cache(maxsize=None)
def unsplit(config: AttentionConfig) -> AttentionConfig:
    """The config without the split path (a call whose keys all lie in one segment)."""
    return replace(config, segment=0)


def group_tile_for(group: int, config: AttentionConfig) -> int:
    """Query heads of a GQA group stacked in one program (a power of two, at most the config's rows)."""
    return min(triton.next_power_of_2(group), max(1, config.max_tile_rows // BLOCK_M))


def head_dim_pad(head_dim: int) -> int:
    """The head dim a tile holds: tl.dot needs a reduction dim of at least 16, so tiny head dims
    are padded with masked zeros."""
    return max(16, triton.next_power_of_2(head_dim))


MAX_HEAD_DIM = 256
NO_WINDOW = 1 << 30  # the window argument when there is none: an i32, like real windows, so one
# binary serves both (positions past 2**30 are out of scope)
# The split path's workspace per launch at most; a longer prefill runs as query chunks.
WORKSPACE_BYTES = 256 << 20
# The split path's merge launch: elementwise over a tile's rows (no reduction across threads), so
# its warps and stages cannot change bits, so they follow the padded value head dim: with sm_90's
# 16-row fp32 tiles, 4 warps left an 8 B stack in the fp32 merge at head dim 64 (triton 3.6 and
# 3.9) and 8 warps one at head dim 128 (3.9). A 128-row tile (NARROW_CONFIGS' 8 heads) takes 16
# warps: with 8, sm_100's padded merge at head dim 64 left an 8 B stack (triton 3.9).
def merge_launch(v_dim_pad: int, rows: int = 64) -> dict:
    """The merge launch's warps and stages for a padded value head dim and a tile's query rows."""
    return {"num_warps": 16 if rows > 64 else 8 if v_dim_pad <= 64 else 4, "num_stages": 1}
