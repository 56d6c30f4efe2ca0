"""The DPO loss and its gradient against a float64 reimplementation of the paper's formula, and the frozen
reference: a copy for full weights, the base with adapters off for LoRA, never changed by training."""

from __future__ import annotations

import math

import torch

from gptkit.model import GPT, GPTConfig
from gptkit.train.dpo import dpo_scores, pair_batch_scores
from gptkit.train.reference import Reference
from gptkit.weights.lora import LoraConfig, add_lora


def paper_loss(pc: float, pr: float, rc: float, rr: float, beta: float) -> float:
    """-log sigma(beta * (log pi(yw)/ref(yw) - log pi(yl)/ref(yl))), written out with math."""
    h = beta * ((pc - rc) - (pr - rr))
    return math.log1p(math.exp(-h))


def test_loss_and_gradient_match_the_paper_formula_in_float64():
    beta = 0.3
    policy = torch.tensor([[-12.0, -20.5], [-3.25, -2.0], [-40.0, -41.0]], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([[-13.0, -19.0], [-3.0, -2.5], [-35.0, -47.0]], dtype=torch.float64)
    scores = dpo_scores(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], beta)
    scores.losses.mean().backward()
    for i, ((pc, pr), (rc, rr)) in enumerate(zip(policy.tolist(), reference.tolist())):
        assert math.isclose(scores.losses[i].item(), paper_loss(pc, pr, rc, rr, beta), rel_tol=1e-12)
        h = beta * ((pc - rc) - (pr - rr))
        # d/dpc of log(1 + e^-h) = -beta * e^-h / (1 + e^-h) = -beta * (1 - sigma(h)); d/dpr is its negative.
        slope = beta * (1 - 1 / (1 + math.exp(-h))) / len(policy)
        assert math.isclose(policy.grad[i, 0].item(), -slope, rel_tol=1e-12)
        assert math.isclose(policy.grad[i, 1].item(), slope, rel_tol=1e-12)
        assert math.isclose(scores.chosen_rewards[i].item(), beta * (pc - rc), rel_tol=1e-12)
        assert math.isclose(scores.margins[i].item(), h, rel_tol=1e-12)


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=16, vocab_size=23, n_layer=2, n_head=2, n_embd=16))


def pair_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, 23, (4, 10), generator=generator)  # 2 pairs: chosen rows 0-1, rejected rows 2-3
    y = torch.randint(0, 23, (4, 10), generator=generator)
    y[:, :4] = -1  # the prompt is not scored
    y[1, 8:] = -1  # padding
    return x, y


