"""Reports: run reports, figures, comparisons, the index, bench reports."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
