"""int8 weight quantization for CPU decoding: a quarter of float32's weight bytes to read per generated token.

Every nn.Linear (the output head included) becomes PyTorch's dynamically quantized Linear: weights stored as int8
with one scale per output row, activations quantized per call, products in the fbgemm/x86 int8 kernels. That is
torch's own implementation (torch.ao.quantization.quantize_dynamic); torchao's CPU int8 paths were slower than
float32 on the machine measured (docs/benchmarks.md). The embeddings stay float32: a lookup reads one row.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from gptkit.errors import UserError

QUANTIZE_CHOICES = ("none", "int8")


def quantize_int8(model: nn.Module) -> nn.Module:
    """`model` (float32, on the CPU, for inference) with int8 Linear layers; in place, returned for chaining.

    A head tied to the token embedding gets an int8 copy of its own, so the embedding lookup stays exact.
    """
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        found = "no parameters" if param is None else f"{param.dtype} on {param.device}"
        raise UserError(f"int8 quantization needs a float32 model on the CPU, got {found}; use --device=cpu "
                        "--dtype=float32 or drop --quantize")  # fmt: skip
    engines = torch.backends.quantized.supported_engines
    engine = next((name for name in ("x86", "fbgemm", "qnnpack") if name in engines), None)
    if engine is None:
        raise UserError(f"this PyTorch build has no int8 CPU kernels (engines: {engines}); drop --quantize")
    torch.backends.quantized.engine = engine
    _untie_head(model)
    with warnings.catch_warnings():  # torch marks these APIs deprecated in favour of torchao (slower on CPUs here)
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    return model.eval()


def apply_quantization(model: nn.Module, quantize: str, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The scripts' --quantize setting: "none" leaves the model as it is, "int8" see quantize_int8 (which needs
    float32 compute: int8 products take float32 activations, so no bfloat16/float16 autocast around them)."""
    if quantize not in QUANTIZE_CHOICES:
        raise UserError(f"unknown --quantize={quantize!r}; use {' or '.join(QUANTIZE_CHOICES)}")
    if quantize == "none":
        return model
    if compute_dtype != torch.float32:
        raise UserError(f"--quantize=int8 computes in float32, not {str(compute_dtype).removeprefix('torch.')}; "
                        "use --dtype=float32 (or auto on the CPU)")  # fmt: skip
    return quantize_int8(model)


def _untie_head(model: nn.Module) -> None:
    head, embedding = getattr(model, "lm_head", None), getattr(getattr(model, "transformer", None), "wte", None)
    if isinstance(head, nn.Linear) and embedding is not None and head.weight is embedding.weight:
        head.weight = nn.Parameter(embedding.weight.detach().clone(), requires_grad=False)
