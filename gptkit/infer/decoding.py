"""Which backend decodes: the `decode` setting every script shares, and the one place the choice is made.

An engine asks make_backend once, when it is built, and from then on knows only the backend's interface
(gptkit.infer.backend). decode names the backend (eager, compiled, native), or is auto (the default): auto_choice's
rules pick the fastest backend that serves the device, the weights and the batch, from the measurements in
docs/benchmarks.md. Where the native step cannot run (not built, or a compute dtype it lacks), the CPU's float32 steps
over several rows go through oneDNN on transposed weights (gptkit.infer.onednn, in a copy the backend makes): one of
auto's answers, never a setting of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gptkit.core.errors import UserError
from gptkit.core.settings import setting
from gptkit.infer import native, onednn
from gptkit.infer.backend import Backend, EagerBackend
from gptkit.infer.compiled import CompiledBackend

DECODE_CHOICES = ("auto", "eager", "compiled", "native")
BACKENDS = ("eager", "onednn", "compiled", "native")  # what a choice can be: auto's answers include onednn


@dataclass(kw_only=True)
class Decoding:
    """The decoding settings of every script that generates (sample.py, serve.py, eval.py); their settings classes
    extend it, and gptkit.infer.generate takes the same value."""

    decode: str = setting(
        "auto",
        "auto: the fastest backend for the device, weights and batch (CPU: the native step, else oneDNN for "
        "several rows; CUDA: CUDA graphs) | eager: plain PyTorch | compiled: torch.compile (the first step compiles, "
        "about a minute) | native: one C++ call a step, of one row or several (CPU; float32, bfloat16, int8, int4 or "
        "GGUF Q8_0; built at set-up: python -m gptkit.infer.native --build)",
        choices=DECODE_CHOICES,
    )


def auto_choice(device_type: str, compute: str, rows: int, native_ready: bool, onednn_ready: bool) -> str:
    """The backend auto picks (one of BACKENDS). compute: the products' dtype (float32, bfloat16, float16, or int8 or
    int4 for such weights); rows: rows the engine decodes at once; native_ready: the native step is built and serves
    this model; onednn_ready: oneDNN's direct linear exists here (x86).

    - CUDA: compiled, replayed as CUDA graphs (one launch a step instead of some 150 small kernel launches).
    - CPU: the native step, one row or several (near the memory-read bound at one row; with several rows each float32
      weight is read once for up to 12 of them, 6 with AVX2).
    - CPU without it: plain eager at one row, where oneDNN loses to it; for more rows in float32, oneDNN on transposed
      weights. Never compiled on the CPU: it is no faster than oneDNN with several rows, and its time compiling
      outlasts a sample.
    - Other devices: eager.
    """
    if device_type == "cuda":
        return "compiled"
    if device_type != "cpu":
        return "eager"
    if native_ready:
        return "native"
    return "onednn" if rows > 1 and compute == "float32" and onednn_ready else "eager"


def compute_name(model: nn.Module, dtype: torch.dtype) -> str:
    """The products' dtype as auto_choice names it: int8, q8_0 or int4 for such weights, else the dtype they compute
    in."""
    return native.weights_name(model, dtype)


def backend_name(decode: str, model: nn.Module, rows: int, dtype: torch.dtype) -> str:
    """The backend (one of BACKENDS) that `decode` (DECODE_CHOICES) runs `model` with, computing in `dtype`, with
    `rows` rows at once. UserError, in one line, when `decode` names a backend that cannot run here (native: why it
    cannot), so a script can say so before it generates anything."""
    if decode not in DECODE_CHOICES:
        raise UserError(f"decode={decode!r} is not one of {', '.join(DECODE_CHOICES)}")
    if decode == "native":
        problem = native.native_problem(model, dtype) or native.build_problem(build=True)
        if problem:
            raise UserError(f"--decode=native: {problem}; {native.OTHER_PATHS}")
    if decode != "auto":
        return decode
    device_type = next(model.parameters()).device.type
    native_ready = native.native_problem(model, dtype) is None and native.build_problem(build=False) is None
    onednn_ready = onednn.onednn_linear_available() and onednn.suits_fast_path(model)
    return auto_choice(device_type, compute_name(model, dtype), rows, native_ready, onednn_ready)


def make_backend(decode: str, model: nn.Module, rows: int, dtype: torch.dtype) -> Backend:
    """The backend an engine decodes `model` with (backend_name's choice), ready to run."""
    name = backend_name(decode, model, rows, dtype)
    if name == "native":
        return native.NativeBackend(model, dtype)
    if name == "compiled":
        return CompiledBackend(model)
    if name == "onednn":
        return onednn.OneDNNBackend(model)
    return EagerBackend(model)
