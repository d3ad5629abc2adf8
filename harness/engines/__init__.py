"""Serving engines: vLLM as an engine (stock and faithful), its paged KV read bitwise, its price,
and an OpenAI-compatible server."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
