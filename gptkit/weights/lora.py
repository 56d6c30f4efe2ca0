"""Low-rank adapters (LoRA): fine-tune a frozen model through a small trainable product beside chosen Linear layers.

A LoRA layer computes y = x Wᵀ + b + (alpha / rank) · dropout(x) Aᵀ Bᵀ, with the base W and b frozen, A (rank, in)
initialised as nn.Linear's own weights and B (out, rank) at zero, so training starts exactly at the base model
(Hu et al., 2021; Hugging Face PEFT does the same). Only A and B train, so the optimizer keeps two moments for a
few hundred thousand numbers instead of every weight. The frozen base may be held in bfloat16, int8 or int4 (QLoRA:
GGUF's Q4_1 blocks, gptkit.weights.quantization; a GGUF file's own Q4_0 or Q4_1 blocks as they are) to save memory;
its product is then computed from the stored weights in the input's dtype.

A LoRA run's checkpoint holds the A and B matrices, the LoRA settings and a reference to its base (path and sha256);
`merge_lora` folds adapters into ordinary weights, and `write_peft_adapter` writes them as PEFT's
`adapter_config.json` + `adapter_model.safetensors` for the base's transformers class. export.py's
`--format=merged` and `--format=peft` write a LoRA run's checkpoint that way (gptkit.weights.export_lora).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_bytes
from torch import nn

from gptkit.core.errors import UserError
from gptkit.core.fileio import atomic_write_bytes, atomic_write_json
from gptkit.model import GPTConfig
from gptkit.weights.hf import export_architecture, flip_rotation, hf_names
from gptkit.weights.quantization import Int4Blocks, Int4Linear, block_products, int4_as_linear

# Which Linear layers of each block get an adapter (the output head, tied to the embedding, never does).
TARGETS = {
    "attention": ("attn.c_attn", "attn.c_proj"),
    "mlp": ("mlp.c_fc", "mlp.c_proj"),
    "all": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
}
BASE_WEIGHTS = ("float32", "bfloat16", "int8", "int4")
INT8_MAX = 127


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """The adapters' shape: rank, alpha (the update is scaled by alpha / rank), dropout on their input, targets."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "attention"

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise UserError(f"--lora_rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise UserError(f"--lora_alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--lora_dropout must be in [0, 1), got {self.dropout!r}")
        if self.targets not in TARGETS:
            raise UserError(f"--lora_targets must be one of {', '.join(TARGETS)}, got {self.targets!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: Any, where: str) -> LoraConfig:
        if not isinstance(record, dict) or set(record) != {"rank", "alpha", "dropout", "targets"}:
            raise UserError(f"{where}: the LoRA record needs rank, alpha, dropout and targets")
        return cls(**record)


class FrozenLinear(nn.Module):
    """A frozen Linear held as `base_weights` says: float32, bfloat16, int8 (a scale a row) or int4 (Int4Linear's
    blocks: a GGUF file's as they are, those the weight was read from, else quantized). Its product widens the stored
    weight to the input's dtype for that product alone, and again in the backward pass (FrozenProduct). The base may
    be an Int4Linear, whose blocks may lie in a file (gptkit.weights.sources.load's int4_products): an int4 base
    holds them as they are, never float32; any other, the float32 Linear of their values."""

    def __init__(self, base: nn.Linear | Int4Linear, base_weights: str = "float32") -> None:
        super().__init__()
        if isinstance(base, Int4Linear) and base_weights != "int4":
            base = int4_as_linear(base)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.base_weights = base_weights
        if base_weights == "int4":
            int4 = base if isinstance(base, Int4Linear) else Int4Linear.from_linear(base)
            codes, scale, minimum = int4.blocks()  # read here where they lie in a file
            self.register_buffer("weight_int4", codes)
            self.register_buffer("weight_scale", scale)
            self.register_buffer("weight_minimum", minimum)
            self.weight = None
        elif base_weights == "int8":  # one scale per output row, as gptkit.weights.quantization stores them
            weight = base.weight.detach()
            row_scale = (weight.float().abs().amax(dim=1) / INT8_MAX).clamp_min(1e-12)
            self.register_buffer("weight_int8", torch.round(weight.float() / row_scale[:, None]).to(torch.int8))
            self.register_buffer("weight_scale", row_scale)
            self.weight = None
        else:
            dtype = torch.bfloat16 if base_weights == "bfloat16" else base.weight.dtype
            self.weight = nn.Parameter(base.weight.detach().to(dtype), requires_grad=False)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach().clone(), requires_grad=False)

    def stored_base(self) -> tuple[torch.Tensor, ...]:
        """The frozen weight as it is held: (weight,), (weight_int8, weight_scale) or the int4 blocks."""
        if self.base_weights == "int8":
            return self.weight_int8, self.weight_scale
        if self.base_weights == "int4":
            return self.weight_int4, self.weight_scale, self.weight_minimum
        return (self.weight,)

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The frozen (out, in) weight in `dtype`."""
        return weight_from_stored(self.base_weights, self.in_features, dtype, *self.stored_base()).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        base = FrozenProduct.apply(x, self.base_weights, self.in_features, dtype, self.stored_base())
        return base if self.bias is None else base + self.bias.to(dtype)

    def merged(self) -> nn.Linear:
        """An ordinary float32 nn.Linear computing what this layer computes."""
        weight = self.base_weight(torch.float32)
        # skip_init: no random initialisation of a matrix the next line overwrites (seconds over a large model)
        linear = nn.utils.skip_init(
            nn.Linear, self.in_features, self.out_features, bias=self.bias is not None, device=weight.device
        )
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias.float())
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, base_weights={self.base_weights}"


class LoraLinear(FrozenLinear):
    """A FrozenLinear plus a trainable low-rank update `lora_B @ lora_A`."""

    def __init__(self, base: nn.Linear | Int4Linear, config: LoraConfig, base_weights: str = "float32") -> None:
        super().__init__(base, base_weights)
        self.scale = config.scale
        device = self.stored_base()[0].device
        self.lora_A = nn.Parameter(torch.empty(config.rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, config.rank, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own initialisation
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)
        return super().forward(x) + self.scale * update

    def merged(self) -> nn.Linear:
        """An ordinary float32 nn.Linear computing what this layer computes (without dropout)."""
        linear = super().merged()
        with torch.no_grad():
            linear.weight.add_(self.scale * (self.lora_B.float() @ self.lora_A.float()))
        return linear

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}"


def weight_from_stored(base_weights: str, in_features: int, dtype: torch.dtype, *stored: torch.Tensor) -> torch.Tensor:
    """A LoraLinear's (out, in) base weight in `dtype`, from the tensors it holds it in (LoraLinear.stored_base)."""
    if base_weights == "int8":
        weight_int8, row_scale = stored
        return weight_int8.to(dtype) * row_scale.to(dtype)[:, None]
    if base_weights == "int4":
        return Int4Blocks(*stored).values(in_features).to(dtype)
    return stored[0].to(dtype)


class FrozenProduct(torch.autograd.Function):
    """x Wᵀ in `dtype` for a frozen base weight W given as it is stored, which the backward pass widens again
    (x's gradient is the output's times W). Autograd would otherwise keep the widened copy of every layer's weight
    from its forward pass until the backward pass reaches it: a float copy of the whole base in every step, larger
    than a float32 base itself. The stored tensors are kept instead (no copy: they are the layer's own)."""

    @staticmethod
    def forward(ctx, x, base_weights, in_features, dtype, stored):  # stored: a tuple (torch.compile miscounts *args)
        ctx.save_for_backward(*stored)
        ctx.layout = (base_weights, in_features, dtype, x.dtype)
        return F.linear(x.to(dtype), weight_from_stored(base_weights, in_features, dtype, *stored))

    @staticmethod
    def backward(ctx, grad):
        base_weights, in_features, dtype, x_dtype = ctx.layout
        weight = weight_from_stored(base_weights, in_features, dtype, *ctx.saved_tensors)
        grad_x = (grad.to(dtype) @ weight).to(x_dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


class GrownVocabulary(nn.Module):
    """The token embedding or the output head with frozen base rows and trainable rows added after them (the chat
    template's special tokens): the only rows of the vocabulary an adapter run can teach.

    A tied model installs one as both `transformer.wte` (a lookup) and `lm_head` (a product), which share its two
    tensors as the tied model shares one matrix; an untied one has one of each, whose new rows train apart.
    """

    def __init__(self, weight: torch.Tensor, first_new_row: int) -> None:
        super().__init__()
        self.base = nn.Parameter(weight.detach()[:first_new_row].clone(), requires_grad=False)
        self.extra = nn.Parameter(weight.detach()[first_new_row:].clone())
        # While set, the rows a pass reads instead of `extra` (DPO's and GRPO's reference: the rows as they started).
        # Why not a copy into `extra`: the policy's pass may have saved it for its backward pass.
        self.stand_in: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The whole (vocab, n_embd) matrix (a copy): what an ordinary tied model holds."""
        return torch.cat([self.base, self.extra])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.extra if self.stand_in is None else self.stand_in
        if not x.is_floating_point():  # token ids: the embedding lookup, each id from the part that holds its row
            rows = self.base.shape[0]
            old = F.embedding(x.clamp(max=rows - 1), self.base)
            new = F.embedding((x - rows).clamp(min=0), extra)
            return torch.where((x < rows)[..., None], old, new)
        return torch.cat([F.linear(x, self.base), F.linear(x, extra)], dim=-1)  # the head's logits


def _targeted(model: nn.Module, targets: str) -> list[str]:
    return [name for name in block_products(model) if name.endswith(TARGETS[targets])]


def add_lora(
    model: nn.Module, config: LoraConfig, base_weights: str = "float32", first_new_row: int | None = None
) -> nn.Module:
    """Freeze every parameter of `model` and put a LoraLinear in place of each targeted Linear, and a FrozenLinear
    in place of every other product of its blocks under a base_weights other than float32 (in place; returned): the
    whole base is held so. Afterwards only the adapters' A and B require gradients, and, when `first_new_row` is
    given (the base model's vocabulary size, below the model's), the token rows from there on (see GrownVocabulary)."""
    if base_weights not in BASE_WEIGHTS:
        raise UserError(f"--lora_base_weights must be one of {', '.join(BASE_WEIGHTS)}, got {base_weights!r}")
    for param in model.parameters():
        param.requires_grad_(False)
    targeted = set(_targeted(model, config.targets))
    for name in block_products(model):  # the base, held as base_weights says
        parent_name, _, child = name.rpartition(".")
        parent, product = model.get_submodule(parent_name), model.get_submodule(name)
        if name in targeted:
            setattr(parent, child, LoraLinear(product, config, base_weights))
        elif base_weights != "float32" or isinstance(product, Int4Linear):
            setattr(parent, child, FrozenLinear(product, base_weights))
    if first_new_row is not None and first_new_row < model.lm_head.weight.shape[0]:
        if model.lm_head.weight is model.transformer.wte.weight:
            model.transformer.wte = model.lm_head = GrownVocabulary(model.lm_head.weight, first_new_row)
        else:
            model.transformer.wte = GrownVocabulary(model.transformer.wte.weight, first_new_row)
            model.lm_head = GrownVocabulary(model.lm_head.weight, first_new_row)
    return model


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is one a LoRA run trains (and its checkpoint stores)."""
    return name.endswith((".lora_A", ".lora_B", ".extra"))


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by name (`...attn.c_attn.lora_A`), on the CPU: what a LoRA checkpoint stores."""
    return {
        name.removeprefix("_orig_mod.").removeprefix("module."): param.detach().cpu().clone()
        for name, param in model.named_parameters()
        if is_adapter_name(name)
    }


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy adapter tensors into a model that has had add_lora with the same settings; UserError on a mismatch."""
    params = dict(model.named_parameters())
    expected = {name for name in params if is_adapter_name(name)}
    if set(state) != expected:
        raise UserError(f"{source}: its adapters do not fit this model (other layers, or another --lora_targets)")
    with torch.no_grad():
        for name, tensor in state.items():
            if params[name].shape != tensor.shape:
                raise UserError(
                    f"{source}: adapter {name} has shape {tuple(tensor.shape)}, the model needs "
                    f"{tuple(params[name].shape)} (another rank or model?)"
                )
            params[name].copy_(tensor)


def merge_lora(model: nn.Module, quantize: Callable[[nn.Linear], nn.Module] | None = None) -> nn.Module:
    """`model` (in place; returned) with every LoraLinear (and FrozenLinear) replaced by the ordinary Linear it
    computes, and grown token rows joined to whole matrices again (one, where the head is tied to the embedding).
    quantize: what each merged product becomes at once (e.g. Int4Linear.from_linear), so that no more than one
    product is float32 at a time: a QLoRA run decoded in 4 bits never holds the float32 model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FrozenLinear):
            parent_name, _, child = name.rpartition(".")
            merged = module.merged()
            setattr(model.get_submodule(parent_name), child, merged if quantize is None else quantize(merged))
    if isinstance(model.lm_head, GrownVocabulary):
        tied = model.lm_head is model.transformer.wte
        embedding, head = model.transformer.wte.weight.detach(), model.lm_head.weight.detach()
        model.transformer.wte = nn.utils.skip_init(nn.Embedding, *embedding.shape, device=embedding.device)
        model.lm_head = nn.utils.skip_init(nn.Linear, head.shape[1], head.shape[0], bias=False, device=head.device)
        if tied:
            model.transformer.wte.weight = model.lm_head.weight
        with torch.no_grad():
            model.transformer.wte.weight.copy_(embedding)
            model.lm_head.weight.copy_(head)
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def write_peft_adapter(
    directory: str | os.PathLike,
    adapters: dict[str, torch.Tensor],
    config: LoraConfig,
    base_model: str = "",
    first_new_row: int | None = None,
    model_config: GPTConfig | None = None,
) -> None:
    """Write the adapters as Hugging Face PEFT does: adapter_config.json and adapter_model.safetensors, so
    `PeftModel.from_pretrained(<the base's transformers class>.from_pretrained(base), directory)` loads them.
    `model_config`: the base's shape (None: GPT-2), which picks the class (hf.export_architecture). A fused product
    (q, k, v; gate and up) becomes one adapter per part: the same A, B's rows split. `base_model` is recorded as
    base_model_name_or_path. Trained token rows (a chat template's markers, from `first_new_row` on) go as PEFT's
    trainable_token_indices: the base must then hold those rows already."""
    architecture = "GPT2LMHeadModel" if model_config is None else export_architecture(model_config)
    tensors = {}
    token_rows = {}
    for name, tensor in adapters.items():
        if name.endswith(".extra"):
            module = peft_token_module(name.removesuffix(".extra"), architecture)
            tensors[f"base_model.model.{module}.token_adapter.trainable_tokens_delta"] = tensor.float().contiguous()
            token_rows[module.rpartition(".")[2]] = list(range(first_new_row, first_new_row + tensor.shape[0]))
            continue
        matrix = "lora_A" if name.endswith(".lora_A") else "lora_B"
        module = name.removesuffix(f".{matrix}")
        for part, value in peft_parts(module, matrix, tensor.float(), architecture, model_config).items():
            tensors[f"base_model.model.{part}.{matrix}.weight"] = value.contiguous()
    targets = sorted({key.split(".")[-3] for key in tensors if ".lora_" in key})
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        # HF GPT-2 stores these layers as Conv1D, whose weight is the transpose of a Linear's.
        "fan_in_fan_out": architecture == "GPT2LMHeadModel",
        "target_modules": list(TARGETS[config.targets]) if architecture == "GPT2LMHeadModel" else targets,
        "bias": "none",
        "inference_mode": True,
    }
    if len(token_rows) == 1:  # the embedding's rows, which PEFT gives a tied head too
        peft_config["trainable_token_indices"] = next(iter(token_rows.values()))
    elif token_rows:  # an untied head's rows train apart from the embedding's: each module by name
        peft_config["trainable_token_indices"] = token_rows
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / "adapter_model.safetensors", safetensors_bytes(tensors, metadata={"format": "pt"}))
    atomic_write_json(directory / "adapter_config.json", peft_config)


def peft_token_module(module: str, architecture: str) -> str:
    """The transformers module that holds our `transformer.wte` or `lm_head` (GPT-2's has our names; the Llama
    family's are model.embed_tokens and lm_head)."""
    if architecture == "GPT2LMHeadModel":
        return module
    return hf_names(f"{module}.weight", architecture)[0].removesuffix(".weight")


def peft_parts(
    module: str, matrix: str, tensor: torch.Tensor, architecture: str, config: GPTConfig | None
) -> dict[str, torch.Tensor]:
    """One of our adapter matrices as the Hugging Face modules' (module name -> matrix): GPT-2's as it is; the Llama
    family's fused products split, A shared by every part and B's rows divided as the product's."""
    if architecture == "GPT2LMHeadModel":
        return {module: tensor}
    names = [name.removesuffix(".weight") for name in hf_names(f"{module}.weight", architecture)]
    if matrix == "lora_A":
        return {name: tensor.clone() for name in names}  # a copy each: safetensors stores no shared tensors
    if module.endswith("attn.c_attn"):
        widths = [config.n_head * config.head_dim] + [config.n_kv_head * config.head_dim] * 2
    else:
        widths = [tensor.shape[0] // len(names)] * len(names)
    parts = list(tensor.split(widths))
    if architecture == "NanoChatForCausalLM" and module.endswith("attn.c_attn"):
        parts[:2] = [flip_rotation(part, config.head_dim) for part in parts[:2]]
    return dict(zip(names, parts))


# ----------------------------------------------------------------------------- LoRA checkpoints

# A LoRA run's checkpoint stores only what trained ("model": adapter_state) and, under "lora", how to rebuild the
# rest: the settings, and the base it started from (gptkit.weights.sources rebuilds the model from it).


def lora_record(config: LoraConfig, base_weights: str, reference: dict[str, str], first_new_row: int | None) -> dict:
    """The "lora" entry of a LoRA run's checkpoint."""
    return {"config": config.to_dict(), "base_weights": base_weights, "base": reference, "first_new_row": first_new_row}
