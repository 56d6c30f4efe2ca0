"""Groups of completions of many prompts, all in one continuously batched engine: GRPO's rollouts and the
generative evaluation's n samples per prompt.

Completion j of prompt i is drawn with its own seed from (seed, i, j), so it does not depend on what else shares
the batch, nor on how many processes split the prompts. Temperature 0 is greedy. A completion ends at a stop token
(kept, as the last token) or after max_new_tokens, or where the context would be full (no sliding window: the
prompt stays whole).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn

from gptkit.infer.engine import Engine, Request


def sample_seed(seed: int, prompt: int, sample: int) -> int:
    """A well-mixed seed for completion `sample` of prompt `prompt`."""
    return int(np.random.SeedSequence((seed, prompt, sample)).generate_state(1, np.uint64)[0] >> 1)


@torch.no_grad()
def sample_groups(
    model: nn.Module,
    prompts: Sequence[list[int]],
    group_size: int,
    seed: int,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    stop_tokens: Sequence[int] = (),
    slots: int | None = None,
    decode: str = "eager",
    first_prompt: int = 0,
) -> list[list[int]]:
    """`group_size` completions of every prompt, prompt-major, made by one engine with up to `slots` rows (default:
    all of them at once). `first_prompt` numbers the prompts for their seeds (a process's share of a larger set).
    The model is in eval mode meanwhile. decode: the engine's backend; eager by default, since a model that is being
    trained changes between calls: the compiled step keeps the weights it first froze, and the native and oneDNN
    backends would copy the weights again after every optimizer step."""
    block_size = model.config.block_size
    requests = []
    for index, prompt in enumerate(prompts):
        if len(prompt) >= block_size:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in a context of {block_size}")
        for sample in range(group_size):
            requests.append(
                Request(
                    prompt=list(prompt),
                    max_new_tokens=min(max_new_tokens, block_size - len(prompt)),
                    temperature=temperature,
                    top_k=top_k,
                    stop_tokens=tuple(stop_tokens),
                    seed=sample_seed(seed, first_prompt + index, sample),
                )
            )
    training = model.training
    model.eval()
    try:
        engine = Engine(model, slots=min(slots or len(requests), len(requests)), decode=decode)
        for _ in engine.run(requests):
            pass
    finally:
        model.train(training)
    return [request.output for request in requests]
