"""model.py: attention paths, positions, KV cache, sampling, optimizer groups, MFU, GPT-2 interop."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from gptkit.errors import UserError
from model import (
    GPT,
    GPTConfig,
    KVCache,
    Linear,
    apply_rotary,
    onednn_linear_available,
    rotary_tables,
    sample_next_token,
    sinusoidal_table,
)

POSITIONS = ["learned", "sinusoidal", "rope"]


def tiny_config(**overrides) -> GPTConfig:
    settings = dict(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
    settings.update(overrides)
    return GPTConfig(**settings)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


def uncached_greedy(model: GPT, idx: torch.Tensor, steps: int) -> torch.Tensor:
    """The plain reference: a full forward pass over the (cropped) context for every new token."""
    for _ in range(steps):
        logits, _ = model(idx[:, -model.config.block_size :])
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


@pytest.mark.parametrize("pos_encoding", POSITIONS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_sdpa_and_math_attention_agree_on_outputs_and_gradients(pos_encoding, qk_norm):
    sdpa = tiny_model(pos_encoding=pos_encoding, qk_norm=qk_norm, attention="sdpa")
    math_path = tiny_model(pos_encoding=pos_encoding, qk_norm=qk_norm, attention="math")
    math_path.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 37, (3, 16))
    targets = torch.randint(0, 37, (3, 16))
    logits_a, loss_a = sdpa(idx, targets)
    logits_b, loss_b = math_path(idx, targets)
    torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=1e-5)
    loss_a.backward()
    loss_b.backward()
    for (name, p_a), (_, p_b) in zip(sdpa.named_parameters(), math_path.named_parameters()):
        torch.testing.assert_close(p_a.grad, p_b.grad, rtol=0, atol=1e-5, msg=name)


def test_attention_is_causal():
    model = tiny_model()
    idx = torch.randint(0, 37, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 37
    logits_a, _ = model(idx, torch.zeros_like(idx))
    logits_b, _ = model(changed, torch.zeros_like(idx))
    torch.testing.assert_close(logits_a[:, :8], logits_b[:, :8])  # the future never leaks into the past
    assert not torch.allclose(logits_a[:, 8:], logits_b[:, 8:])


def test_gpt2_initialisation_and_tied_head():
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=6, n_head=4, n_embd=256)
    model = GPT(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.02)
    residual_std = 0.02 / math.sqrt(2 * 6)
    assert model.transformer.h[3].attn.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.02)
    assert model.transformer.h[3].mlp.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.02)
    assert torch.count_nonzero(model.transformer.h[0].attn.c_attn.bias) == 0
    untied = GPT(GPTConfig(block_size=8, vocab_size=40, n_layer=1, n_head=1, n_embd=8, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def test_sinusoidal_table_follows_the_formula():
    table = sinusoidal_table(50, 8)
    pos, i, d = 37, 2, 8
    assert table[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / d)), abs=1e-6)
    assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / d)), abs=1e-6)


def test_rotary_scores_depend_only_on_relative_position():
    cos, sin = rotary_tables(64, 8, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m: int, n: int) -> float:
        return (apply_rotary(q, cos[m : m + 1], sin[m : m + 1]) * apply_rotary(k, cos[n : n + 1], sin[n : n + 1])).sum()

    assert score(10, 3).item() == pytest.approx(score(40, 33).item(), abs=1e-5)
    assert score(10, 3).item() != pytest.approx(score(10, 4).item(), abs=1e-3)


def test_activations():
    x = torch.randn(4, 16)
    for activation, expected in [
        ("gelu", F.gelu(x)),
        ("gelu_tanh", F.gelu(x, approximate="tanh")),
        ("relu2", F.relu(x) ** 2),
    ]:
        mlp = tiny_model(activation=activation).transformer.h[0].mlp
        torch.testing.assert_close(mlp.c_proj(mlp_activation(mlp, x)), mlp.c_proj(expected_hidden(mlp, x, activation)))
        assert expected.shape == x.shape


def mlp_activation(mlp, x):
    hidden = mlp.c_fc(x)
    return {"gelu": F.gelu(hidden), "gelu_tanh": F.gelu(hidden, approximate="tanh"), "relu2": F.relu(hidden) ** 2}[
        mlp.activation
    ]


def expected_hidden(mlp, x, activation):
    with torch.no_grad():
        full = mlp(x)
    # the module's output must equal c_proj(activation(c_fc(x))) for the named activation
    torch.testing.assert_close(full, mlp.c_proj(mlp_activation(mlp, x)))
    return mlp_activation(mlp, x)


def test_forward_shapes_and_loss():
    model = tiny_model()
    idx = torch.randint(0, 37, (2, 10))
    logits, loss = model(idx)
    assert logits.shape == (2, 1, 37) and loss is None
    targets = torch.randint(0, 37, (2, 10))
    targets[0, :5] = -1  # ignored positions
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 10, 37)
    keep = targets.view(-1) != -1
    expected = F.cross_entropy(logits.view(-1, 37)[keep], targets.view(-1)[keep])
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    with pytest.raises(ValueError):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("pos_encoding", POSITIONS)
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_cached_logits_equal_full_forward_at_every_step(pos_encoding, attention):
    model = tiny_model(pos_encoding=pos_encoding, attention=attention)
    idx = torch.randint(0, 37, (2, 16))
    full_logits, _ = model(idx, torch.zeros_like(idx))
    cache = KVCache(model.config.n_layer, model.config.block_size)
    with torch.no_grad():
        prefill, _ = model(idx[:, :5], cache=cache)
        torch.testing.assert_close(prefill[:, -1], full_logits[:, 4], rtol=0, atol=1e-5)
        for t in range(5, 16):
            step, _ = model(idx[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, -1], full_logits[:, t], rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos_encoding", POSITIONS)
def test_cached_greedy_equals_uncached_greedy(pos_encoding):
    model = tiny_model(pos_encoding=pos_encoding)
    prompt = torch.randint(0, 37, (1, 4))
    cached = model.generate(prompt, max_new_tokens=12, temperature=0)
    assert torch.equal(cached, uncached_greedy(model, prompt, 12))


def test_batch_of_prompts_generates_together():
    model = tiny_model()
    prompts = torch.randint(0, 37, (3, 5))
    together = model.generate(prompts, max_new_tokens=8, temperature=0)
    for row in range(3):
        alone = model.generate(prompts[row : row + 1], max_new_tokens=8, temperature=0)
        assert torch.equal(together[row : row + 1], alone)


def test_generation_continues_past_block_size_over_a_sliding_window():
    model = tiny_model(pos_encoding="rope")
    prompt = torch.randint(0, 37, (2, 6))
    out = model.generate(prompt, max_new_tokens=40, temperature=0)
    assert out.shape == (2, 46)
    # Up to a full window the cache changes nothing; after that each step sees a window of 12-16 tokens.
    assert torch.equal(out[:, :17], uncached_greedy(model, prompt, 11))
    steps = list(model.generate_stream(prompt, max_new_tokens=40, temperature=0))
    assert torch.equal(torch.stack(steps, dim=1), out[:, 6:])
    # The token after the first slide is the greedy choice over the last 12 tokens (3/4 of the window).
    window = out[:, 17 - 12 : 17]
    logits, _ = model(window)
    assert torch.equal(logits[:, -1].argmax(-1), out[:, 17])


def test_sampling_controls():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    assert sample_next_token(logits, temperature=0).item() == 1
    generator = torch.Generator().manual_seed(0)
    top2 = {sample_next_token(logits, 1.0, top_k=2, generator=generator).item() for _ in range(200)}
    assert top2 == {1, 2}
    probs = F.softmax(logits, -1)[0]  # sorted: 1 (0.64), 2 (0.24), 0 (0.09), ...
    p = (probs[1] + 0.5 * probs[2]).item()  # needs tokens 1 and 2 to reach p
    nucleus = {sample_next_token(logits, 1.0, top_p=p, generator=generator).item() for _ in range(300)}
    assert nucleus == {1, 2}
    only_top = {sample_next_token(logits, 1.0, top_p=0.1, generator=generator).item() for _ in range(50)}
    assert only_top == {1}
    a = sample_next_token(logits.repeat(8, 1), 1.0, generator=torch.Generator().manual_seed(5))
    b = sample_next_token(logits.repeat(8, 1), 1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, kept",
    [(1.0, None, None, [0, 1, 2, 3, 4]), (1.0, 3, None, [1, 2, 0]), (1.0, None, 0.8, [1, 2]),
     (1.0, 4, 0.9, [1, 2, 0]), (0.5, 2, None, [1, 2])],
)  # fmt: skip
def test_sampling_frequencies_follow_the_renormalized_distribution(temperature, top_k, top_p, kept):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]]).repeat(20_000, 1)  # probabilities .09 .64 .24 .03 .01
    tokens = sample_next_token(logits, temperature, top_k, top_p, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    expected = torch.zeros(5, dtype=torch.float64)
    expected[kept] = F.softmax(logits[0, kept].double() / temperature, dim=-1)
    torch.testing.assert_close(frequencies, expected, rtol=0, atol=0.01)


def test_seeded_generation_is_reproducible():
    model = tiny_model()
    prompt = torch.randint(0, 37, (2, 3))
    a = model.generate(prompt, 10, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 10, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_stop_tokens_end_generation_early():
    model = tiny_model()
    prompt = torch.randint(0, 37, (1, 3))
    free = model.generate(prompt, 12, temperature=0)
    stop = free[0, 6].item()  # the 4th generated token
    first_stop = (free[0, 3:] == stop).nonzero()[0].item() + 3
    stopped = model.generate(prompt, 12, temperature=0, stop_tokens=[stop])
    assert stopped.shape[1] == first_stop + 1
    assert torch.equal(stopped, free[:, : first_stop + 1])


def test_configure_optimizers_decays_only_matrices():
    model = tiny_model(bias=True)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_flops_and_mfu_use_the_given_peak():
    model = tiny_model()
    assert model.estimate_mfu(4, 0.5, None) is None
    expected = model.flops_per_token() * 16 * 4 / 0.5 / 1e12
    assert model.estimate_mfu(4, 0.5, 1e12) == pytest.approx(expected)
    n = model.get_num_params()
    assert model.flops_per_token() == 6 * n + 12 * 2 * 16 * 16


def test_crop_block_size():
    for pos in POSITIONS:
        model = tiny_model(pos_encoding=pos)
        idx = torch.randint(0, 37, (1, 8))
        before, _ = model(idx)
        model.crop_block_size(8)
        after, _ = model(idx)
        torch.testing.assert_close(before, after)
        assert model.config.block_size == 8
        with pytest.raises(ValueError):
            model(torch.zeros(1, 9, dtype=torch.long))


def test_invalid_configs_are_user_errors():
    with pytest.raises(UserError, match="divisible"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(UserError, match="pos_encoding"):
        GPTConfig(pos_encoding="alibi")
    with pytest.raises(UserError, match="block_size"):
        GPTConfig(block_size=0)


def test_fused_adamw_matches_the_plain_path():
    """configure_optimizers' fused AdamW (CPU and CUDA) takes the same steps as torch's plain for-loop AdamW."""
    # bias=False: a key bias gets only rounding noise as gradient (softmax ignores it), which Adam amplifies
    fast, plain = tiny_model(seed=3, bias=False), tiny_model(seed=3, bias=False)
    fused = fast.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    assert fused.defaults["fused"] is True
    groups = [{"params": [p for p in plain.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in plain.parameters() if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    reference = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), foreach=False)
    idx = torch.randint(0, 37, (4, 16))
    for model, optimizer in ((fast, fused), (plain, reference)):
        for _ in range(5):
            _, loss = model(idx, idx)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for (name, a), (_, b) in zip(fast.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_compiled_model_matches_eager_loss_and_gradients():
    eager = tiny_model(seed=4, pos_encoding="rope", qk_norm=True)
    compiled_copy = tiny_model(seed=4, pos_encoding="rope", qk_norm=True)
    compiled = torch.compile(compiled_copy)
    idx = torch.randint(0, 37, (2, 16))
    _, loss_eager = eager(idx, idx)
    _, loss_compiled = compiled(idx, idx)
    assert loss_compiled.item() == pytest.approx(loss_eager.item(), abs=1e-5)
    loss_eager.backward()
    loss_compiled.backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled_copy.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("bias", [True, False])
def test_cpu_decoding_optimization_changes_speed_not_results(bias):
    model = tiny_model(seed=5, bias=bias)
    prompt = torch.randint(0, 37, (2, 4))
    expected_tokens = model.generate(prompt, 10, temperature=0)
    expected_logits, _ = model(prompt)
    model.optimize_for_cpu_decoding()
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert model.transformer.h[0].mlp.c_fc.weight.stride() == (1, 64)  # (in, out) contiguous in memory
    assert model.lm_head.onednn == onednn_linear_available()
    with torch.no_grad():
        logits, _ = model(prompt)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)
    assert torch.equal(model.generate(prompt, 10, temperature=0), expected_tokens)
    seeded = [model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*seeded)


def test_compiled_model_after_cpu_decoding_optimization():
    """torch.compile cannot lower the direct oneDNN call, so a compiled model must trace F.linear instead."""
    model = tiny_model(seed=2).optimize_for_cpu_decoding()
    prompt = torch.randint(0, 37, (2, 6))
    with torch.no_grad():
        expected, _ = model(prompt)
        compiled, _ = torch.compile(model)(prompt)
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_linear_available(), reason="needs oneDNN on an x86 CPU")
@pytest.mark.parametrize("shape", [(3, 48), (2, 5, 48), (1, 1, 48)])
def test_onednn_linear_matches_plain_linear(shape):
    torch.manual_seed(0)
    layer = Linear(48, 40)
    layer.use_decoding_layout(onednn=True)
    x = torch.randn(*shape)
    with torch.no_grad(), torch.profiler.profile() as prof:
        y = layer(x)
    calls = [event.name for event in prof.events()]
    assert "mkldnn::_linear_pointwise" in calls  # the direct kernel really ran
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    strided = torch.randn(*shape[:-1], 96)[..., ::2]  # a view with gaps between its elements
    with torch.no_grad():
        torch.testing.assert_close(layer(strided), F.linear(strided, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    # With gradients on (training), the module stays on F.linear and autograd works.
    y = layer(x)
    y.sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((40,), float(x[..., 0].numel())))
