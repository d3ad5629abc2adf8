"""Runs: cases, the matrix, the ledger, aggregates, audits, repro and bench."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
