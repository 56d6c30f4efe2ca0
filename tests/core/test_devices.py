"""devices.py: device and precision choice, and the peak FLOP/s that MFU is measured against."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from gptkit.core import devices
from gptkit.core.devices import peak_flops_for_device, resolve_device, resolve_dtype
from gptkit.core.errors import UserError
from helpers import REPO, clean_env

# Allocates, fills and frees a 64 MiB block 8 times after a first one, with or without keep_freed_memory (argv[1]),
# and prints the page faults those 8 took.
REUSE_PROBE = """
import ctypes, resource, sys
from gptkit.core.devices import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def fill_and_free(size):
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    libc.free(block)
fill_and_free(64 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    fill_and_free(64 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_cpu_has_no_known_peak():
    assert peak_flops_for_device("cpu", torch.float32) is None
    assert peak_flops_for_device("cpu", torch.bfloat16) is None


@pytest.mark.parametrize(
    "gpu_name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H200", torch.float32, 494e12),
        ("NVIDIA A100-SXM4-80GB", torch.float16, 312e12),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, None),
    ],
)
def test_known_gpu_peaks(monkeypatch, gpu_name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu_name)
    assert peak_flops_for_device("cuda", dtype) == peak


def test_device_and_dtype_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    with pytest.raises(UserError, match="unknown device"):
        resolve_device("tpu:0:x")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_memory_is_reused_without_faulting_its_pages_in_again():
    def faults(mode: str) -> int:
        probe = [sys.executable, "-c", REUSE_PROBE, mode]
        return int(subprocess.run(probe, capture_output=True, text=True, check=True, cwd=REPO, env=clean_env()).stdout)

    # By default glibc maps a 64 MiB block afresh each time (above its largest own threshold, 32 MiB): each fill
    # faults every page in, at least one per 2 MiB even with transparent huge pages.
    assert faults("default") >= 8 * (64 // 2)
    assert faults("keep") < 8  # kept: the same pages serve every block


def test_cpu_training_keeps_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(devices, "keep_freed_memory", lambda: calls.append(True) or True)
    monkeypatch.setattr(torch, "set_flush_denormal", lambda on: True)  # the test process keeps its own mode
    devices.tune_for_training(torch.device("cpu"), None)
    assert calls == [True]
