"""The fidelity protocol: models, stacks and twins, decoding, caches, constructions, records."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
