"""The `kernels` package: not mistaken for Hugging Face's hub-kernels, and it selects the Triton
interpreter itself when there is no CUDA device.

The interpreter check runs in a child process with TRITON_INTERPRET removed from its environment:
this process's conftest sets the variable before any test runs, so checking it here would pass
whether or not the package sets it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
import transformers.utils

import kernels

ROOT = Path(__file__).resolve().parent.parent


def test_transformers_reports_hub_kernels_unavailable():
    # transformers finds a module named `kernels` (ours) and then checks a distribution version;
    # it must conclude that hub kernels are not installed.
    assert importlib.util.find_spec("kernels").origin == kernels.__file__
    assert transformers.utils.is_kernels_available() is False


def test_package_has_no_version_attribute():
    assert not hasattr(kernels, "__version__")


def test_importing_kernels_selects_the_interpreter_without_cuda():
    # A fresh interpreter started without the variable: it is unset before the import (the
    # control) and "1" after importing a kernel module (which pulls the package in before triton).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os\nprint(os.environ.get('TRITON_INTERPRET', 'unset'))\n"
            "import kernels.attention.kernel\nprint(os.environ.get('TRITON_INTERPRET', 'unset'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    expected = "unset" if torch.cuda.is_available() else "1"
    assert done.stdout.split() == ["unset", expected]
