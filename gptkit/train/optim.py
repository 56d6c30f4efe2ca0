"""The optimizer a training run steps: AdamW with weight decay on matrices and embeddings, or Muon for the blocks'
weight matrices with AdamW for the rest (gptkit/train/muon.py)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from gptkit.core import distributed
from gptkit.core.errors import UserError
from gptkit.train.muon import MuonAdamW


def configure_optimizers(
    model: nn.Module,
    weight_decay: float,
    learning_rate: float,
    betas: tuple[float, float],
    device_type: str,
    muon_lr: float | None = None,
    muon_momentum: float = 0.95,
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices and embeddings (>= 2-D) only, fused on CUDA and CPU.

    With muon_lr, the blocks' weight matrices use Muon at that learning rate instead (no weight decay)
    and the rest AdamW, in one MuonAdamW optimizer. Every group records its "lr_scale", the factor a
    learning-rate schedule applies to its own learning rate (muon_lr / learning_rate for the Muon group).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if muon_lr is not None and n.startswith("transformer.h.") and p.dim() == 2]
    taken = {id(p) for p in hidden}
    adam_groups = [
        {"params": [p for _, p in named if p.dim() >= 2 and id(p) not in taken], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    for group in adam_groups:
        group.update(lr=learning_rate, lr_scale=1.0, betas=betas)
    if muon_lr is not None:
        scale = muon_lr / learning_rate
        muon_group = {"params": hidden, "muon": True, "lr": muon_lr, "lr_scale": scale, "momentum": muon_momentum}
        return MuonAdamW([muon_group, *adam_groups])
    # torch's fused AdamW is one kernel per step on CUDA and on CPU (faster than foreach there)
    fused = device_type in ("cuda", "cpu") and "fused" in inspect.signature(torch.optim.AdamW).parameters
    return torch.optim.AdamW(adam_groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))


def build_optimizer(cfg: Any, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer train.py's settings `cfg` ask for: the one place to add new ones. Each param group may carry
    "lr_scale" (default 1), its factor on the scheduled learning rate (Muon's group runs at muon_lr/learning_rate
    of it)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "muon":
        if distributed.is_fsdp(model):
            raise UserError("optimizer=muon needs whole weight matrices; use it with --parallel=ddp, not fsdp")
        muon = {"muon_lr": cfg.muon_lr, "muon_momentum": cfg.muon_momentum}
        return configure_optimizers(model, cfg.weight_decay, cfg.learning_rate, betas, device.type, **muon)
    return configure_optimizers(model, cfg.weight_decay, cfg.learning_rate, betas, device.type)
