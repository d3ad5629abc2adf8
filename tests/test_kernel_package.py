"""The `kernels` package: not mistaken for Hugging Face's hub-kernels (and refusing, saying why,
where that distribution is installed), and it selects the Triton interpreter itself when there is
no CUDA device.

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


def test_with_the_hub_kernels_distribution_installed_the_import_refuses_saying_why(tmp_path):
    # transformers 5.25 requires the Hub's `kernels`; with its metadata on the path, transformers
    # would import this package in its place ("cannot import name 'CUDAProperties'").
    info = tmp_path / "kernels-0.19.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run([sys.executable, "-c", "import kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "Hugging Face `kernels` distribution (0.19.1)" in done.stderr, done.stderr
    assert "pip uninstall kernels" in done.stderr
    # Control: without that metadata (this process, whose tests import the package) no refusal.
    assert kernels._HUB_KERNELS is None
