"""The training loop's pieces that need no model code: the learning-rate schedule, dropout seeds, the mean loss
over batches shared among processes, training time, and the numbers the loop changes as it goes (LoopState).

Data placement and dropout seeding are explained in train.py's docstring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from gptkit.core.distributed import Processes, reduce_numbers
from gptkit.core.errors import UserError
from gptkit.core.signals import StopRequest
from gptkit.data import loader

DROPOUT_STREAM = 1000  # seeds dropout per micro-batch, apart from the data sampler's streams (batches.PURPOSE_*)


WARMUP_FRACTION = 10  # an unset warmup takes a tenth of the run...
MAX_DEFAULT_WARMUP = 2000  # ...and at most GPT-2's 2000 steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """The learning rate of every step, as learning_rate_at computes it (the training settings of the same names).
    `shortened_from` is the warmup the settings asked for when it had to be shortened to fit the run (else None)."""

    learning_rate: float
    min_lr: float
    warmup_iters: int
    lr_decay_iters: int
    decay_lr: bool = True
    shortened_from: int | None = None

    @classmethod
    def fitted(
        cls,
        *,
        max_iters: int,
        learning_rate: float,
        min_lr: float,
        warmup_iters: int | None,
        lr_decay_iters: int | None,
        decay_lr: bool,
    ) -> Schedule:
        """The schedule of a run of `max_iters` steps. An unset warmup (None) is a tenth of the run, at most 2000
        steps; so is a warmup set so long that the rate would never reach learning_rate (a recipe shortened with
        --max_iters), which `shortened_from` then records. An unset decay ends at max_iters; a decay set past it
        is kept (the run stops part way down the cosine, to be resumed with a larger max_iters)."""
        fitted_warmup = min(MAX_DEFAULT_WARMUP, max_iters // WARMUP_FRACTION)
        shortened_from = None
        if warmup_iters is not None and decay_lr and 0 < max_iters <= warmup_iters:
            shortened_from = warmup_iters
        elif warmup_iters is not None:
            fitted_warmup = warmup_iters
        return cls(
            learning_rate=learning_rate,
            min_lr=min_lr,
            warmup_iters=fitted_warmup,
            lr_decay_iters=max_iters if lr_decay_iters is None else lr_decay_iters,
            decay_lr=decay_lr,
            shortened_from=shortened_from,
        )


def learning_rate_at(step: int, cfg: Schedule) -> float:
    """Linear warmup from learning_rate/(warmup_iters+1) (never 0), then cosine decay to min_lr at lr_decay_iters."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the scheduled rate; a param group's "lr_scale" (default 1) is its factor on it (e.g. Muon's group)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def seed_for(seed: int, purpose: int, index: int) -> int:
    """A well-mixed 63-bit seed for (seed, purpose, index)."""
    return int(np.random.SeedSequence((seed, purpose, index)).generate_state(1, np.uint64)[0] >> 1)


@torch.no_grad()
def mean_loss(
    wrapped: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    precision: contextlib.AbstractContextManager,
    device: torch.device,
    procs: Processes,
    stop: StopRequest | None = None,
) -> float | None:
    """Per-token mean loss over an indexable sequence of (x, y) batches, split round-robin over processes; targets
    of -1 do not count.

    `wrapped(x, y)` returns (logits, mean loss); `precision` is the autocast context of forward passes. Every
    process runs the same number of forward passes (FSDP needs that); the padding ones count for nothing. The
    module is left in training mode. A single process given `stop` returns None as soon as a stop is requested
    (an evaluation of hundreds of batches would keep a Ctrl-C waiting for minutes); several processes finish
    the evaluation, since each forward pass may need all of them.
    """
    wrapped.eval()
    total, count = 0.0, 0
    for round_start in range(0, len(batches), procs.world_size):
        if stop is not None and stop.signum and not procs.distributed:
            wrapped.train()
            return None
        index = round_start + procs.rank
        x, y = loader.to_device(*batches[min(index, len(batches) - 1)], device)
        with precision:
            _, loss = wrapped(x, y)
        targets = int((y >= 0).sum())  # all of them for text; the assistant's tokens for chat
        if index < len(batches) and targets:
            total += loss.item() * targets
            count += targets
    wrapped.train()
    total, count = reduce_numbers([total, count], device, procs)
    if count == 0:  # chat data whose replies all start past the window: nothing would ever train
        raise UserError(
            "the evaluation batches hold no token to train on (chat data: no assistant reply starts within "
            "--block_size tokens of its conversation); give a larger --block_size or shorter conversations"
        )
    return total / count


