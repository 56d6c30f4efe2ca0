"""What a run's steps and evaluations read, for text and for chat data, and the loss of one micro-batch of each.

Text (a token stream) gives random windows; chat data (prepare_data/chat.py) gives conversations packed into rows
(gptkit/data/packing.py) whose targets are the assistant's tokens only. A text micro-batch's loss is its mean, a
step's the mean of its micro-batches. A chat step's loss is the summed loss of its trained targets divided by
their number over the whole step, all micro-batches and processes, so its gradient is the one big batch's however
the step is split. The next-token objective (gptkit/train/objectives.py: Lm) is the same for both; the difference
lives here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from gptkit.data import loader
from gptkit.data.conversations import is_chat_data, open_conversations
from gptkit.data.packing import PackedBatches, PackedEpoch

Sampler = loader.BatchSampler | PackedBatches


def open_splits(data_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The train and val splits, memory-mapped: a loader.TokenStream each, or a ConversationSplit for chat data."""
    open_split = open_conversations if is_chat_data(meta) else loader.open_split
    return {split: open_split(data_dir, split, meta) for split in ("train", "val")}


def check_splits_fit(streams: dict[str, Any], block_size: int, data_dir: Path) -> None:
    """UserError when a text split is shorter than one window (packed rows are padded: any conversation fits)."""
    for stream in streams.values():
        if isinstance(stream, loader.TokenStream):
            loader.check_stream_fits(stream, block_size, str(data_dir))


def make_sampler(data: Any, batch_size: int, block_size: int, seed: int, purpose: int) -> Sampler:
    """Batches of a split: random windows of a token stream, or packed rows of conversations (chat data)."""
    if isinstance(data, loader.TokenStream):
        return loader.BatchSampler(data, batch_size, block_size, seed, purpose)
    return PackedBatches(data, batch_size, block_size, seed, purpose)


def whole_split(data: Any, block_size: int, batch_size: int) -> tuple[Any, int]:
    """The whole split as an indexable sequence of batches, every target once, and its number of tokens."""
    if isinstance(data, loader.TokenStream):
        return loader.SplitWindows(data, block_size, batch_size), len(data)
    return PackedEpoch(data, block_size, batch_size), len(data.tokens)


def bits_per_byte(loss: float, data: Any, split_meta: dict[str, Any]) -> float | None:
    """Val bits per byte of a text split; None for chat data, whose losses count assistant tokens only (bits per
    byte need every token of the text)."""
    return loader.bits_per_byte(loss, split_meta) if isinstance(data, loader.TokenStream) else None


def step_target_count(sampler: Sampler, position: int, micro_batches: int) -> int | None:
    """Chat data: the trained targets of the step whose micro-batches start at `position`, all `micro_batches`
    of them in every process (each process computes it from the packing plan, so no process waits for another);
    None for text."""
    if not isinstance(sampler, PackedBatches):
        return None
    return max(1, sum(sampler.counted(index) for index in range(position, position + micro_batches)))


def micro_batch_loss(
    wrapped: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    precision: contextlib.AbstractContextManager,
    *,
    step_targets: int | None,
    micro_batches: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's (loss to backpropagate, addition to the logged loss sum, which adds up to `micro_batches`
    times the step's mean). `micro_batches` counts the step's micro-batches over all `world_size` processes.
    Text (`step_targets` None): the batch mean over this process's micro-batches. Chat: the summed loss over the
    step's `step_targets` trained targets, times the processes (their gradients are averaged)."""
    with precision:
        if step_targets is None:
            _, loss = wrapped(x, y)
            return loss / (micro_batches // world_size), loss.detach().float()
        _, loss = wrapped(x, y, reduction="sum")
    logged = loss.detach().float() * (micro_batches / step_targets)
    return loss * (world_size / step_targets), logged
