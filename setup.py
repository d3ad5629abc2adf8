"""kvfid: a kernel-aware benchmarking harness for LLM inference fidelity."""

from setuptools import find_packages, setup

setup(
    name="kvfidelity",
    version="0.1.0",
    description="Is a rebuilt KV state the live state? Per kernel, precision and stack.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["harness", "harness.*", "kernels", "kernels.*"]),
    install_requires=[
        # Ranges admit this CPU machine (torch 2.13, transformers 5.24, triton 3.9) and the
        # GPU image (torch 2.11, triton 3.6, transformers 5.17). Install torch first, pinned.
        "torch>=2.11,<2.15",
        "triton>=3.6,<4",
        # transformers 5.25 depends on the Hub's `kernels` distribution, whose import name is
        # this project's kernels/ package: transformers then imports ours in its place and fails
        # ("cannot import name 'CUDAProperties' from 'kernels'"; kernels/__init__.py refuses).
        "transformers>=5.17,<5.25",
        "numpy>=1.26",
        "click>=8.1",
        "nvidia-ml-py>=12.535",
        "gguf>=0.10",
        "safetensors>=0.4",
        "tqdm>=4.66",
        "accelerate>=1.0",
    ],
    extras_require={
        # pytest < 9.2: 9.2 drops the node ids xdist's --dist loadgroup groups by, so a test
        # group stops landing on one worker (pytest-dev/pytest-xdist#1386; seen here with 9.2.0).
        "test": ["pytest>=8,<9.2", "pytest-benchmark>=4", "pytest-xdist>=3"],
    },
    entry_points={
        "console_scripts": ["kvfid=harness.cli:main"],
        # vLLM loads these in every engine process; kvfid's acts only with KVFID_FAITHFUL=1.
        "vllm.general_plugins": ["kvfid_faithful=harness.engines.faithful:register"],
    },
)
