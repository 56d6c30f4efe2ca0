"""What a training step minimises: --objective=lm (next-token loss, the default), dpo or grpo, with their settings.

The training loop (train.py) is the same for all three: micro-batches, gradient accumulation and sync, clipping,
the optimizer, checkpoints and resume. An objective gives it, per step, the batches and the loss of each
micro-batch, and adds its own figures to the log:

- dpo (gptkit.train.dpo): batches of preference pairs (gptkit.data.preferences); logged loss, reward margin and
  chosen-over-rejected accuracy, on train and (at evaluations) val.
- grpo (gptkit.train.grpo): each step first samples its rollouts (G completions per prompt, in one batch), then
  the micro-batches are those rollouts; logged mean reward and completion length, and at evaluations the greedy
  pass@1 on the held-out prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gptkit.core.distributed import Processes, reduce_numbers
from gptkit.core.errors import UserError
from gptkit.core.settings import setting
from gptkit.data.prompts import Prompt
from gptkit.data.rewards import BUILT_IN, Reward
from gptkit.train import dpo, grpo
from gptkit.train.reference import Reference, token_logprobs

OBJECTIVES = ("lm", "dpo", "grpo")


@dataclass
class ObjectiveSettings:
    """--objective and the settings of each objective (train.py's settings extend this class)."""

    objective: str = setting(
        "lm",
        "lm: next-token loss (pretraining, chat fine-tuning) | dpo: preference pairs (prepare_data/preferences.py) | "
        "grpo: reinforcement learning on a reward of sampled completions",
        choices=OBJECTIVES,
    )
    dpo_beta: float = setting(0.1, "dpo: how far the model may move from the reference (beta)", rule="positive_number")
    grpo_prompts: str = setting("", "grpo: JSONL file of training prompts ('prompt' and what the reward reads)")
    grpo_eval_prompts: str = setting("", "grpo: JSONL file of held-out prompts, greedy pass@1 at every evaluation")
    grpo_group_size: int = setting(8, "grpo: completions sampled per prompt (G, at least 2)", rule="positive")
    grpo_reward: str = setting(
        "number", f"grpo: the reward: {' | '.join(BUILT_IN)} | module:function (your own, imported)"
    )
    grpo_max_new_tokens: int = setting(64, "grpo: the longest completion, in tokens", rule="positive")
    grpo_temperature: float = setting(1.0, "grpo: sampling temperature of the rollouts", rule="positive_number")
    grpo_kl_beta: float = setting(
        0.0, "grpo: weight of the KL penalty to the reference (0 = none)", rule="non_negative"
    )

    def validate_objective(self) -> None:
        """UserError for objective settings that cannot work."""
        if self.objective != "grpo":
            return
        if self.grpo_group_size < 2:
            raise UserError(
                f"--grpo_group_size={self.grpo_group_size}: a group of 1 has no advantage (each completion is "
                "compared with its group); use 2 or more"
            )
        if not self.grpo_prompts:
            raise UserError("--objective=grpo needs --grpo_prompts=FILE (JSONL with 'prompt' and e.g. 'answer')")


def step_size(settings: ObjectiveSettings, rows: int, block_size: int) -> str:
    """What one optimizer step processes, in the objective's own unit; `rows` is batch_size times the micro-batches."""
    if settings.objective == "dpo":
        return f"{rows:,} preference pairs per step (two rows of up to {block_size:,} tokens each)"
    if settings.objective == "grpo":
        return (
            f"{rows:,} prompts x {settings.grpo_group_size} completions per step "
            f"(up to {settings.grpo_max_new_tokens:,} new tokens each)"
        )
    return f"{rows * block_size:,} tokens per step"


class Dpo:
    """The DPO objective over pair batches (x, y: chosen rows, then rejected rows)."""

    def __init__(self, reference: Reference, beta: float) -> None:
        self.reference, self.beta = reference, beta
        self.sums = [0.0] * 6

    def micro_loss(
        self,
        wrapped: torch.nn.Module,
        micro: int,
        x: torch.Tensor,
        y: torch.Tensor,
        procs: Processes,
        accumulation: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, the micro-batch's mean loss for the log): the mean over its pairs, over this
        process's `accumulation` micro-batches (DDP averages the processes). `micro` and `procs`: as Grpo's."""
        scores = dpo.pair_batch_scores(wrapped, self.reference, x, y, self.beta)
        self.sums = [a + b for a, b in zip(self.sums, dpo.totals(scores))]
        loss = scores.losses.mean()
        return loss / accumulation, loss.detach().float()

    def log_entries(self, device: torch.device, procs: Processes) -> dict[str, float]:
        """The train figures since the last call (a collective call)."""
        sums, self.sums = reduce_numbers(self.sums, device, procs), [0.0] * 6
        entries = dpo.means(sums, "train")
        del entries["train/loss"]  # the line's loss already
        return entries

    def evaluate(self, wrapped, batches, precision, device, procs, prefix: str) -> dict[str, float]:
        return dpo.evaluate_pairs(wrapped, self.reference, batches, self.beta, precision, device, procs, prefix)


@dataclass(frozen=True, kw_only=True)
class GrpoPlan:
    """GRPO's fixed parts: the prompts, how rollouts are sampled (the engine, handed in by train.py) and scored."""

    prompts: list[Prompt]
    eval_prompts: list[Prompt]
    sample: grpo.SampleGroups  # rollouts: temperature sampling
    sample_greedy: grpo.SampleGroups  # held-out pass@1
    reward: Reward
    tokenizer: Any
    group_size: int
    kl_beta: float
    seed: int


class Grpo:
    """The GRPO objective: a step's rollouts are sampled first (prepare_step), then its micro-batches are trained."""

    def __init__(self, plan: GrpoPlan, order: grpo.PromptOrder, reference: Reference | None) -> None:
        self.plan, self.order, self.reference = plan, order, reference
        self.step: list[grpo.Rollouts] = []
        self.step_tokens = 1
        self.sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # reward sum, passing, completions, completion tokens, kl sum

    def prepare_step(self, micro_indices: list[int], device: torch.device, procs: Processes) -> None:
        """Sample and score the rollouts of this process's micro-batches (global indices, which seed them), and
        count the step's completion tokens over every process (a collective call)."""
        plan = self.plan
        self.step = []
        for index in micro_indices:
            prompts = [plan.prompts[i] for i in self.order.indices(index)]
            seed = plan.seed * 1_000_003 + index
            self.step.append(grpo.rollouts(prompts, plan.sample, plan.group_size, seed, plan.reward, plan.tokenizer))
        tokens = sum(r.completion_tokens for r in self.step)
        self.step_tokens = max(1, int(reduce_numbers([float(tokens)], device, procs)[0]))
        for r in self.step:
            self.sums[0] += sum(r.rewards)
            self.sums[1] += sum(value > 0 for value in r.rewards)
            self.sums[2] += len(r.rewards)
            self.sums[3] += r.completion_tokens

    def batch(self, micro: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rollout = self.step[micro]
        return rollout.x.to(device), rollout.y.to(device)

    def micro_loss(
        self,
        wrapped: torch.nn.Module,
        micro: int,
        x: torch.Tensor,
        y: torch.Tensor,
        procs: Processes,
        accumulation: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, addition to the logged loss sum): summed over the completion tokens, divided by
        the step's count over every process (times the processes, whose gradients are averaged)."""
        advantages = self.step[micro].advantages.to(x.device)
        scored = y >= 0
        logprobs = token_logprobs(wrapped, x, y).float()
        reference = None
        if self.reference is not None and self.plan.kl_beta > 0:
            reference = self.reference.token_logprobs(x, y)
        losses, kl = grpo.token_losses(logprobs, advantages, scored, reference, self.plan.kl_beta)
        self.sums[4] += float(kl.sum())
        total = losses.sum()
        logged = total.detach() * (accumulation * procs.world_size / self.step_tokens)
        return total * (procs.world_size / self.step_tokens), logged

    def log_entries(self, device: torch.device, procs: Processes) -> dict[str, float]:
        rewards, passing, completions, tokens, kl = reduce_numbers(self.sums, device, procs)
        self.sums = [0.0] * 5
        completions = max(completions, 1.0)
        entries = {
            "train/reward": rewards / completions,
            "train/pass": passing / completions,
            "train/completion_tokens": tokens / completions,
        }
        if self.reference is not None and self.plan.kl_beta > 0:
            entries["train/kl"] = kl / max(tokens, 1.0)
        return entries

    def evaluate(self, procs: Processes) -> dict[str, float]:
        """Greedy pass@1 and mean reward on the held-out prompts (each process computes it whole: no collective)."""
        if not self.plan.eval_prompts:
            return {}
        plan = self.plan
        result = grpo.pass_rate(plan.eval_prompts, plan.sample_greedy, plan.reward, plan.tokenizer, plan.seed)
        return {"val/pass@1": result["pass@1"], "val/reward": result["reward"]}
