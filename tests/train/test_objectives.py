"""Tests for gptkit/train/objectives.py: what a step processes, said in each objective's own unit."""

from __future__ import annotations

from gptkit.train.objectives import ObjectiveSettings, step_size


def test_each_objective_states_its_step_in_its_own_unit() -> None:
    # 4 micro-batches of 8 rows: 32 rows a step.
    assert step_size(ObjectiveSettings(objective="lm"), 32, 256) == "8,192 tokens per step"  # 32 x 256
    dpo = step_size(ObjectiveSettings(objective="dpo"), 32, 256)
    assert dpo == "32 preference pairs per step (two rows of up to 256 tokens each)"
    grpo = step_size(ObjectiveSettings(objective="grpo", grpo_group_size=6, grpo_max_new_tokens=48), 32, 256)
    assert grpo == "32 prompts x 6 completions per step (up to 48 new tokens each)"
