"""The frozen reference model of DPO and GRPO's KL term: the starting model, as it was before any step.

Full-weight training keeps a frozen copy of the starting model. A LoRA run keeps no copy: its base never changes,
so the reference is the same model with the adapters switched off (and the rows a grown vocabulary added, which
train with the adapters, put back as they started: the mean of the base's rows). Reference passes run without gradients and without dropout.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.nn as nn

from gptkit.weights.lora import GrownVocabulary, LoraLinear


def starting_point(init_from: str, resumed: dict | None) -> str:
    """Where a run's starting model comes from: init_from, or for a resumed run (`resumed`, its checkpoint) the
    source that checkpoint records, so the reference stays the start, not the resume."""
    record = resumed.get("reference", init_from) if resumed is not None else init_from
    return record["source"] if isinstance(record, dict) else record  # a string: a checkpoint written before digests


def token_logprobs(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y[b, t] | x[b, :t+1]) under `model` (B, T), 0 where y is -1 (no target). `model(x, y, reduction="none")`
    gives each position's cross-entropy, so the same call serves a plain model and a DDP or compiled wrapper."""
    _, losses = model(x, y, reduction="none")
    return -losses.view(y.shape)


class Reference:
    """The starting model's log-probabilities, whatever the training does to `model` meanwhile."""

    def __init__(self, model: nn.Module) -> None:
        self.adapters = [module for module in model.modules() if isinstance(module, LoraLinear)]
        if self.adapters:
            self.model = model
            # The added rows start as the mean of the base's rows (GPT.grow_vocabulary): computed, not copied, so a
            # resumed run's reference has them as they started, not as the checkpoint left them.
            self.grown = [(module, _starting_rows(module)) for module in _grown(model)]
        else:
            self.model = copy.deepcopy(model).requires_grad_(False).eval()
            self.grown = []

    @torch.no_grad()
    def token_logprobs(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """log p_ref(y | x) per position (B, T), 0 where y is -1."""
        with self._as_started():
            return token_logprobs(self.model, x, y).float()

    @contextlib.contextmanager
    def _as_started(self) -> Iterator[None]:
        if not self.adapters:
            yield
            return
        scales = [module.scale for module in self.adapters]
        training = self.model.training
        try:
            self.model.eval()
            for module in self.adapters:
                module.scale = 0.0
            for module, start in self.grown:
                module.stand_in = start
            yield
        finally:
            for module, scale in zip(self.adapters, scales):
                module.scale = scale
            for module, _ in self.grown:
                module.stand_in = None
            self.model.train(training)


def _starting_rows(module: GrownVocabulary) -> torch.Tensor:
    return module.base.detach().mean(dim=0, keepdim=True).expand_as(module.extra).to(module.extra.dtype).clone()


def _grown(model: nn.Module) -> list[GrownVocabulary]:
    seen: dict[int, GrownVocabulary] = {}
    for module in model.modules():
        if isinstance(module, GrownVocabulary):
            seen[id(module)] = module
    return list(seen.values())
