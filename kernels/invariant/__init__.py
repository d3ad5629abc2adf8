"""The batch-invariant mode: aten overrides for matmul, norms and softmax (Triton kernels or tiled
stock calls on a route timed per machine)."""
