"""kvfid's harness: the fidelity protocol and everything around it.

Importing `kernels` first is deliberate: without CUDA, Triton must run in its interpreter, and the
switch (TRITON_INTERPRET=1) only counts if it is set before anything imports triton, which loading
a transformers model does.
"""

import kernels  # noqa: F401  (sets TRITON_INTERPRET on machines without CUDA)
