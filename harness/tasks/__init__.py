"""Tasks: what a command runs end to end (a run and its report, bench, the ledger views, kernels,
compare, gpu-check)."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
