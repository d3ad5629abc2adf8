"""The one product the kernels use on a GPU: `tl.dot` with fp32 accumulation.

bf16/fp16 operands go to the tensor cores as they are (`input_precision` only applies to fp32
operands, and asking IEEE of bf16 makes Triton upcast them and fall back to CUDA-core FMAs);
fp32 operands stay IEEE fp32 (no TF32), on the CUDA cores.
"""

import triton.language as tl

from kvfid.kernels.jit import device_function


@device_function
def mma(a, b, acc):
    """`a @ b + acc` (acc fp32): tensor cores for bf16/fp16 operands, IEEE fp32 for fp32 ones."""
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out
