"""The physical limit of a kernel launch: bytes moved and FLOPs against a GPU's peak rates.

`Work` is what one launch must do at a stated shape (the bytes it must read and write at least
once, the FLOPs of its useful arithmetic); `floor_us` is the time no implementation can beat on a
GPU: the larger of bytes / peak bandwidth and FLOPs / peak throughput (tensor-core throughput for
products on tensor cores, FP32 CUDA-core throughput otherwise). Peaks are dense (no 2:4 sparsity)
datasheet numbers at boost clock; a measured kernel is judged by how close it comes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    """Datasheet peaks of one GPU (SXM parts, dense)."""

    name: str
    arch: str  # the `kvfid compile` arch whose cubins it runs
    bandwidth: float  # bytes/s, HBM
    tensor_flops: float  # FLOP/s, bf16/fp16 tensor cores with fp32 accumulation
    fp32_flops: float  # FLOP/s, FP32 on the CUDA cores (FMA = 2 FLOPs)


GPUS = (
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): HBM2e 2,039 GB/s; BF16/FP16 tensor
    # 312 TFLOPS (624 with sparsity); FP32 19.5 TFLOPS.
    Gpu("A100", "sm_80", 2.039e12, 312e12, 19.5e12),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): HBM3 3.35 TB/s; BF16/FP16 tensor
    # 1,979 TFLOPS with sparsity, 989.5 dense; FP32 67 TFLOPS.
    Gpu("H100", "sm_90", 3.35e12, 989.5e12, 67e12),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): HBM3e 4.8 TB/s; compute as H100 SXM
    # (same GH100 die): BF16/FP16 989.5 TFLOPS dense, FP32 67 TFLOPS.
    Gpu("H200", "sm_90", 4.8e12, 989.5e12, 67e12),
    # NVIDIA HGX B200 (1,000 W) specifications, as tabulated at
    # glennklockwood.com/garden/processors/B200: HBM3e 8 TB/s; BF16/FP16 matrix 2,250 TFLOPS
    # dense (4,500 sparse); FP32 80 TFLOPS.
    Gpu("B200", "sm_100", 8.0e12, 2250e12, 80e12),
)


@dataclass(frozen=True)
class Work:
    """One launch at a stated shape: minimum bytes moved and useful FLOPs."""

    label: str  # the shape, e.g. "decode B32 Hq14 Hkv2 Tk1024"
    bytes: int
    flops: int


def gpus_for(arch: str) -> tuple[Gpu, ...]:
    """The GPUs in the table that run `arch` cubins."""
    return tuple(g for g in GPUS if g.arch == arch)


def floor_us(work: Work, gpu: Gpu, tensor_cores: bool) -> dict:
    """The time floor of `work` on `gpu` in microseconds, and which limit sets it."""
    memory = work.bytes / gpu.bandwidth
    compute = work.flops / (gpu.tensor_flops if tensor_cores else gpu.fp32_flops)
    return {"gpu": gpu.name, "floor_us": round(max(memory, compute) * 1e6, 3),
            "bound": "memory" if memory >= compute else "compute",
            "intensity": round(work.flops / work.bytes, 2) if work.bytes else None}


def roofline(works: tuple[Work, ...], arch: str, tensor_cores: bool) -> list[dict]:
    """Every work item against every GPU of `arch`."""
    return [{"shape": w.label, "bytes": w.bytes, "flops": w.flops, **floor_us(w, g, tensor_cores)}
            for w in works for g in gpus_for(arch)]
