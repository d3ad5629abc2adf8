"""The `kvfid` package and its kernels: one import name beside the Hugging Face `kernels`
distribution (which transformers 5.25 requires), and the Triton interpreter selected once, by
`kvfid/__init__`, before triton loads when there is no CUDA device.

The interpreter checks run in child processes with TRITON_INTERPRET removed from their
environment: this process's conftest sets the variable before any test runs, so checking it here
would pass whether or not the package sets it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfid import kernels

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_kvfid_kernels_is_not_the_hub_distribution():
    assert kernels.__name__ == "kvfid.kernels"
    assert Path(kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def _hub_installed() -> bool:
    from importlib import metadata

    try:
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _hub_installed(), reason="the Hub's kernels distribution is not installed")
def test_from_the_checkout_root_the_name_kernels_is_the_hub_distribution():
    # `python -c` run in the checkout puts its root, and so the folder kernels/, first on
    # sys.path; the folder hands the name over to the installed distribution, which transformers
    # imports.
    hub, ours = _python("import kernels, kvfid.kernels as ours\nprint(kernels.__file__)\n"
                        "print(ours.__file__)", ROOT)
    assert Path(hub).resolve() != ROOT / "kernels" / "__init__.py"
    assert Path(ours).resolve() == ROOT / "kernels" / "__init__.py"


def test_without_the_hub_distribution_transformers_reports_hub_kernels_absent(tmp_path):
    # The control: this venv's packages without the Hub's `kernels` (as the GPU image's
    # transformers 5.17 and vLLM's 5.19 have them), from the checkout's root: the folder imports
    # under its own name with no `__version__`, and transformers, probing the name, reports hub
    # kernels absent instead of failing.
    site = Path(torch.__file__).resolve().parents[1]
    for entry in site.iterdir():
        if entry.name != "kernels" and not entry.name.startswith("kernels-"):
            (tmp_path / entry.name).symlink_to(entry)
    code = ("import kernels, transformers.utils\n"
            "print(kernels.__file__, hasattr(kernels, '__version__'), "
            "transformers.utils.is_kernels_available())")
    where, versioned, available = _python_no_site(code, tmp_path)
    assert Path(where).resolve() == ROOT / "kernels" / "__init__.py"
    assert (versioned, available) == ("False", "False")


def _python_no_site(code: str, site: Path) -> list[str]:
    """`code` run from the checkout's root without site-packages, with `site` on the path."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH",
                                                                "PYTHONSAFEPATH")}
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT,
                          env={**clean, "PYTHONPATH": str(site)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.skipif(not _hub_installed(), reason="the Hub's kernels distribution is not installed")
def test_transformers_runs_a_model_beside_the_hub_distribution():
    # transformers 5.25 imports the Hub's `kernels` when it loads; run from the checkout root,
    # where the folder kernels/ would otherwise take its place ("cannot import name
    # 'CUDAProperties'").
    code = ("import torch, transformers\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
            "c = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, "
            "num_attention_heads=2, num_key_value_heads=1, vocab_size=50)\n"
            "print(LlamaForCausalLM(c)(torch.tensor([[1, 2]])).logits.shape[-1])")
    assert _python(code, ROOT) == ["50"]


def test_importing_kvfid_loads_no_torch_and_selects_the_interpreter_before_triton():
    # Unset before (the control), unset after `import kvfid` (nothing heavy), and "1" once a
    # kernel module has imported triton, where there is no CUDA.
    code = ("import os, sys\nprint(os.environ.get('TRITON_INTERPRET', 'unset'))\nimport kvfid\n"
            "print(os.environ.get('TRITON_INTERPRET', 'unset'), 'torch' in sys.modules)\n"
            "import kvfid.kernels.attention.kernel\nprint(os.environ.get('TRITON_INTERPRET', 'unset'))")
    expected = "unset" if torch.cuda.is_available() else "1"
    assert _python(code, ROOT) == ["unset", "unset", "False", expected]


def test_a_users_interpreter_setting_is_kept_and_triton_first_still_selects_it():
    code = "import kvfid.kernels.attention.kernel, os\nprint(os.environ['TRITON_INTERPRET'])"
    assert _python(code, ROOT, TRITON_INTERPRET="0") == ["0"]
    # triton imported before kvfid: the package selects the interpreter at its own import, before
    # any kernel of kvfid's is decorated.
    code = ("import os, triton, kvfid\nprint(os.environ.get('TRITON_INTERPRET', 'unset'))")
    assert _python(code, ROOT) == ["unset" if torch.cuda.is_available() else "1"]
