"""devices.py: device and precision choice, and the peak FLOP/s that MFU is measured against."""

from __future__ import annotations

import pytest
import torch

from gptkit.devices import peak_flops_for_device, resolve_device, resolve_dtype
from gptkit.errors import UserError


def test_cpu_has_no_known_peak():
    assert peak_flops_for_device("cpu", torch.float32) is None
    assert peak_flops_for_device("cpu", torch.bfloat16) is None


@pytest.mark.parametrize(
    "gpu_name, dtype, peak",
    [("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12), ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
     ("NVIDIA H200", torch.float32, 494e12), ("NVIDIA A100-SXM4-80GB", torch.float16, 312e12),
     ("NVIDIA GeForce RTX 4090", torch.bfloat16, None)],
)  # fmt: skip
def test_known_gpu_peaks(monkeypatch, gpu_name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu_name)
    assert peak_flops_for_device("cuda", dtype) == peak


def test_device_and_dtype_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    with pytest.raises(UserError, match="unknown device"):
        resolve_device("tpu:0:x")
