"""The typed records a unit measures (schema 3), their JSON round trip, and the older schemas read
back."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
