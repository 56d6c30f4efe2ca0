"""Faster float32 decoding on the CPU: weights stored transposed, and Linear layers that call oneDNN directly.

Decoding multiplies each weight matrix by one row per sequence, so a step is bound by how fast the weights
stream from memory. On x86, PyTorch sends float32 `F.linear` to MKL, which streams them well below the memory's
speed; oneDNN's kernel (which PyTorch ships) streams them faster, and both read the transposed layout ((in, out)
contiguous) faster. `python benchmarks/bench.py linear` measures each variant; docs/benchmarks.md has the figures.

`optimize_for_cpu_decoding(model)` changes a model in place: every plain `nn.Linear` keeps its Parameter objects
(tied weights stay tied, state_dict keys and values are unchanged) and becomes a `DecodingLinear`, which takes
the direct kernel only for float32 CPU inference; autograd, autocast and torch.compile still get `F.linear`.
decode=auto (gptkit.infer.decoding) uses it for the CPU's float32 steps over several rows where the native step cannot
run: OneDNNBackend decodes eagerly with `decoding_copy(model)`, so the engine never changes the model its caller
passed.
"""

from __future__ import annotations

import copy
import functools
import platform
import weakref

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptkit.infer.backend import EagerBackend, weight_versions


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN's linear kernel and the CPU is x86 (where it was measured faster)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise")


class DecodingLinear(nn.Linear):
    """An nn.Linear whose float32 CPU inference goes straight to oneDNN (when `onednn` is set).

    Made only by use_decoding_layout, which turns an existing nn.Linear into one without copying it.
    """

    onednn = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        direct = self.onednn and x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled()
        # torch.compile picks its own kernels and cannot lower the private op; autocast would be bypassed by it
        if direct and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu"):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def use_decoding_layout(linear: nn.Linear, onednn: bool) -> None:
    """Store linear's weight transposed in memory ((in, out) contiguous; to PyTorch still (out, in)) and make it a
    DecodingLinear that calls oneDNN directly if `onednn`. Values are unchanged, and so is the Parameter object
    (only its storage), so a tied weight stays tied. Calling it again keeps the layout."""
    if not linear.weight.t().is_contiguous():
        # a normal tensor even when called under inference_mode, so the model can still be trained afterwards
        with torch.inference_mode(False), torch.no_grad():
            linear.weight.data = linear.weight.data.t().contiguous().t()
    linear.__class__ = DecodingLinear  # the same module object: hooks, names and parameters stay
    linear.onednn = onednn


def optimize_for_cpu_decoding(model: nn.Module) -> nn.Module:
    """Give every plain nn.Linear of `model` the decoding layout and the direct oneDNN call (where available).

    In place and idempotent; outputs stay the same to float rounding. Meant for float32: CPU bfloat16 kernels
    were measured slower with the transposed layout. Returns the model.
    """
    onednn = onednn_linear_available()
    for module in model.modules():
        if type(module) in (nn.Linear, DecodingLinear):  # subclasses with a forward of their own are left alone
            use_decoding_layout(module, onednn)
    return model


def suits_fast_path(model: nn.Module) -> bool:
    """Whether the fast path pays off for `model` now: float32 weights on the CPU and no CPU autocast."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        return False
    return not torch.is_autocast_enabled("cpu")


# Each model's decoding copy and the version counters of the weights it was made from; a model that is garbage
# collected takes its copy with it.
DECODING_COPIES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[tuple[int, int], ...], nn.Module]] = (
    weakref.WeakKeyDictionary()
)


def decoding_copy(model: nn.Module) -> nn.Module:
    """optimize_for_cpu_decoding applied to a copy of `model`, which stays as it was: the copy's plain nn.Linear
    layers hold their weights transposed (new memory: the products' weights twice over while the copy lives), every
    other parameter and buffer is `model`'s own. Made once per model, and again after a weight changed in place."""
    versions = weight_versions(model)
    kept = DECODING_COPIES.get(model)
    if kept is not None and kept[0] == versions:
        return kept[1]
    DECODING_COPIES.pop(model, None)  # a stale copy goes first: never two at once
    shared = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    decoding = copy.deepcopy(model, memo=shared)  # the modules copied, the tensors shared
    transposed: dict[int, nn.Parameter] = {}  # a weight two layers share (none in a GPT's products) copied once
    for module in decoding.modules():
        if type(module) in (nn.Linear, DecodingLinear):
            weight = module.weight
            if id(weight) not in transposed:
                with torch.inference_mode(False), torch.no_grad():  # (in, out) contiguous: use_decoding_layout's
                    transposed[id(weight)] = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)
            module.weight = transposed[id(weight)]
    DECODING_COPIES[model] = (versions, optimize_for_cpu_decoding(decoding))
    return decoding


class OneDNNBackend(EagerBackend):
    """Eager passes over the model's decoding copy (decoding_copy: the same values, its Linear layers calling oneDNN
    directly on transposed weights); the caller's model stays as it was."""

    name = "onednn"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(decoding_copy(model))
