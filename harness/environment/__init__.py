"""The environment: its record and key, kernel invariance, compile checks, probes."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
