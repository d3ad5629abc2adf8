"""What `blame` reads: every aten op of a forward with its module, the slices at the blamed
position, and how a stepped recurrence aligns."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
