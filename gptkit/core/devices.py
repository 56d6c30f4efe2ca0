"""Choosing the device and the numeric precision (the Runtime settings train.py, sample.py, serve.py and eval.py share),
and the process-wide settings a training run makes (threads, subnormals flushed, freed memory kept)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from gptkit.core.errors import UserError
from gptkit.core.settings import setting

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True)
class Runtime:
    """Where, on how many CPU threads and in what precision a script computes, and its seed: declared once for every
    script (their settings classes extend it). resolve() sets the threads and gives the torch device and dtype."""

    device: str = setting("auto", "auto (cuda → mps → cpu) | cpu | cuda | cuda:N | mps")
    dtype: str = setting(
        "auto",
        "auto (CUDA: bfloat16 or float16; else float32) | float32 | bfloat16 | float16",
        choices=("auto", *DTYPES),
    )
    seed: int = setting(
        1337, "random seed: the same seed and settings give the same weights, data order and tokens", rule="seed"
    )
    cpu_threads: int | None = setting(
        None, "torch's CPU threads (None: torch's default, one per core; fewer on a busy machine)", rule="positive"
    )

    def resolve(self) -> tuple[torch.device, torch.dtype]:
        if self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        device = resolve_device(self.device)
        return device, resolve_dtype(self.dtype, device)


def resolve_device(name: str) -> torch.device:
    """The torch.device for a --device value: "auto" picks cuda, then mps, then cpu.

    Accepts auto, cpu, cuda, cuda:N and mps; UserError for anything else or a device that is not there.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"unsupported device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} asked for, but CUDA is not available here; use --device=cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"device {name!r} does not exist; this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not (torch.backends.mps.is_available()):
        raise UserError("device 'mps' asked for, but MPS is not available here; use --device=cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype for a --dtype value: "auto" is bfloat16 on GPUs that support it, else float16 on
    CUDA, and float32 elsewhere. UserError for unknown names and float16 off CUDA."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    if name == "float16" and device.type != "cuda":
        raise UserError("float16 needs a CUDA device; use --dtype=bfloat16 or float32 on this device")
    return DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed-precision context for the forward pass (a no-op in float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# bf16/fp16 dense peaks (datasheet, no sparsity); float32 matmuls run as TF32 on these parts.
_PEAK_FLOPS = {
    "H200": (989e12, 494e12),
    "H100 PCIe": (756e12, 378e12),
    "H100": (989e12, 494e12),
    "A100": (312e12, 156e12),
}


def peak_flops_for_device(device: torch.device | str, dtype: torch.dtype) -> float | None:
    """The device's peak FLOP/s for dtype's matmuls, for known GPUs (A100, H100, H200); None otherwise."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32) in _PEAK_FLOPS.items():
        if key in name:
            return half if dtype in (torch.bfloat16, torch.float16) else tf32
    return None


def tune_for_training(device: torch.device, cpu_threads: int | None) -> None:
    """Process-wide math settings for training on `device` (threads: torch's default when None)."""
    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    if device.type == "cpu":
        # Optimizer states and gradients of small models reach subnormal floats; x86 CPUs compute those many
        # times slower (Muon's step too). Flushing them to zero changes nothing visible.
        torch.set_flush_denormal(True)
        keep_freed_memory()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls


# glibc's mallopt parameters (malloc.h) and the values set: blocks up to 256 MiB come from the heap, and up to
# 1 GiB of freed heap stays in the process.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_BLOCKS_UP_TO, _FREE_HEAP_KEPT = 256 << 20, 1 << 30


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory tensors free for the next ones of their sizes, instead of handing it
    back to the kernel; False where the C library is not glibc (nothing changed).

    A CPU training step frees and allocates again the same few-MB activations and gradients. By default glibc
    maps large blocks afresh and unmaps them when freed, and gives a freed heap top back, so every step
    faults the same pages in again (docs/benchmarks.md §1 has what that costs). The process then holds its
    peak memory until it exits.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    heap_blocks = libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCKS_UP_TO)
    return bool(heap_blocks and libc.mallopt(_M_TRIM_THRESHOLD, _FREE_HEAP_KEPT))


def in_passing_thread(function: Callable[..., T], *args: Any) -> T:
    """function(*args) run in a thread that ends when it returns (its exception re-raised here), so the OpenMP
    threads its torch work starts end with it. A server loads its model this way: a thread that ran parallel torch
    work keeps idle OpenMP threads, and while they exist the decode thread's parallel regions wake their threads
    slowly (its steps took a fifth longer on 2 cores; docs/benchmarks.md)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="load") as pool:
        return pool.submit(function, *args).result()
