"""devices.py: device and precision choice, and the peak FLOP/s that MFU is measured against."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from gptkit.core.devices import peak_flops_for_device, resolve_device, resolve_dtype
from gptkit.core.errors import UserError
from helpers import REPO, clean_env

# Allocates, fills and frees a 64 MiB block 8 times after a first one, as the C library does by default, after
# keep_freed_memory, or after tune_for_training on the CPU (argv[1]), and prints the page faults those 8 took.
REUSE_PROBE = """
import ctypes, resource, sys
import torch
from gptkit.core.devices import keep_freed_memory, tune_for_training
if sys.argv[1] == "keep":
    assert keep_freed_memory()
if sys.argv[1] == "tune":
    tune_for_training(torch.device("cpu"), None)
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


def run_probe(probe: str, *args: str) -> str:
    """Run a probe in a fresh process: the settings it changes are process-wide, so this one keeps its own."""
    command = [sys.executable, "-c", probe, *args]
    return subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO, env=clean_env()).stdout


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_memory_is_reused_without_faulting_its_pages_in_again():
    # By default glibc maps a 64 MiB block afresh each time (above its largest own threshold, 32 MiB): each fill
    # faults every page in, at least one per 2 MiB even with transparent huge pages.
    assert int(run_probe(REUSE_PROBE, "default")) >= 8 * (64 // 2)
    assert int(run_probe(REUSE_PROBE, "keep")) < 8  # kept: the same pages serve every block
    assert int(run_probe(REUSE_PROBE, "tune")) < 8  # CPU training keeps them too


# Prints a subnormal float32 (1e-39, below the smallest normal 1.18e-38) times one, before and after
# tune_for_training on the CPU.
DENORMAL_PROBE = """
import torch
from gptkit.core.devices import tune_for_training
tiny = torch.tensor([1e-39])
before = (tiny * 1.0).item()
tune_for_training(torch.device("cpu"), None)
print(before, (tiny * 1.0).item())
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="flushing subnormals is x86's (SSE) mode")
def test_cpu_training_flushes_subnormal_floats_to_zero():
    before, after = map(float, run_probe(DENORMAL_PROBE).split())
    assert before == pytest.approx(1e-39, rel=1e-3) and after == 0.0


def test_in_passing_thread_returns_or_raises_and_its_thread_ends():
    import threading

    from gptkit.core.devices import in_passing_thread

    def where(scale: int) -> tuple[int, int]:
        return threading.get_ident(), int(torch.ones(10**6).mul(scale).sum())

    ident, total = in_passing_thread(where, 3)
    assert total == 3 * 10**6 and ident != threading.get_ident()
    assert all(thread.ident != ident for thread in threading.enumerate())  # the thread, and its OpenMP threads, ended

    def refuse() -> None:
        raise UserError("a user's mistake")

    with pytest.raises(UserError, match="a user's mistake"):
        in_passing_thread(refuse)
