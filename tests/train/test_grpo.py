"""GRPO: the group advantage and the loss against a float64 reimplementation on a hand-made group (one group all
equal: zero advantage, no NaN), the rollout layout, and the reward functions (built-in, a user's module:function,
and the one-line errors)."""

from __future__ import annotations

import math
import statistics
import sys

import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.data.prompts import Prompt
from gptkit.data.rewards import reward_named
from gptkit.train.grpo import PromptOrder, completion_rows, group_advantages, rollouts, token_losses
from helpers import assert_one_line_message

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 3.0, 0.0]]


def hand_advantages(group: list[float]) -> list[float]:
    """(r - mean) / (sample standard deviation + 1e-4), with Python's statistics module."""
    mean, std = statistics.fmean(group), statistics.stdev(group)
    return [(r - mean) / (std + 1e-4) for r in group]


def test_advantages_match_a_float64_reimplementation_and_an_equal_group_gets_zero():
    got = group_advantages(torch.tensor(REWARDS, dtype=torch.float64))
    for row, group in zip(got.tolist(), REWARDS):
        for value, want in zip(row, hand_advantages(group)):
            assert math.isclose(value, want, rel_tol=1e-12, abs_tol=1e-12)
    assert got[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert torch.isfinite(got).all()
    assert math.isclose(got[0, 0].item(), 0.5 / (math.sqrt(1 / 3) + 1e-4), rel_tol=1e-12)  # by hand


def test_loss_and_gradient_match_a_float64_reimplementation():
    torch.manual_seed(0)
    logprobs = (-torch.rand(4, 5, dtype=torch.float64) * 3).requires_grad_()
    reference = -torch.rand(4, 5, dtype=torch.float64) * 3
    scored = torch.tensor(
        [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 0]], dtype=torch.float64
    ).bool()
    advantages = torch.tensor(hand_advantages([1.0, 0.0, 0.0, 2.0]), dtype=torch.float64)
    beta = 0.2
    losses, kl = token_losses(logprobs, advantages, scored, reference, beta)
    count = int(scored.sum())
    (losses.sum() / count).backward()
    # By hand: the value is -A + beta * (e^(ref-lp) - (ref-lp) - 1) per scored token; the gradient of that
    # per-token term with respect to lp is -A + beta * (1 - e^(ref-lp)) (the ratio's gradient is A's factor).
    want_total = 0.0
    for n in range(4):
        for t in range(5):
            if not scored[n, t]:
                assert logprobs.grad[n, t].item() == 0.0
                continue
            lp, ref, a = logprobs[n, t].item(), reference[n, t].item(), advantages[n].item()
            want_total += -a + beta * (math.exp(ref - lp) - (ref - lp) - 1)
            want_grad = (-a + beta * (1 - math.exp(ref - lp))) / count
            assert math.isclose(logprobs.grad[n, t].item(), want_grad, rel_tol=1e-10, abs_tol=1e-14)
            assert math.isclose(kl[n, t].item(), math.exp(ref - lp) - (ref - lp) - 1, rel_tol=1e-12)
    assert math.isclose(losses.sum().item() / count, want_total / count, rel_tol=1e-12)


def test_completion_rows_score_only_the_completion():
    x, y = completion_rows([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]])
    assert x.tolist() == [[5, 6, 7, 1], [8, 3, 4, 9]]  # the last token is only a target in row 0
    assert y.tolist() == [[-1, -1, 1, 2], [3, 4, 9, -1]]


class Letters:
    """A tokenizer of letters a.. (id 0 = 'a'); id 26 is the end of a reply."""

    eot_token = 26

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_rollouts_score_each_completion_with_its_prompts_record():
    prompts = [
        Prompt(ids=[1, 2], sample={"answer": "ab"}, where="p:1"),
        Prompt(ids=[3], sample={"answer": "c"}, where="p:2"),
    ]
    made = {0: [[0, 1, 26], [0, 0, 26], [2, 26], [0, 1]], 1: [[2], [2, 2], [2, 26, 5], [1]]}

    def sample(ids: list[list[int]], group: int, seed: int) -> list[list[int]]:
        assert ids == [[1, 2], [3]] and group == 4
        return made[0] + made[1]

    result = rollouts(prompts, sample, 4, seed=0, reward=reward_named("exact"), tokenizer=Letters())
    assert result.texts == ["ab", "aa", "c", "ab", "c", "cc", "c", "b"]
    assert result.rewards == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(
        result.advantages[:4].double(), torch.tensor(hand_advantages(result.rewards[:4])).double()
    )
    assert result.completion_tokens == sum(len(c) for c in made[0] + made[1])


def test_prompt_order_is_a_pure_function_of_the_index():
    order = PromptOrder(count=7, batch_size=3, seed=2)
    first = [order.indices(i) for i in range(5)]
    assert sorted(first[0] + first[1] + [first[2][0]]) == list(range(7))  # one epoch visits every prompt once
    again = PromptOrder(count=7, batch_size=3, seed=2)
    assert [again.indices(i) for i in (4, 0, 3)] == [first[4], first[0], first[3]]


