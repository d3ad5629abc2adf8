"""Runs: cases, the matrix, the ledger, aggregates, audits, and the diagnoses on one item
(repro, replay, blame)."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
