"""The `kernels` package must not pass for Hugging Face's hub-kernels package (DESIGN.md hazards)."""

from __future__ import annotations

import importlib.util
import os

import torch
import transformers.utils

import kernels


def test_transformers_reports_hub_kernels_unavailable():
    # transformers finds a module named `kernels` (ours) and then checks a distribution version;
    # it must conclude that hub kernels are not installed.
    assert importlib.util.find_spec("kernels").origin == kernels.__file__
    assert transformers.utils.is_kernels_available() is False


def test_package_has_no_version_attribute():
    assert not hasattr(kernels, "__version__")


def test_interpreter_is_selected_without_cuda():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
