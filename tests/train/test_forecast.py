"""Tests for gptkit/train/forecast.py: the evaluations a run has left, durations as people read them, the line."""

from __future__ import annotations

import pytest

from gptkit.train import forecast


@pytest.mark.parametrize(
    ("iter_num", "max_iters", "interval", "resumed", "expected"),
    [
        (0, 600000, 2000, False, 301),  # steps 0, 2000, ..., 600000
        (0, 1000, 300, False, 5),  # 0, 300, 600, 900 and the end, 1000
        (600, 1000, 300, True, 2),  # 900 and 1000: the checkpoint at 600 was evaluated
        (600, 1000, 300, False, 3),  # 600 too
        (601, 1000, 300, False, 2),
        (1000, 1000, 300, True, 0),
    ],
)
def test_evaluations_left_counts_what_the_loop_evaluates(
    iter_num: int, max_iters: int, interval: int, resumed: bool, expected: int
) -> None:
    assert forecast.evaluations_left(iter_num, max_iters, interval, resumed) == expected


def test_durations_read_in_the_unit_that_fits() -> None:
    assert [forecast.duration(s) for s in (0.004, 0.3, 9.96, 45, 750, 3 * 3600 + 720, 5 * 86400)] == [
        "4 ms",  # a short evaluation is never "0 s"
        "0.3 s",
        "10 s",
        "45 s",
        "12.5 min",
        "3.2 h",
        "5.0 days",
    ]


def test_only_a_long_run_is_worth_the_line() -> None:
    run = forecast.Forecast(step_s=41.0, steps=600000, eval_s=120.0, evaluations=301)
    assert run.total_s == 41.0 * 600000 + 120.0 * 301 and run.long
    assert (
        forecast.forecast_line(run, "estimated", "")
        == (
            "a step takes 41 s (estimated): 600,000 steps and 301 evaluations of 2.0 min take about 285.1 days"  # (41 s × 600,000 + 2 min × 301) / 86,400 s
        )
    )
    assert not forecast.Forecast(step_s=0.06, steps=1000, eval_s=1.0, evaluations=5).long


def test_a_long_cpu_run_is_pointed_at_its_kinds_recipe_unless_it_runs_it() -> None:
    assert forecast.shorter_run_hint("dpo", [], 600_000) == "; for minutes on a CPU start from config/dpo_cpu.py"
    assert (
        forecast.shorter_run_hint("chat", ["my.py"], 10)
        == "; for minutes on a CPU start from config/finetune_chat_cpu.py"
    )
    running = forecast.shorter_run_hint("lm", ["config/train_corpus_cpu.py"], 100_000)
    assert running == "; for a shorter run lower --max_iters (now 100,000) or the model's size"
    assert forecast.shorter_run_hint("grpo", ["/abs/config/grpo_cpu.py"], 5000).startswith("; for a shorter run")