def float64_sequence_logprobs(model: GPT, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Sum over scored positions of log softmax(logits)[target], in float64 on a float64 copy of the model."""
    double = tiny_model()
    double.load_state_dict(model.state_dict())
    double = double.double().eval()
    logits, _ = double(x, torch.zeros_like(y))
    logprobs = torch.log_softmax(logits, dim=-1)
    return [
        sum(logprobs[row, t, y[row, t]].item() for t in range(y.shape[1]) if y[row, t] >= 0) for row in range(len(y))
    ]


def test_model_scores_match_float64_sequence_log_probabilities():
    model, x, y = tiny_model().eval(), *pair_batch()
    reference_model = tiny_model(seed=7)  # another model as the reference, so both sides matter
    reference = Reference(reference_model)
    scores = pair_batch_scores(model, reference, x, y, beta=0.5)
    policy, ref = float64_sequence_logprobs(model, x, y), float64_sequence_logprobs(reference_model, x, y)
    for pair in range(2):
        want = paper_loss(policy[pair], policy[pair + 2], ref[pair], ref[pair + 2], 0.5)
        assert math.isclose(scores.losses[pair].item(), want, rel_tol=1e-4)


def test_the_reference_never_changes_while_the_model_trains():
    model, x, y = tiny_model(), *pair_batch()
    reference = Reference(model)
    before = reference.token_logprobs(x, y).clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        pair_batch_scores(model, reference, x, y, beta=0.1).losses.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(reference.token_logprobs(x, y), before, rtol=0, atol=0)
    assert (model.transformer.wte.weight != reference.model.transformer.wte.weight).any()  # the model did move


def test_lora_reference_is_the_base_with_adapters_off_and_keeps_no_copy():
    x, y = pair_batch()
    base = tiny_model().eval()
    base_values = float64_sequence_logprobs(base, x, y)
    model = tiny_model()
    add_lora(model, LoraConfig(rank=2, alpha=4.0, dropout=0.0, targets="attention"), "float32")
    reference = Reference(model)
    assert reference.model is model
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    for _ in range(3):
        pair_batch_scores(model, reference, x, y, beta=0.1).losses.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    reference_values = reference.token_logprobs(x, y).sum(dim=1).tolist()
    for got, want in zip(reference_values, base_values):
        assert math.isclose(got, want, rel_tol=1e-4)
    trained = model(x, y, reduction="none")[1].view(y.shape).sum(dim=1)
    assert not torch.allclose(-trained, torch.tensor(reference_values))  # the adapters are on again, and trained
    assert model.training


def test_lora_reference_puts_grown_token_rows_back_as_they_started_even_after_a_resume():
    """Chat tokens added to a base under LoRA train with the adapters; the reference has them as grow_vocabulary
    made them (the mean of the base's rows), even when it is built from a model whose rows have moved (a resume)."""
    x, y = pair_batch()
    x[0, 2], y[1, 6] = 24, 25  # use the new rows, as input and as target
    start = tiny_model()
    start.grow_vocabulary(27)  # rows 23..26: the chat template's tokens
    want = float64_sequence_logprobs_of(start, x, y)
    model = tiny_model()
    model.grow_vocabulary(27)
    add_lora(model, LoraConfig(rank=2, alpha=4.0, dropout=0.0, targets="attention"), "float32", first_new_row=23)
    with torch.no_grad():
        model.lm_head.extra.add_(torch.randn_like(model.lm_head.extra))  # as a resumed run's trained rows
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_()
    moved = model.lm_head.extra.detach().clone()
    got = Reference(model).token_logprobs(x, y).sum(dim=1).tolist()
    for value, expected in zip(got, want):
        assert math.isclose(value, expected, rel_tol=1e-4)
    assert torch.equal(model.lm_head.extra.detach(), moved)  # the trained rows are back after the pass


def test_a_lora_step_with_grown_rows_takes_the_gradient_of_its_own_pass():
    """The policy's pass first, then the reference's (pair_batch_scores' order): the reference reads the grown rows
    as they started without writing into the ones the policy's backward pass reads. The gradient equals that of a
    loss made from the same reference values given as constants."""
    x, y = pair_batch()
    x[0, 2], y[1, 6] = 24, 25
    model = tiny_model()
    model.grow_vocabulary(27)
    add_lora(model, LoraConfig(rank=2, alpha=4.0, dropout=0.0, targets="all"), "float32", first_new_row=23)
    with torch.no_grad():
        model.lm_head.extra.add_(torch.randn_like(model.lm_head.extra))  # trained away from the start
    reference = Reference(model)
    pair_batch_scores(model, reference, x, y, beta=0.1).losses.sum().backward()
    through_reference = model.lm_head.extra.grad.clone()
    model.zero_grad()
    fixed = reference.token_logprobs(x, y).sum(dim=1)
    policy = -model(x, y, reduction="none")[1].view(y.shape).sum(dim=1)
    half = len(y) // 2
    dpo_scores(policy[:half], policy[half:], fixed[:half], fixed[half:], 0.1).losses.sum().backward()
    assert through_reference.abs().sum() > 0
    assert torch.allclose(through_reference, model.lm_head.extra.grad, atol=1e-7)


def float64_sequence_logprobs_of(model: GPT, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    double = GPT(model.config)
    double.load_state_dict(model.state_dict())
    logits, _ = double.double().eval()(x, torch.zeros_like(y))
    logprobs = torch.log_softmax(logits, dim=-1)
    return [sum(logprobs[r, t, y[r, t]].item() for t in range(y.shape[1]) if y[r, t] >= 0) for r in range(len(y))]
