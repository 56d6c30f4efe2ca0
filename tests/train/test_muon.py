"""muon.py: Newton-Schulz orthogonalisation, Muon steps against a float64 reference, AdamW groups against torch."""

from __future__ import annotations

import pytest
import torch

from gptkit.model import GPT, GPTConfig
from gptkit.train.muon import MuonAdamW, orthogonalize
from gptkit.train.muon import newton_schulz_on_gram as on_gram
from gptkit.train.optim import configure_optimizers


@pytest.mark.parametrize("shape", [(32, 32), (16, 64), (96, 24)])
def test_orthogonalize_pushes_singular_values_towards_one(shape):
    torch.manual_seed(0)
    matrix = torch.randn(*shape) @ torch.diag(torch.logspace(-0.5, 0.5, shape[1]))  # uneven scales
    singular = torch.linalg.svdvals(orthogonalize(matrix, dtype=torch.float32))
    assert singular.min() > 0.6 and singular.max() < 1.25
    # the directions are kept: the result is close to U V^T of the input
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    cosine = (orthogonalize(matrix, dtype=torch.float32) * (u @ vh)).sum() / (u @ vh).norm() ** 2
    assert cosine > 0.85
    # the fast bfloat16 iteration (used where the hardware has it) lands within a few percent of the float32
    # one: far inside the iteration's own spread of singular values (0.7-1.2)
    fast = orthogonalize(matrix, dtype=torch.bfloat16)
    assert (fast - orthogonalize(matrix, dtype=torch.float32)).norm() / fast.norm() < 0.06


# The quintic's coefficients in Muon's reference implementation (Keller Jordan, github.com/KellerJordan/Muon),
# written here so that a changed coefficient in gptkit/train/muon.py fails the tests below.
REFERENCE_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def reference_newton_schulz(x, steps=5):
    """Five quintic Newton-Schulz steps in float64, through the SVD: the iteration maps X = U S V^T to
    U p(S) V^T, p applied to each singular value of X / ||X||_F, so the matrix products are never formed."""
    a, b, c = REFERENCE_COEFFICIENTS
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    s = s / (s.norm() + 1e-7)  # ||X||_F, as the iteration normalises
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag_embed(s) @ vh


def reference_muon_step(weight, grad, buffer, lr, momentum):
    """Muon written out in float64: Nesterov momentum, quintic Newton-Schulz, aspect-ratio scale."""
    buffer = momentum * buffer + grad
    x = reference_newton_schulz(grad + momentum * buffer)
    return weight - lr * max(1.0, weight.shape[0] / weight.shape[1]) ** 0.5 * x, buffer


@pytest.mark.parametrize("shape", [(24, 96), (96, 24), (3, 32, 48)])
def test_float32_iteration_matches_the_float64_reference(shape: tuple[int, ...]) -> None:
    torch.manual_seed(4)
    # a few strong directions over noise, as gradients have: the small singular values are where rounding grows
    strong = torch.randn(*shape[:-1], 4) @ torch.randn(*shape[:-2], 4, shape[-1])
    update = torch.randn(*shape) + 3 * strong
    expected = torch.stack([reference_newton_schulz(matrix) for matrix in update.reshape(-1, *shape[-2:])])
    got = orthogonalize(update, dtype=torch.float32).reshape(expected.shape)
    assert ((got.double() - expected).norm() / expected.norm()).item() < 2e-4
    # the Gram-matrix form on its own, for the wide orientation it is meant for
    wide = update if shape[-2] < shape[-1] else update.mT
    wide = wide / torch.linalg.matrix_norm(wide, keepdim=True)
    gram_form = on_gram(wide, 5).reshape(-1, *wide.shape[-2:])
    expected_wide = torch.stack([reference_newton_schulz(matrix) for matrix in wide.reshape(-1, *wide.shape[-2:])])
    assert ((gram_form.double() - expected_wide).norm() / expected_wide.norm()).item() < 2e-4


def test_muon_steps_match_the_float64_reference():
    # two matrices of one shape (orthogonalised together as a stack) and one of another
    torch.manual_seed(1)
    shapes = [(48, 16), (16, 40), (48, 16)]
    weights = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    optimizer = MuonAdamW([{"params": weights, "muon": True, "lr": 0.05, "momentum": 0.9, "ns_dtype": torch.float32}])
    expected = [weight.detach().double().clone() for weight in weights]
    buffers = [torch.zeros(*shape, dtype=torch.float64) for shape in shapes]
    for _ in range(3):
        grads = [torch.randn(*shape) for shape in shapes]
        for weight, grad in zip(weights, grads):
            weight.grad = grad.clone()
        optimizer.step()
        for i, grad in enumerate(grads):
            expected[i], buffers[i] = reference_muon_step(expected[i], grad.double(), buffers[i], 0.05, 0.9)
    for weight, reference in zip(weights, expected):
        torch.testing.assert_close(weight.detach().double(), reference, rtol=0, atol=1e-5)


def test_orthogonalize_a_stack_equals_each_matrix_alone():
    torch.manual_seed(3)
    stack = torch.randn(3, 40, 24)
    each = torch.stack([orthogonalize(matrix, dtype=torch.float32) for matrix in stack])
    torch.testing.assert_close(orthogonalize(stack, dtype=torch.float32), each, rtol=0, atol=1e-5)


def test_adamw_groups_follow_torch_adamw_exactly():
    torch.manual_seed(2)
    ours_params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    settings = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ours = MuonAdamW(
        [
            {"params": [ours_params[0]], "weight_decay": 0.1, **settings},
            {"params": [ours_params[1]], "weight_decay": 0.0, **settings},
        ]
    )
    reference = torch.optim.AdamW(
        [{"params": [torch_params[0]], "weight_decay": 0.1}, {"params": [torch_params[1]], "weight_decay": 0.0}],
        **settings,
    )
    for _ in range(5):
        for a, b in zip(ours_params, torch_params):
            grad = torch.randn_like(a)
            a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        reference.step()
    for a, b in zip(ours_params, torch_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_configure_optimizers_puts_block_matrices_on_muon():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=16, tie_embeddings=False))
    optimizer = configure_optimizers(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_lr=0.02)
    muon_group, decay_group, plain_group = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in muon_group["params"]} == {
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert {names[id(p)] for p in decay_group["params"]} == {
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "lm_head.weight",
    }
    assert all(p.dim() == 1 for p in plain_group["params"])
    counted = sum(len(g["params"]) for g in optimizer.param_groups)
    assert counted == len(list(model.parameters()))
    assert [g["lr"] for g in optimizer.param_groups] == [0.02, 1e-3, 1e-3]
    assert [g["lr_scale"] for g in optimizer.param_groups] == [pytest.approx(20.0), 1.0, 1.0]


def test_muon_trains_a_small_gpt_and_its_state_round_trips():
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=20, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    optimizer = configure_optimizers(model, 0.0, 3e-3, (0.9, 0.95), "cpu", muon_lr=0.03)
    data = torch.arange(17).remainder(5).repeat(8, 1)  # a periodic sequence the model can learn
    losses = []
    for _ in range(40):
        _, loss = model(data[:, :-1], data[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
    state = optimizer.state_dict()
    fresh = configure_optimizers(model, 0.0, 3e-3, (0.9, 0.95), "cpu", muon_lr=0.03)
    fresh.load_state_dict(state)
    first = next(iter(model.transformer.h[0].attn.c_attn.parameters()))
    assert torch.equal(fresh.state[first]["momentum_buffer"], optimizer.state[first]["momentum_buffer"])
