"""The fidelity protocol on one item and one stack: the arms, constructions, decoding, co-batches,
the serving engines' constructions, replicas, transplants and the crossing."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