def test_built_in_rewards():
    assert reward_named("exact").score("  42 ", {"answer": 42}) == 1.0
    assert reward_named("exact").score("42.", {"answer": 42}) == 0.0
    number = reward_named("number")
    assert number.score("the sum is 1,234 (not 12)", {"answer": "12"}) == 1.0
    assert number.score("1,234 and then 12", {"answer": 1234}) == 0.0
    assert number.score("no digits", {"answer": 3}) == 0.0
    assert reward_named(r"regex:^\d+$").score("123", {}) == 1.0
    assert reward_named(r"regex:^\d+$").score("12a", {}) == 0.0


def test_a_regex_reward_that_backtracks_without_end_stops_in_one_line():
    """(a|aa)+$ tries every split of a run of a's before a final '!': 2^40-odd ways, hours for re.search; the reward
    stops it and names the pattern (the run would otherwise hang at its first such completion)."""
    reward = reward_named("regex:(a|aa)+$")
    assert reward.score("aaaa", {}) == 1.0
    with pytest.raises(UserError) as raised:
        reward.score("a" * 60 + "!", {})
    assert_one_line_message(raised.value, "reward 'regex:(a|aa)+$' searched completion 'aaaa", "backtracks without end")


def test_built_in_rewards_check_the_answers_of_the_records_as_they_are_read():
    """`exact` and `number` need an answer (and `number` a numeric one): the first record without one is named by its
    file and line before any completion is made; other rewards read what they like."""
    prompts = [Prompt(ids=[1], sample={"prompt": "a", "answer": "12"}, where="p.jsonl:1")]
    reward_named("number").check_answers(prompts)
    words = [*prompts, Prompt(ids=[1], sample={"prompt": "b", "answer": "king"}, where="p.jsonl:2")]
    reward_named("exact").check_answers(words)
    with pytest.raises(UserError) as raised:
        reward_named("number").check_answers(words)
    assert_one_line_message(raised.value, "p.jsonl:2: the answer 'king' is not a number", "--reward=exact")
    with pytest.raises(UserError) as raised:  # train.py names its own flag
        reward_named("number").check_answers(words, setting="--grpo_reward")
    assert_one_line_message(raised.value, "use --grpo_reward=exact for text answers")
    for answer in (float("nan"), "inf"):  # JSON's NaN, a word float() reads: no completion's number equals them
        unreachable = [Prompt(ids=[1], sample={"prompt": "d", "answer": answer}, where="p.jsonl:4")]
        with pytest.raises(UserError, match="is not a number"):
            reward_named("number").check_answers(unreachable)
    lacking = [*prompts, Prompt(ids=[1], sample={"prompt": "c"}, where="p.jsonl:3")]
    for name in ("exact", "number"):
        with pytest.raises(UserError) as raised:
            reward_named(name).check_answers(lacking)
        assert_one_line_message(raised.value, f"p.jsonl:3: the reward '{name}' compares with an 'answer' field")
    reward_named("regex:x").check_answers(lacking)


def test_a_users_reward_function_and_its_mistakes_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(completion, sample):\n    return len(completion) / 10\n"
        "def broken(completion, sample):\n    return 1 / 0\n"
        "def wordy(completion, sample):\n    return 'yes'\n"
        "def nan(completion, sample):\n    return float('nan')\n"
        "def huge(completion, sample):\n    return 10**400\n"
    )
    (tmp_path / "failing_rewards.py").write_text("raise RuntimeError('no config file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    assert reward_named("my_rewards:length").score("abcde", {}) == 0.5
    with pytest.raises(UserError) as raised:
        reward_named("my_rewards:broken").score("abc", {"id": 7})
    assert_one_line_message(raised.value, "my_rewards:broken", "ZeroDivisionError", "'id': 7", "'abc'")
    for name, what in (("my_rewards:wordy", "'yes'"), ("my_rewards:nan", "nan"), ("my_rewards:huge", "1000")):
        with pytest.raises(UserError) as raised:
            reward_named(name).score("abc", {"id": 8})
        assert_one_line_message(raised.value, name, what, "not a finite number", "'id': 8")
    for name, what in (
        ("nosuchmodule_xyz:f", "cannot import"),
        ("failing_rewards:f", "importing 'failing_rewards' raised RuntimeError: no config file"),
        ("my_rewards:missing", "no function"),
        ("what", "unknown reward"),
    ):
        with pytest.raises(UserError) as raised:
            reward_named(name)
        assert_one_line_message(raised.value, what)
        # train.py names it --grpo_reward and eval.py --reward: the line names the reward, not one script's flag
        assert "--reward" not in str(raised.value) and repr(name) in str(raised.value)
    with pytest.raises(UserError) as raised:
        reward_named("exact").score("1", {"question": "?"})
    assert_one_line_message(raised.value, "'answer'")
