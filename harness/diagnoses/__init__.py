"""The diagnoses on one item: repro (and of a stage program), replay of an engine's trajectories,
re-scoring, blame, and their printing."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
