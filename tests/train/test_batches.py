"""Tests for gptkit/train/batches.py where text and chat data differ: the loss of a micro-batch (the chat case, the
step's gradient against one big batch, is in tests/test_train_chat.py), the step's targets, bits per byte."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.data import loader
from gptkit.train import batches


class MeanOfTargets(torch.nn.Module):
    """Stands in for a GPT: its loss is the mean of the targets (or their sum with reduction="sum")."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> tuple[None, torch.Tensor]:
        return None, y.float().sum() if reduction == "sum" else y.float().mean()


def test_a_text_micro_batch_counts_for_its_share_of_the_step(tmp_path: Path) -> None:
    (np.arange(200) % 50).astype(np.uint16).tofile(tmp_path / "train.bin")
    stream = loader.TokenStream(
        name="train", paths=(tmp_path / "train.bin",), lengths=(200,), dtype=np.dtype(np.uint16)
    )
    sampler = batches.make_sampler(stream, 2, 8, seed=1, purpose=loader.PURPOSE_TRAIN)
    assert isinstance(sampler, loader.BatchSampler)
    assert batches.step_target_count(sampler, position=0, micro_batches=4) is None  # text: no count needed
    y = torch.tensor([[2.0, 4.0]])
    # 8 micro-batches over 2 processes: 4 in this one, so each contributes a quarter of its mean.
    loss, logged = batches.micro_batch_loss(
        MeanOfTargets(), y, y, contextlib.nullcontext(), step_targets=None, micro_batches=8, world_size=2
    )
    assert (loss.item(), logged.item()) == (0.75, 3.0)


def test_a_chat_micro_batch_is_its_summed_loss_over_the_steps_targets() -> None:
    y = torch.tensor([[2.0, 4.0, -1.0]])
    loss, logged = batches.micro_batch_loss(
        MeanOfTargets(), y, y, contextlib.nullcontext(), step_targets=10, micro_batches=4, world_size=2
    )
    # By hand: the sum 5 over the step's 10 targets, times 2 processes (DDP averages); logged: 5 * 4 / 10.
    assert loss.item() == pytest.approx(1.0) and logged.item() == pytest.approx(2.0)
    assert batches.bits_per_byte(1.0, object(), {"bytes": 10, "tokens": 5}) is None  # chat: no bits per byte