@torch.no_grad()
def forward_seconds(
    wrapped: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    precision: contextlib.AbstractContextManager,
    device: torch.device,
) -> float:
    """The time of one forward pass on `batch`, in evaluation mode (no dropout: no random numbers drawn). The second
    of two passes is timed: the first also sets up kernels and memory. The module is left in training mode."""
    wrapped.eval()
    x, y = loader.to_device(*batch, device)
    for _ in range(2):
        start = time.perf_counter()
        with precision:
            wrapped(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wrapped.train()
    return time.perf_counter() - start


def synchronized_seconds(started: float, device: torch.device) -> float:
    """Seconds since perf_counter() gave `started`, once the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


@dataclasses.dataclass(kw_only=True)
class Stopwatch:
    """Training time, in laps: what happens between a lap and the next restart (evaluation, saving) is left out."""

    total: float = 0.0  # seconds of all laps
    started: float = 0.0  # perf_counter() at the last restart
    start_iter: int = 0  # the step count at the last restart

    def restart(self, iter_num: int) -> None:
        self.started, self.start_iter = time.perf_counter(), iter_num

    def lap(self) -> float:
        """Seconds since the last restart, added to the total."""
        elapsed = time.perf_counter() - self.started
        self.total += elapsed
        return elapsed


@dataclasses.dataclass(kw_only=True)
class LoopState:
    """The numbers the training loop changes as it goes. The loop's functions take it and update it."""

    iter_num: int  # steps done; the next step's index
    best_val_loss: float
    start_iter: int  # where this run started (a resumed run: the checkpoint's step)
    loss_sum: torch.Tensor  # micro-batch losses summed since the last log line, on the device (no sync per step)
    first_bad_iter: torch.Tensor  # the first step whose loss was NaN or infinite, -1 if none, on the device
    last_log_iter: int  # the loss of a log line is averaged over the steps since the previous one
    watch: Stopwatch = dataclasses.field(default_factory=Stopwatch)
    last_eval: dict | None = None  # the latest evaluation result
    start_evaluated: bool = True  # whether the step it starts at was evaluated (a resumed run's, before it was saved)
    curves_drawn_at: float = dataclasses.field(default_factory=time.monotonic)  # curves.png's last refresh (or start)

    @classmethod
    def begin(
        cls, iter_num: int, best_val_loss: float, device: torch.device, start_evaluated: bool = True
    ) -> LoopState:
        """The state of a run that starts at step `iter_num` (0, or a resumed checkpoint's, evaluated before it was
        saved unless `start_evaluated` is False)."""
        return cls(
            iter_num=iter_num,
            best_val_loss=best_val_loss,
            start_iter=iter_num,
            loss_sum=torch.zeros((), device=device),
            first_bad_iter=torch.full((), -1, dtype=torch.int64, device=device),
            last_log_iter=iter_num,
            start_evaluated=start_evaluated,
        )


def note_non_finite(first_bad_iter: torch.Tensor, loss_sum: torch.Tensor, step: int) -> torch.Tensor:
    """`first_bad_iter`, or `step` if this is the first step after which `loss_sum` is not finite. Computed on the
    device, so the loop does not wait for it; first_non_finite reads it where the loop syncs anyway."""
    return torch.where((first_bad_iter < 0) & ~torch.isfinite(loss_sum), step, first_bad_iter)


def first_non_finite(first_bad_iter: torch.Tensor, device: torch.device, procs: Processes) -> int | None:
    """The first step with a NaN or infinite loss in any process, or None (a collective call)."""
    bad = int(reduce_numbers([first_bad_iter.item()], device, procs, op="max")[0])
    return bad if bad >= 0 else None


def check_finite(first_bad_iter: torch.Tensor, device: torch.device, procs: Processes, latest: Path) -> None:
    """UserError if any step so far had a NaN or infinite loss (checked where the loop syncs anyway); the message
    names the run's last checkpoint `latest` if there is one."""
    bad = first_non_finite(first_bad_iter, device, procs)
    if bad is not None:
        kept = f"; the last good checkpoint {latest} is kept" if latest.exists() else ""
        raise UserError(
            f"the loss became NaN or infinite at iter {bad}; stopped without saving{kept}. "
            "Lower --learning_rate or --grad_clip, or use --dtype=float32"
        )
