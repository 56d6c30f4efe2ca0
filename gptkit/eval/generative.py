"""Generative tasks with verifiable answers: n completions of every prompt through the batched engine, each scored
by a reward (gptkit.data.rewards), reported as pass@k.

pass@k is the chance that at least one of k completions passes (reward above 0), estimated without bias from n >= k
samples per prompt with c passing as 1 - C(n - c, k) / C(n, k) (Chen et al. 2021), averaged over prompts; pass@1 is
then the mean share of passing samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from gptkit.data.prompts import Prompt, completion_text
from gptkit.data.rewards import Reward
from gptkit.infer.groups import sample_groups


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c of n samples passing."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def stop_tokens_of(tokenizer: Any) -> tuple[int, ...]:
    """Where a completion ends: a chat reply's stops, else the end-of-text token (if the tokenizer has one)."""
    chat = getattr(tokenizer, "chat", None)
    if chat is not None:
        return tuple(chat.reply_stops)
    eot = getattr(tokenizer, "eot_token", None)
    return () if eot is None else (eot,)


def evaluate_generative(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    reward: Reward,
    *,
    samples: int,
    ks: Sequence[int],
    seed: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None = None,
    slots: int | None = None,
    decode: str = "auto",
) -> dict[str, Any]:
    """{"pass@k" for each k, "reward" (mean over every sample), "n" (prompts), "samples" (per prompt)}."""
    completions = sample_groups(
        model,
        [p.ids for p in prompts],
        samples,
        seed,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        stop_tokens=stop_tokens_of(tokenizer),
        slots=slots,
        decode=decode,
    )
    rewards = [
        reward.score(completion_text(tokenizer, c), prompts[i // samples].sample) for i, c in enumerate(completions)
    ]
    passing = [sum(r > 0 for r in rewards[i * samples : (i + 1) * samples]) for i in range(len(prompts))]
    result: dict[str, Any] = {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in passing) / len(prompts) for k in ks}
    result.update(reward=sum(rewards) / len(rewards), n=len(prompts), samples=samples)
    return result
