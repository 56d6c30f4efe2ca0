"""Tests for gptkit/train/loop.py: the learning-rate schedule, dropout seeds, the mean loss over batches of
different sizes, training time that leaves evaluations out, and the loop's non-finite loss bookkeeping."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from gptkit.core.distributed import Processes
from gptkit.core.errors import UserError
from gptkit.data import loader
from gptkit.train import loop


def test_learning_rate_warms_up_from_above_zero_then_decays_to_min_lr() -> None:
    cfg = loop.Schedule(learning_rate=1.0, min_lr=0.1, warmup_iters=9, lr_decay_iters=109)
    assert loop.learning_rate_at(0, cfg) == pytest.approx(0.1)
    assert loop.learning_rate_at(8, cfg) == pytest.approx(0.9)
    assert loop.learning_rate_at(9, cfg) == pytest.approx(1.0)
    assert loop.learning_rate_at(59, cfg) == pytest.approx(0.55)  # half way down the cosine
    assert loop.learning_rate_at(109, cfg) == pytest.approx(0.1)
    assert loop.learning_rate_at(10_000, cfg) == pytest.approx(0.1)
    assert loop.learning_rate_at(3, dataclasses.replace(cfg, decay_lr=False)) == 1.0
    no_warmup = dataclasses.replace(cfg, warmup_iters=0, lr_decay_iters=0)  # no division by zero
    assert loop.learning_rate_at(0, no_warmup) == pytest.approx(0.1)


def fitted(max_iters: int, warmup_iters: int | None = None, lr_decay_iters: int | None = None) -> loop.Schedule:
    return loop.Schedule.fitted(
        max_iters=max_iters,
        learning_rate=3e-5,
        min_lr=3e-6,
        warmup_iters=warmup_iters,
        lr_decay_iters=lr_decay_iters,
        decay_lr=True,
    )


@pytest.mark.parametrize(
    ("max_iters", "warmup", "decay"), [(1000, 100, 1000), (600000, 2000, 600000), (5, 0, 5), (0, 0, 0)]
)
def test_an_unset_warmup_and_decay_fit_the_run(max_iters: int, warmup: int, decay: int) -> None:
    schedule = fitted(max_iters)
    assert (schedule.warmup_iters, schedule.lr_decay_iters) == (warmup, decay)  # a tenth (at most 2000), the end
    if max_iters:
        assert loop.learning_rate_at(warmup, schedule) == pytest.approx(3e-5)  # the peak is reached
        assert loop.learning_rate_at(max_iters, schedule) == pytest.approx(3e-6)


def test_a_warmup_that_does_not_end_before_max_iters_is_shortened_a_long_decay_is_kept() -> None:
    assert (fitted(1000, warmup_iters=2000).warmup_iters, fitted(1000, warmup_iters=2000).shortened_from) == (100, 2000)
    assert fitted(1000, warmup_iters=1000).warmup_iters == 100  # would end with the run: shortened too
    assert (fitted(1000, warmup_iters=999).warmup_iters, fitted(1000, warmup_iters=999).shortened_from) == (999, None)
    assert fitted(1000, lr_decay_iters=5000).lr_decay_iters == 5000  # stops part way; resumed with more steps
    constant = loop.Schedule.fitted(
        max_iters=10, learning_rate=1.0, min_lr=0.1, warmup_iters=50, lr_decay_iters=None, decay_lr=False
    )
    assert constant.shortened_from is None and loop.learning_rate_at(0, constant) == 1.0  # nothing to fit


def test_each_param_group_runs_at_its_scale_of_the_scheduled_rate() -> None:
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    optimizer = torch.optim.SGD([{"params": [weights[0]]}, {"params": [weights[1]], "lr_scale": 10.0}], lr=1.0)
    loop.set_learning_rate(optimizer, 0.5)
    assert [group["lr"] for group in optimizer.param_groups] == [0.5, 5.0]


def test_dropout_seeds_are_reproducible_and_distinct() -> None:
    seeds = {loop.seed_for(1337, loop.DROPOUT_STREAM, index) for index in range(1000)}
    assert len(seeds) == 1000 and all(0 <= seed < 2**63 for seed in seeds)  # torch.manual_seed takes them
    assert loop.seed_for(1337, loop.DROPOUT_STREAM, 7) == loop.seed_for(1337, loop.DROPOUT_STREAM, 7)
    assert loop.seed_for(1337, loop.DROPOUT_STREAM, 7) != loop.seed_for(1338, loop.DROPOUT_STREAM, 7)
    assert loop.DROPOUT_STREAM not in (loader.PURPOSE_TRAIN, loader.PURPOSE_EVAL_TRAIN, loader.PURPOSE_EVAL_VAL)


class MeanOfTargets(torch.nn.Module):
    """Stands in for a GPT: its "loss" for a batch is the mean of the batch's targets."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
        self.modes.append(self.training)
        assert not torch.is_grad_enabled()
        return None, y.float().mean()


def test_mean_loss_is_per_token_over_batches_of_different_sizes() -> None:
    batches = [(torch.zeros(1, 2), torch.full((1, 2), 1.0)), (torch.zeros(3, 2), torch.full((3, 2), 5.0))]
    module = MeanOfTargets()
    module.train()
    loss = loop.mean_loss(module, batches, contextlib.nullcontext(), torch.device("cpu"), Processes())
    assert loss == pytest.approx((2 * 1.0 + 6 * 5.0) / 8)  # not the mean of the two batch means (3.0)
    assert module.modes == [False, False] and module.training  # evaluated in eval mode, left training


def test_mean_loss_over_batches_without_a_target_is_one_line() -> None:
    """Chat data whose replies all start past the window: every target is masked (-1), and no loss exists."""
    batches = [(torch.zeros(2, 4), torch.full((2, 4), -1.0))]
    with pytest.raises(UserError, match="the evaluation batches hold no token to train on"):
        loop.mean_loss(MeanOfTargets(), batches, contextlib.nullcontext(), torch.device("cpu"), Processes())


def test_stopwatch_leaves_out_what_happens_between_a_lap_and_the_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 12.0, 50.0, 51.5])
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    watch = loop.Stopwatch()
    watch.restart(iter_num=5)  # t = 10
    assert watch.lap() == pytest.approx(2.0)  # t = 12; then an evaluation until t = 50
    watch.restart(iter_num=7)
    assert watch.lap() == pytest.approx(1.5) and watch.total == pytest.approx(3.5)
    assert watch.start_iter == 7


def test_the_first_non_finite_step_is_remembered() -> None:
    state = loop.LoopState.begin(iter_num=4, best_val_loss=float("inf"), device=torch.device("cpu"))
    assert (state.start_iter, state.last_log_iter, state.loss_sum.item(), state.last_eval) == (4, 4, 0.0, None)
    procs, cpu = Processes(), torch.device("cpu")
    bad = state.first_bad_iter
    assert loop.first_non_finite(bad, cpu, procs) is None
    bad = loop.note_non_finite(bad, torch.tensor(1.5), step=4)
    assert loop.first_non_finite(bad, cpu, procs) is None
    bad = loop.note_non_finite(bad, torch.tensor(float("nan")), step=5)
    bad = loop.note_non_finite(bad, torch.tensor(float("inf")), step=6)  # still the first one
    assert loop.first_non_finite(bad, cpu, procs) == 5
