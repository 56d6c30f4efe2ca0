"""Direct Preference Optimization (Rafailov et al. 2023): learn from pairs of replies, one preferred.

For a pair (prompt x, chosen y_w, rejected y_l), with log-probabilities of the whole reply summed over its tokens,

    loss = -log sigmoid(beta * ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))))

where pi is the model being trained and ref the frozen starting model (gptkit.train.reference). The implicit
rewards are beta * (log pi - log ref) of each reply; their margin (chosen minus rejected) and how often it is
positive (accuracy; a tie counts half, so the starting model, where every margin is 0, scores 0.5: chance) are
what DPO is judged by. A batch's rows are the chosen replies, then the rejected ones in the
same order (gptkit.data.preferences.PairBatches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptkit.core.distributed import Processes, reduce_numbers
from gptkit.train.reference import Reference, token_logprobs


@dataclass(frozen=True, kw_only=True)
class PairScores:
    """Per pair: the DPO loss and the implicit rewards of the chosen and the rejected reply."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards


def dpo_scores(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
) -> PairScores:
    """The DPO loss of each pair from the replies' summed log-probabilities (each (P,)) under the policy and the
    reference. The rewards are detached: they are reported, not trained on."""
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return PairScores(losses=losses, chosen_rewards=beta * chosen.detach(), rejected_rewards=beta * rejected.detach())


def sequence_logprobs(token_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probabilities of a pair batch's rows (2P, T): chosen rows first."""
    totals = token_values.float().sum(dim=1)
    pairs = totals.shape[0] // 2
    return totals[:pairs], totals[pairs:]


def pair_batch_scores(
    model: torch.nn.Module, reference: Reference, x: torch.Tensor, y: torch.Tensor, beta: float
) -> PairScores:
    """The DPO scores of a pair batch (x, y: chosen rows, then rejected rows); the gradient flows through `model`."""
    policy_chosen, policy_rejected = sequence_logprobs(token_logprobs(model, x, y))
    reference_chosen, reference_rejected = sequence_logprobs(reference.token_logprobs(x, y))
    return dpo_scores(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta)


def totals(scores: PairScores) -> list[float]:
    """[loss sum, margin sum, correct pairs, pairs, chosen reward sum, rejected reward sum]: what summing over
    batches and processes turns into the logged means (see means)."""
    return [
        float(scores.losses.detach().sum()),
        float(scores.margins.sum()),
        float((scores.margins > 0).sum() + 0.5 * (scores.margins == 0).sum()),  # a tie (as at the start) counts half
        float(scores.losses.numel()),
        float(scores.chosen_rewards.sum()),
        float(scores.rejected_rewards.sum()),
    ]


def means(total: list[float], prefix: str) -> dict[str, float]:
    """The logged entries of summed totals: loss, margin, accuracy and the two rewards, each a mean per pair."""
    loss, margin, correct, pairs, chosen, rejected = total
    pairs = max(pairs, 1.0)
    return {
        f"{prefix}/loss": loss / pairs,
        f"{prefix}/margin": margin / pairs,
        f"{prefix}/accuracy": correct / pairs,
        f"{prefix}/chosen_reward": chosen / pairs,
        f"{prefix}/rejected_reward": rejected / pairs,
    }


@torch.no_grad()
def evaluate_pairs(
    wrapped: torch.nn.Module,
    reference: Reference,
    batches,
    beta: float,
    precision,
    device: torch.device,
    procs: Processes,
    prefix: str,
) -> dict[str, float]:
    """Mean DPO loss, margin and accuracy over an indexable sequence of pair batches, split round-robin over the
    processes (each runs the same number of passes; the padding ones count for nothing). Training mode is kept."""
    training = wrapped.training
    wrapped.eval()
    total = [0.0] * 6
    for round_start in range(0, len(batches), procs.world_size):
        index = round_start + procs.rank
        x, y = (t.to(device) for t in batches[min(index, len(batches) - 1)])
        with precision:
            scores = pair_batch_scores(wrapped, reference, x, y, beta)
        if index < len(batches):
            total = [a + b for a, b in zip(total, totals(scores))]
    wrapped.train(training)
    return means(reduce_numbers(total, device, procs), prefix)
