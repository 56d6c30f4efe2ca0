"""model.py: attention paths, positions, the forward pass with a KV cache, optimizer groups, FLOPs and MFU.

Generation and the CPU fast path are tested in tests/infer/test_engine.py, Hugging Face interop in tests/weights/test_hf.py.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch.nn import functional as F

from gptkit.infer.engine import KVCache
from gptkit.model import GPT, GPTConfig, apply_rotary, rotary_tables, sinusoidal_table
from gptkit.train.optim import configure_optimizers

POSITIONS = ["learned", "sinusoidal", "rope"]


def tiny_config(**overrides) -> GPTConfig:
    settings = dict(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
    settings.update(overrides)
    return GPTConfig(**settings)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


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
    """The MLP is c_proj(activation(c_fc(x))); expected values from the weights and each activation's formula."""
    x = torch.randn(4, 16, dtype=torch.float64)
    formulas = {
        "gelu": lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2))),
        "gelu_tanh": lambda h: 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3))),
        "relu2": lambda h: torch.where(h > 0, h, 0.0) ** 2,
    }
    for activation, formula in formulas.items():
        mlp = tiny_model(activation=activation).transformer.h[0].mlp.double()
        with torch.no_grad():
            for param in mlp.parameters():  # non-zero biases, so a missing bias shows
                param.normal_(0.0, 0.5)
            hidden = x @ mlp.c_fc.weight.T + mlp.c_fc.bias
            expected = formula(hidden) @ mlp.c_proj.weight.T + mlp.c_proj.bias
            torch.testing.assert_close(mlp(x), expected, rtol=0, atol=1e-10)
    assert not torch.allclose(formulas["gelu"](hidden), formulas["gelu_tanh"](hidden), rtol=0, atol=1e-6)


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
    cache = KVCache(model.config.n_layer, model.config.block_size, slots=2)
    with torch.no_grad():
        prefill, _ = model(idx[:, :5], cache=cache)
        torch.testing.assert_close(prefill[:, -1], full_logits[:, 4], rtol=0, atol=1e-5)
        for t in range(5, 16):
            step, _ = model(idx[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, -1], full_logits[:, t], rtol=0, atol=1e-5)


def test_configure_optimizers_decays_only_matrices():
    model = tiny_model(bias=True)
    optimizer = configure_optimizers(model, 0.1, 1e-3, (0.9, 0.95), "cpu")
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_flops_and_mfu_use_the_given_peak():
    """FLOPs counted by hand for the tiny config (block 16, vocab 37, 2 layers, width 16, biases, tied head)."""
    model = tiny_model()
    C, L, V, T = 16, 2, 37, 16
    per_block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C)
    params = L * per_block + V * C + 2 * C  # blocks, the token embedding (the tied head), ln_f; not wpe
    assert params == 7184
    flops_per_token = 6 * params + 12 * L * C * T  # forward + backward per parameter, plus attention scores
    assert model.flops_per_token() == flops_per_token
    assert model.estimate_mfu(4, 0.5, None) is None
    assert model.estimate_mfu(4, 0.5, 1e12) == pytest.approx(flops_per_token * T * 4 / 0.5 / 1e12)


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


def test_invalid_configs_are_value_errors():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="pos_encoding"):
        GPTConfig(pos_encoding="alibi")
    with pytest.raises(ValueError, match="block_size"):
        GPTConfig(block_size=0)
    for base in (0.0, -1.0, float("nan"), float("inf")):  # a damaged file's numbers: every angle NaN or 0
        with pytest.raises(ValueError, match="rope_base must be a positive number"):
            GPTConfig(rope_base=base)
    for eps in (-1e-5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="norm_eps must be a non-negative number"):
            GPTConfig(norm_eps=eps)
    assert GPTConfig(norm_eps=0.0).norm_eps == 0.0


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_layer": 2.0}, "n_layer must be a whole number, got 2.0"),
        ({"n_embd": True}, "n_embd must be a whole number, got True"),
        ({"mlp_hidden": 128.5}, "mlp_hidden must be a whole number or None, got 128.5"),
        ({"tie_embeddings": "false"}, "tie_embeddings must be true or false, got 'false'"),
        ({"rope_base": "1e4"}, "rope_base must be a number, got '1e4'"),
        ({"rope_scaling": "linear"}, "rope_scaling must be a dict or None"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor must be a positive number"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "factor must be a positive number"),
        ({"rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, "factor must be a positive number"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "factor must be a positive number"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type must be llama3 or linear"),
        ({"n_embd": 2**62, "n_head": 1}, "weights, which no machine holds"),
        ({"vocab_size": 2**40}, "weights, which no machine holds"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192}},
            "high_freq_factor must differ from low_freq_factor",
        ),
    ],
)  # fmt: skip
def test_config_values_of_the_wrong_type_or_no_positive_scaling_are_value_errors(changes, message):
    """A damaged config's values (a float layer count, a string switch, a scaling factor of 0) are refused where the
    model is described, not where arithmetic on them fails."""
    with pytest.raises(ValueError, match=re.escape(message)):
        GPTConfig(pos_encoding="rope", **changes)


def test_fused_adamw_matches_the_plain_path():
    """configure_optimizers' fused AdamW (CPU and CUDA) takes the same steps as torch's plain for-loop AdamW."""
    # bias=False: a key bias gets only rounding noise as gradient (softmax ignores it), which Adam amplifies
    fast, plain = tiny_model(seed=3, bias=False), tiny_model(seed=3, bias=False)
    fused = configure_optimizers(fast, 0.1, 1e-2, (0.9, 0.95), "cpu")
    assert fused.defaults["fused"] is True
    groups = [
        {"params": [p for p in plain.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in plain.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
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
    # One layer: a second adds kernels of its own to compile, and checks nothing the first does not.
    eager = tiny_model(seed=4, pos_encoding="rope", qk_norm=True, n_layer=1)
    compiled_copy = tiny_model(seed=4, pos_encoding="rope", qk_norm=True, n_layer=1)
    compiled = torch.compile(compiled_copy)
    idx = torch.randint(0, 37, (2, 16))
    _, loss_eager = eager(idx, idx)
    _, loss_compiled = compiled(idx, idx)
    assert loss_compiled.item() == pytest.approx(loss_eager.item(), abs=1e-5)
    loss_eager.backward()
    loss_compiled.backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled_copy.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_grown_token_rows_start_at_the_mean_and_stay_tied() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=10))
    old = model.transformer.wte.weight.detach().clone()
    x = torch.tensor([[1, 2, 3]])
    before = model(x, x)[0]
    model.grow_vocabulary(14)
    weight = model.transformer.wte.weight
    assert weight is model.lm_head.weight and weight.shape == (14, 8) and model.config.vocab_size == 14
    torch.testing.assert_close(weight[:10], old)
    for row in range(10, 14):
        torch.testing.assert_close(weight[row], old.double().mean(dim=0).float())
    torch.testing.assert_close(model(x, x)[0][..., :10], before)  # the old tokens' logits are unchanged


def test_the_plain_generate_refuses_what_it_cannot_sample_with():
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = torch.tensor([[1, 2]])
    wrongs = [{"max_new_tokens": -3}, {"max_new_tokens": 2.0}, {"temperature": -1.0}, {"temperature": math.nan}]
    for wrong in [*wrongs, {"top_k": 0}, {"top_k": 1.5}]:
        with pytest.raises(ValueError, match=r"^generate: max_new_tokens="):
            model.generate(idx, **{"max_new_tokens": 2, **wrong})
    assert model.generate(idx, 3, temperature=0).shape == (1, 5)
