"""Memory the decoding passes stream from: zeros on 2 MB pages (the KV cache's storage, the native step's packed
weights)."""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros (numel,) in memory that Linux backs with 2 MB pages where it can (transparent huge pages, asked for with
    madvise before the first touch), else in PyTorch's own allocation; PyTorch's zeros for less than 2 MB or
    without mmap's madvise.

    Why: a step streams every weight and its rows' keys and values, and with 4 KB pages that takes a TLB entry per
    4 KB; under a hypervisor each miss walks two page tables. PyTorch's allocator asks for huge pages only when
    THP_MEM_ALLOC_ENABLE is set before it starts. docs/benchmarks.md has the read speeds of both kinds of buffer.
    """
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype)
    # private: shared anonymous memory is shmem, which the kernel gives huge pages by another setting (often never)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # reads as zeros
    with contextlib.suppress(OSError):  # a kernel without THP: 4 KB pages, the same values
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE  # from a 2 MB boundary: only whole aligned 2 MB ranges get huge pages
    return raw[start : start + nbytes].view(dtype)
