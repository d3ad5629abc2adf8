"""Every Triton launch pins the code-generation options that change bits (kvfid.kernels.LAUNCH_OPTIONS),
and the environment record carries them."""

from __future__ import annotations

import pytest
import torch

from kvfid import kernels
from kvfid.environment import envinfo
from kvfid.kernels.attention import kernel as attention
from kvfid.kernels.invariant import matmul, norm, softmax


class RecordingKernel:
    """Stands in for a @triton.jit kernel: records each launch's keyword arguments, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


x = torch.randn(3, 40)
LAUNCHES = [  # (module, kernel name, a call that launches it)
    (attention, "_attention_kernel", lambda: attention.attention(*(torch.randn(1, 2, 5, 16) for _ in "qkv"))),
    (matmul, "_matmul_kernel", lambda: matmul.matmul(x, torch.randn(40, 8))),
    (norm, "_mean_kernel", lambda: norm.mean_last_dim(x)),
    (norm, "_rms_norm_kernel", lambda: norm.rms_norm(x, torch.ones(40))),
    (softmax, "_softmax_kernel", lambda: softmax.log_softmax(x)),
]


def test_the_pinned_options_turn_fp_fusion_off():
    assert kernels.LAUNCH_OPTIONS == {"enable_fp_fusion": False}


@pytest.mark.skipif(not kernels.triton_runs_on(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("module,name,call", LAUNCHES, ids=[name for _, name, _ in LAUNCHES])
def test_every_launch_passes_the_pinned_options(monkeypatch, module, name, call):
    recorder = RecordingKernel(getattr(module, name))
    monkeypatch.setattr(module, name, recorder)
    call()
    assert recorder.launches, f"{name} was not launched"
    for kwargs in recorder.launches:
        assert {k: kwargs.get(k) for k in kernels.LAUNCH_OPTIONS} == kernels.LAUNCH_OPTIONS, kwargs


def test_the_environment_record_carries_the_options():
    assert envinfo.collect(nvml=None)["triton_launch_options"] == kernels.LAUNCH_OPTIONS
