"""Reward functions for GRPO and the generative evaluation: a completion's text and its prompt record -> a number.

Built-in verifiable rewards (1.0 right, 0.0 wrong), each reading the record's `answer` field where it needs one:

- `exact`: the completion, stripped of surrounding white space, equals str(answer) stripped;
- `number`: the last number in the completion equals the answer as a number (commas in numbers are ignored);
- `regex:PATTERN`: the pattern matches somewhere in the completion (Python's re syntax and re.search; searched with
  the `regex` package, whose time limit stops a pattern that backtracks without end on some completion).

Any other name `module:function` is a reward the user wrote: the module is imported normally (it must be on the
Python path) and called as function(completion: str, sample: dict) -> number, `sample` being the prompt's record.
A completion "passes" when its reward is above 0.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import regex

from gptkit.core.errors import UserError

BUILT_IN = ("exact", "number", "regex:PATTERN")
REGEX_SECONDS = 2.0  # far past any pattern that does not backtrack without end, on any completion
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")

RewardFunction = Callable[[str, dict], Any]


def exact_match(completion: str, sample: dict) -> float:
    return float(completion.strip() == str(_answer(sample, "exact")).strip())


def last_number(completion: str, sample: dict) -> float:
    numbers = NUMBER.findall(completion)
    if not numbers:
        return 0.0
    answer = _as_number(_answer(sample, "number"))
    return float(answer is not None and _as_number(numbers[-1]) == answer)


def _as_number(value: Any) -> float | None:
    """The number `value` spells (commas ignored); None for none, or for NaN and infinity, which no completion's
    number can equal."""
    try:
        number = float(str(value).replace(",", ""))
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _answer(sample: dict, reward: str) -> Any:
    if "answer" not in sample:
        raise UserError(f"the reward {reward!r} compares with an 'answer' field, which the prompt record lacks")
    return sample["answer"]


@dataclass(frozen=True, kw_only=True)
class Reward:
    """A named reward function; `score` checks what it returns."""

    name: str
    function: RewardFunction

    def check_answers(self, prompts: Sequence[Any], setting: str = "--reward") -> None:
        """UserError naming file:line of the first prompt record (Prompt: .where, .sample) that a built-in reward
        cannot score: `exact` and `number` need an `answer`, and `number` one that is a number. Checked as the
        prompts are read, rather than at the first completion (or never: a word never equals a number). `setting`:
        the flag that chose the reward, which the error names."""
        if self.name not in ("exact", "number"):
            return
        for prompt in prompts:
            try:
                answer = _answer(prompt.sample, self.name)
            except UserError as exc:
                raise UserError(f"{prompt.where}: {exc}") from None
            if self.name == "number" and _as_number(answer) is None:
                raise UserError(
                    f"{prompt.where}: the answer {answer!r} is not a number, which the reward 'number' compares with; "
                    f"use {setting}=exact for text answers"
                )

    def score(self, completion: str, sample: dict) -> float:
        """The reward of one completion; UserError naming the function and the sample when it raises or returns
        something that is not a finite number."""
        try:
            value = self.function(completion, sample)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(
                f"the reward function {self.name} raised {type(exc).__name__}: {exc} (sample {_brief(sample)}, "
                f"completion {completion[:60]!r})"
            ) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(finite_or_inf(value)):
            raise UserError(
                f"the reward function {self.name} returned {value!r}, not a finite number (sample {_brief(sample)}, "
                f"completion {completion[:60]!r})"
            )
        return float(value)


def finite_or_inf(value: float) -> float:
    """value as a float, an integer past float's range as infinity (float() would raise)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _brief(sample: dict) -> str:
    text = repr(sample)
    return text if len(text) <= 120 else text[:117] + "..."


def pattern_found(pattern: regex.Pattern, completion: str, sample: dict) -> float:
    """The `regex:` reward: 1.0 where `pattern` matches somewhere in the completion; UserError where the search runs
    past REGEX_SECONDS (nested repeats such as (a|aa)+ backtrack without end on some texts)."""
    try:
        return float(pattern.search(completion, timeout=REGEX_SECONDS) is not None)
    except TimeoutError:
        raise UserError(
            f"reward 'regex:{pattern.pattern}' searched completion {completion[:60]!r} for more than {REGEX_SECONDS:g} "
            "s: the pattern backtracks without end; write it without a repeat inside a repeat"
        ) from None


def reward_named(name: str) -> Reward:
    """The reward `name` stands for (see the module docstring); UserError for one that cannot be found."""
    if name == "exact":
        return Reward(name=name, function=exact_match)
    if name == "number":
        return Reward(name=name, function=last_number)
    if name.startswith("regex:"):
        try:
            pattern = regex.compile(name.removeprefix("regex:"))
        except regex.error as exc:
            raise UserError(f"reward {name!r}: not a valid regular expression ({exc})") from None
        return Reward(name=name, function=functools.partial(pattern_found, pattern))
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name:
        raise UserError(f"unknown reward {name!r}: use {', '.join(BUILT_IN)} or module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"reward {name!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") from None
    except Exception as exc:  # the module itself fails as it is imported
        raise UserError(f"reward {name!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserError(f"reward {name!r}: {module_name} has no function {function_name!r}")
    return Reward(name=name, function=function)
