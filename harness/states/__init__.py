"""Layer states at a boundary: read from and put back into transformers' caches, fingerprinted,
compared bit by bit, and cut for transplants."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
