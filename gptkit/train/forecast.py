"""How long a run will take, said before it gets going when that is long.

train.py's defaults are GPT-2's, sized for GPUs: on a laptop CPU one step takes minutes and the first evaluation
longer. A newcomer should learn that before waiting, not after: train.py times one forward pass before the first
evaluation (a training step's forward and backward take about three) and then the first step itself, and prints a
Forecast when the rest of the run would take longer than LONG_RUN_S.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

# The recipe that trains each kind of run for minutes on a CPU.
CPU_RECIPES = {
    "lm": "config/train_corpus_cpu.py",
    "chat": "config/finetune_chat_cpu.py",
    "dpo": "config/dpo_cpu.py",
    "grpo": "config/grpo_cpu.py",
}
LONG_RUN_S = 300.0  # a run longer than this is worth a line before it starts
BACKWARD_FACTOR = 3  # a step's forward and backward cost about three forward passes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Forecast:
    """The time left in a run: `steps` steps of `step_s` seconds and `evaluations` evaluations of `eval_s`."""

    step_s: float
    steps: int
    eval_s: float
    evaluations: int

    @property
    def total_s(self) -> float:
        return self.step_s * self.steps + self.eval_s * self.evaluations

    @property
    def long(self) -> bool:
        return self.total_s > LONG_RUN_S


def evaluations_left(iter_num: int, max_iters: int, eval_interval: int, resumed: bool) -> int:
    """The evaluations the loop makes from step `iter_num` on: at every multiple of eval_interval up to max_iters
    and at max_iters itself, except at the step a resumed run starts from (its checkpoint was evaluated)."""
    multiples = max_iters // eval_interval - (iter_num - 1) // eval_interval
    at_end = 1 if max_iters % eval_interval else 0
    skipped = 1 if resumed and (iter_num % eval_interval == 0 or iter_num == max_iters) else 0
    return max(0, multiples + at_end - skipped)


def duration(seconds: float) -> str:
    """A duration in the unit a person reads best: 0.3 s, 45 s, 12.5 min, 3.2 h, 4.1 days."""
    if seconds < 9.95:
        return f"{seconds:.1f} s" if seconds >= 0.05 else f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def forecast_line(forecast: Forecast, measured: str, hint: str) -> str:
    """The line of a long run: `measured` says where step_s comes from, `hint` how to make it shorter (or "")."""
    evaluations = (
        f" and {forecast.evaluations:,} evaluations of {duration(forecast.eval_s)}" if forecast.evaluations else ""
    )
    return (
        f"a step takes {forecast.step_s:.3g} s ({measured}): {forecast.steps:,} steps{evaluations} "
        f"take about {duration(forecast.total_s)}{hint}"
    )


def shorter_run_hint(kind: str, config_files: Sequence[str], max_iters: int) -> str:
    """How to make a long CPU run of `kind` (a CPU_RECIPES key) shorter: its recipe, or, to a user already running
    that recipe, fewer steps."""
    recipe = CPU_RECIPES[kind]
    if any(Path(file).name == Path(recipe).name for file in config_files):
        return f"; for a shorter run lower --max_iters (now {max_iters:,}) or the model's size"
    return f"; for minutes on a CPU start from {recipe}"
