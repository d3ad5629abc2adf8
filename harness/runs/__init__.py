"""Runs: cases, the matrix of units, the ledger, aggregates and audits."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
