"""Which backend decodes: the `decode` setting every script shares, and the rules `auto` follows.

Backends:
- eager: the model's own forward pass over the KV cache (gptkit.infer.engine), nothing else: the reference path.
- compiled: each step through gptkit.infer.compiled (torch.compile; a CUDA graph on CUDA); prefills stay eager.
- native: every step through gptkit.infer.native (one C++ call a step, on the CPU), one row or several.
- auto (the default): per device, weights and batch, the fastest backend that serves them (auto_plan).

Where the native step cannot run (not built, or a compute dtype it lacks), the CPU's float32 eager steps over
several rows call oneDNN directly on transposed weights (gptkit.infer.onednn, in a copy the engine makes): part of
auto's plan, never a setting of its own. docs/benchmarks.md has the measurements
behind the rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gptkit.core.errors import UserError
from gptkit.core.settings import setting
from gptkit.infer import native, onednn

DECODE_CHOICES = ("auto", "eager", "compiled", "native")


@dataclass
class Decoding:
    """The decoding settings of every script that generates (sample.py, serve.py, eval.py); their settings classes
    extend it, and gptkit.infer.generate takes the same value."""

    decode: str = setting(
        "auto",
        "auto: the fastest backend for the device, weights and batch (CPU: the native step, else oneDNN for "
        "several rows; CUDA: CUDA graphs) | eager: plain PyTorch | compiled: torch.compile (the first step compiles, "
        "about a minute) | native: one C++ call a step, of one row or several (CPU; float32, bfloat16, int8 or int4; "
        "built at set-up: python -m gptkit.infer.native --build)",
        choices=DECODE_CHOICES,
    )


@dataclass(frozen=True)
class Plan:
    """How an engine decodes: `native` for every step, else `compiled` (else eager), with `onednn` for the CPU's
    float32 eager products."""

    native: bool = False
    compiled: bool = False
    onednn: bool = False


def auto_plan(device_type: str, compute: str, slots: int, native_ready: bool, onednn_ready: bool) -> Plan:
    """auto's rules. compute: the products' dtype (float32, bfloat16, float16, or int8 or int4 for such weights);
    slots: rows the engine decodes at once; native_ready: the native step is built and serves this model;
    onednn_ready: oneDNN's direct linear exists here (x86).

    - CUDA: CUDA graphs (one launch a step instead of some 150 small kernel launches).
    - CPU: the native step, one row or several (near the memory-read bound at one row on every CPU measured; with
      several rows each float32 weight is read once for up to 12 of them, 6 with AVX2).
    - CPU without it: plain eager at one row (oneDNN at one row lost to it on a Xeon); for more rows in float32, oneDNN
      on transposed weights (about twice the plain path at batch 8 on two EPYCs). Never compiled on the CPU: no faster
      than oneDNN at batch 8, and its minute of compiling outlasts a sample.
    docs/benchmarks.md has the figures.
    """
    if device_type == "cuda":
        return Plan(compiled=True)
    if device_type != "cpu":
        return Plan()
    if native_ready:
        return Plan(native=True)
    return Plan(onednn=slots > 1 and compute == "float32" and onednn_ready)


def compute_name(model: nn.Module, dtype: torch.dtype) -> str:
    """The products' dtype as auto_plan names it: int8 or int4 for such weights, else the dtype they compute in."""
    if native.int8_weights(model):
        return "int8"
    return "int4" if native.int4_weights(model) else str(dtype).removeprefix("torch.")


def plan_for(decode: str, model: nn.Module, slots: int, dtype: torch.dtype) -> Plan:
    """The plan for `decode` (DECODE_CHOICES) on `model`, computing in `dtype`, with `slots` rows. UserError, in one
    line, when `decode` names a backend that cannot run here (native: why it cannot)."""
    if decode not in DECODE_CHOICES:
        raise UserError(f"decode={decode!r} is not one of {', '.join(DECODE_CHOICES)}")
    device_type = next(model.parameters()).device.type
    compute = compute_name(model, dtype)
    onednn_ready = onednn.onednn_linear_available() and onednn.suits_fast_path(model)
    if decode == "eager":
        return Plan()
    if decode == "compiled":
        return Plan(compiled=True)
    if decode == "native":
        problem = native.native_problem(model, dtype) or native.build_problem(build=True)
        if problem:
            raise UserError(f"--decode=native: {problem}; {native.OTHER_PATHS}")
        return Plan(native=True)
    ready = native.native_problem(model, dtype) is None and native.build_problem(build=False) is None
    return auto_plan(device_type, compute, slots, ready, onednn_ready)
