"""The fidelity protocol: models, stacks, decoding, caches, constructions, replay and blame."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
