"""What runs: the stack as one context, the backend registry and what each backend refuses, the
mechanisms a model needs, the variant twins, torch.compile."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
