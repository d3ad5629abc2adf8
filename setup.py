"""kvfid: a kernel-aware benchmarking harness for LLM inference fidelity."""

from setuptools import find_packages, setup

# One import name, `kvfid`, over the folders the repository keeps: harness/ is `kvfid`, kernels/
# is `kvfid.kernels`, and the shipped case files (cases/) are package data at `kvfid/cases`.
PACKAGE_DIR = {"kvfid": "harness", "kvfid.kernels": "kernels", "kvfid.cases": "cases"}
PACKAGES = ["kvfid", *(f"kvfid.{p}" for p in find_packages("harness")),
            "kvfid.kernels", *(f"kvfid.kernels.{p}" for p in find_packages("kernels")),
            "kvfid.cases"]

setup(
    name="kvfid",
    version="0.1.0",
    description="Is a rebuilt KV state the live state? Per kernel, precision and stack.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    package_dir=PACKAGE_DIR,
    packages=PACKAGES,
    package_data={"kvfid.cases": ["*.toml", "*.jsonl"]},
    install_requires=[
        # Tested at both ends: the GPU image's torch 2.11, triton 3.6, transformers 5.17 (`make
        # test-compat`) and the newest, torch 2.15 and transformers 5.25 with the Hub's `kernels`
        # beside kvfid (`make test-newest`); `make test` runs this machine's torch 2.13 CPU
        # build. Install torch first, pinned: a bare requirement pulls a multi-GB CUDA build.
        "torch>=2.11,<3",
        "triton>=3.6,<4",
        "transformers>=5.17,<6",
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
        "test": ["pytest>=8,<9.2", "pytest-benchmark>=4", "pytest-xdist>=3", "build>=1"],
    },
    entry_points={
        "console_scripts": ["kvfid=kvfid.cli:main"],
        # vLLM loads these in every engine process; kvfid's acts only with KVFID_FAITHFUL=1.
        "vllm.general_plugins": ["kvfid_faithful=kvfid.engines.faithful:register"],
    },
)
