"""Group Relative Policy Optimization (Shao et al. 2024), as nanochat and TRL use it: reinforcement learning on a
reward the task can check.

For each prompt the model samples a group of G completions (in one batch, through the inference engine: the
sampler is handed in, since this layer does not import gptkit.infer); a reward function scores each. A
completion's advantage is its reward relative to its group, A = (r - mean) / (std + eps) (std with Bessel's
correction, as TRL; a group whose rewards are all equal gets advantage 0). The loss on the completion tokens is

    per token: -(pi / pi.detach()) * A  +  kl_beta * (ref / pi - log(ref / pi) - 1)

(the first term's value is -A and its gradient -A * grad log pi: one on-policy update per rollout; the second is
the k3 estimate of KL(pi || ref), with ref the frozen starting model), summed over every completion token of the
step and divided by their number (token-level normalisation, as DAPO and TRL's default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gptkit.data.prompts import Prompt, completion_text
from gptkit.data.rewards import Reward

ADVANTAGE_EPS = 1e-4  # in the denominator: a group of nearly equal rewards gets a bounded advantage

# (prompts' ids, completions per prompt, seed) -> the completions' ids, prompt-major (prompt 0's G first).
SampleGroups = Callable[[list[list[int]], int, int], list[list[int]]]


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Advantages of rewards (P, G): each reward minus its group's mean, over the group's standard deviation."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)  # unbiased; G >= 2 (GrpoSettings checks it)
    return (rewards - mean) / (std + ADVANTAGE_EPS)


def token_losses(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    scored: torch.Tensor,
    reference_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss (N, T), per-token KL estimate (N, T)), both 0 where `scored` (N, T) is false; logprobs
    (N, T) of the completion tokens under the model, advantages (N,) one per completion."""
    ratio = torch.exp(logprobs - logprobs.detach())
    losses = -ratio * advantages[:, None]
    kl = torch.zeros_like(logprobs)
    if reference_logprobs is not None:
        delta = reference_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        losses = losses + kl_beta * kl
    return losses * scored, kl.detach() * scored


@dataclass(frozen=True, kw_only=True)
class Rollouts:
    """One micro-batch of rollouts: rows prompt + completion as (x, y) with y -1 outside the completions, each
    row's advantage, and the figures that are logged."""

    x: torch.Tensor
    y: torch.Tensor
    advantages: torch.Tensor
    rewards: list[float]
    completion_tokens: int
    texts: list[str]


def rollouts(
    prompts: Sequence[Prompt],
    sample: SampleGroups,
    group_size: int,
    seed: int,
    reward: Reward,
    tokenizer,
    pad_id: int = 0,
) -> Rollouts:
    """Sample `group_size` completions of every prompt in one batch, score them, and lay them out for the loss."""
    completions = sample([p.ids for p in prompts], group_size, seed)
    texts = [completion_text(tokenizer, c) for c in completions]
    rewards = [reward.score(text, prompts[i // group_size].sample) for i, text in enumerate(texts)]
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64).view(len(prompts), group_size))
    rows = [prompts[i // group_size].ids for i in range(len(completions))]
    x, y = completion_rows(rows, completions, pad_id)
    return Rollouts(
        x=x,
        y=y,
        advantages=advantages.view(-1).float(),
        rewards=rewards,
        completion_tokens=int((y >= 0).sum()),
        texts=texts,
    )


def completion_rows(
    prompts: Sequence[list[int]], completions: Sequence[list[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows prompt + completion, right-padded: x the inputs, y the next tokens where they are completion tokens
    (-1 on the prompt and the padding)."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    tokens = np.full((len(prompts), width), pad_id, dtype=np.int64)
    targets = np.full((len(prompts), width - 1), -1, dtype=np.int64)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        whole = prompt + completion
        tokens[row, : len(whole)] = whole
        targets[row, len(prompt) - 1 : len(whole) - 1] = completion
    return torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(targets)


class PromptOrder:
    """Which prompts micro-batch i takes: slots i*B ... i*B+B-1 of the epochs laid end to end, each epoch the
    prompts in an order seeded by (seed, epoch). A pure function of i, as the data samplers' batches are: the
    same rollouts after a resume and for any number of processes (`position` is saved in checkpoints)."""

    def __init__(self, count: int, batch_size: int, seed: int) -> None:
        self.count, self.batch_size, self.seed = count, batch_size, seed
        self.position = 0
        self._orders: dict[int, np.ndarray] = {}

    def indices(self, index: int) -> list[int]:
        first = index * self.batch_size
        return [self._at(slot) for slot in range(first, first + self.batch_size)]

    def _at(self, slot: int) -> int:
        epoch, at = divmod(slot, self.count)
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng((self.seed, epoch)).permutation(self.count)}
        return int(self._orders[epoch][at])

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.position = int(state["seed"]), int(state["position"])
        self._orders = {}


def pass_rate(prompts: Sequence[Prompt], sample: SampleGroups, reward: Reward, tokenizer, seed: int) -> dict:
    """One completion per prompt (the sampler decides how: greedy for the held-out pass@1), all in one batch:
    the share whose reward is above 0, and the mean reward."""
    completions = sample([p.ids for p in prompts], 1, seed)
    rewards = [reward.score(completion_text(tokenizer, c), p.sample) for c, p in zip(completions, prompts)]
    return {"pass@1": sum(r > 0 for r in rewards) / len(rewards), "reward": sum(rewards) / len(rewards)}
