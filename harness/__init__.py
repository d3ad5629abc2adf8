"""kvfid's harness: the fidelity protocol and everything around it.

This package's top level (cli, commands, errors, names, outputs, checks) imports nothing heavy,
so `kvfid --help` starts without torch. Each subpackage (protocol, environment, runs, reports,
tasks) imports `kernels` first: without CUDA, Triton must run in its interpreter, and the switch
(TRITON_INTERPRET=1) only counts if it is set before anything imports triton, which loading a
transformers model does. Everything that can import triton lives in a subpackage.
"""
