"""gptkit/infer/native on every architecture model.py builds (rotary positions with Llama 3's rope scaling,
RMSNorm with and without a weight, SwiGLU, grouped-query attention, QK-norm, a head width of its own, a Q, K, V bias
apart from `bias`, nanochat's embedding norm and soft-capped logits): the native step's, prefill's and several-row
step's logits and cache against model.py's full forward pass (no cache), and the engine's greedy tokens against
model.py's generate, in float32, bfloat16, int8 and int4 (Q4_1's blocks, and Q4_0's: panels without minimums)."""

from __future__ import annotations

import pytest
import torch

from gptkit.infer.engine import Engine, KVCache, Request
from gptkit.infer.native import NativeStep, native_problem
from gptkit.weights.quantization import quantize_int4, quantize_int8
from helpers import (
    as_q4_0,
    count_calls,
    dequantized_model,
    lively_model,
    plain_copy,
    reference_greedy,
    with_16_bit_group_inputs,
    with_16_bit_inputs,
)

LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, original_max_position_embeddings=16, low_freq_factor=1.0, high_freq_factor=4.0
)
LLAMA = dict(
    pos_encoding="rope",
    rope_scaling=LLAMA3_SCALING,
    norm="rmsnorm",
    norm_eps=1e-6,
    activation="swiglu",
    mlp_hidden=48,
    n_head=4,
    n_kv_head=2,
    bias=False,
    tie_embeddings=False,
)
ARCHITECTURES = {
    # make demo's recipe (config/train_shakespeare_char_cpu.py): rotary, LayerNorm, GELU, QK-norm without a weight
    "demo": dict(pos_encoding="rope", qk_norm=True, tie_embeddings=True),
    "llama": LLAMA,
    "qwen2": {**LLAMA, "qkv_bias": True, "rope_base": 1e6, "rope_scaling": None},
    # heads 16 wide whatever n_embd: 4 query heads make 64 values from a 32-wide stream
    "qwen3": {**LLAMA, "qk_norm": True, "qk_norm_weight": True, "head_dim": 16, "rope_scaling": None},
    "smollm2": {**LLAMA, "n_embd": 48, "n_head": 6, "n_kv_head": 2, "tie_embeddings": True},
    "nanochat": dict(
        pos_encoding="rope",
        norm="rmsnorm",
        norm_weight=False,
        activation="relu2",
        qk_norm=True,
        embed_norm=True,
        logit_softcap=15.0,
        bias=False,
        n_head=4,
    ),
}
VOCAB = 61


def architecture_model(name: str, block_size: int = 32, seed: int = 3, vocab_size: int = VOCAB):
    """A tiny model of architecture `name` with lively weights, and norm weights and biases away from 1 and 0 (so
    that a weight or bias read from the wrong place, or a gate taken for the up half, changes the numbers)."""
    model = lively_model(vocab_size=vocab_size, block_size=block_size, seed=seed, **ARCHITECTURES[name])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                noise = 0.3 * torch.randn(parameter.shape, generator=generator)
                parameter.copy_(noise + (1.0 if parameter_name.endswith("weight") else 0.0))
    return model


def allocated_cache(model, dtype: torch.dtype, slots: int = 1) -> KVCache:
    config = model.config
    cache = KVCache(config.n_layer, config.block_size, slots=slots)
    cache.allocate(config.n_kv_head, config.head_dim, dtype, torch.device("cpu"))
    return cache


def full_pass_logits(model, tokens: list[int]) -> torch.Tensor:
    """The last position's logits by model.py's forward pass over all of `tokens` (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0][0, -1].float()


def within(actual: torch.Tensor, expected: torch.Tensor, tolerance: float | None) -> None:
    """actual is expected to float32 rounding (tolerance None), else within tolerance times expected's largest."""
    if tolerance is None:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    else:
        assert (actual - expected).abs().max() <= tolerance * expected.abs().max()


# int4 against the eager pass of the same int4 model with 16-bit group inputs: inputs the two passes round to
# neighbouring steps (tests/infer/test_native.py)
INT4_TOLERANCE = 5e-4


def weights_and_reference(name: str, weights: str, **shape):
    """The model the native step runs with `weights` (float32, bfloat16, int8, int4 or q4_0), its compute dtype, and
    the float32 model that gives its expected logits, with the tolerance: the same model (float32 rounding); the float32
    pass over the same bfloat16 weights (bfloat16 rounding); the dequantized weights with each product's input
    rounded to 16 bits as the int8 products round it; the same int4 model's eager pass with each product's input
    rounded to 16 bits per group of 32 values as the int4 products round it (q4_0: int4 with Q4_0's blocks)."""
    original = architecture_model(name, **shape)
    if weights == "float32":
        return original, torch.float32, plain_copy(original), None
    if weights == "bfloat16":  # 5%: eager's own bfloat16 pass strays up to 2.4% from it here after one step
        model = original.to(torch.bfloat16)
        return model, torch.bfloat16, plain_copy(model).float(), 0.05
    if weights in ("int4", "q4_0"):
        model = quantize_int4(plain_copy(original))
        model = as_q4_0(model) if weights == "q4_0" else model
        return model, torch.float32, with_16_bit_group_inputs(model), INT4_TOLERANCE
    model = quantize_int8(plain_copy(original))
    return model, torch.float32, with_16_bit_inputs(dequantized_model(model, original)), 1e-3


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_architecture_is_served(name):
    assert native_problem(architecture_model(name), torch.float32) is None


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "q4_0"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_prefill_of_two_rows_stores_each_rows_eager_keys_and_values(name, weights):
    """Two rows of 9 tokens in one native prefill: cache row r holds the keys and values (kv heads only, normalized
    and rotated) the eager pass over both rows stores in its row r."""
    model, dtype, reference, tolerance = weights_and_reference(name, weights)
    tokens = [prompt_of(9, seed=5), prompt_of(9, seed=6)]
    cache = allocated_cache(model, dtype, slots=2)
    NativeStep.for_model(model, dtype).prefill(tokens, 0, cache.keys, cache.values)
    eager = KVCache(model.config.n_layer, model.config.block_size, slots=2)
    with torch.no_grad():
        reference.hidden_states(torch.tensor(tokens), cache=eager)
    for layer in range(model.config.n_layer):
        within(cache.keys[layer][:, :, :9].float(), eager.keys[layer][:, :, :9], tolerance)
        within(cache.values[layer][:, :, :9].float(), eager.values[layer][:, :, :9], tolerance)


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "q4_0"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prefill_and_steps_give_the_full_passs_logits_and_the_eager_cache(name, weights):
    """The native prefill of 11 tokens, then of 6 more from position 11, stores the keys and values (kv heads only,
    normalized and rotated) the eager pass over the 17 tokens stores; the greedy steps after it get the full pass's
    logits (soft-capped where the model caps them)."""
    model, dtype, reference, tolerance = weights_and_reference(name, weights)
    tokens = prompt_of(18, seed=4)
    cache = allocated_cache(model, dtype)
    step = NativeStep.for_model(model, dtype)
    step.prefill([tokens[:11]], 0, cache.keys, cache.values)
    step.prefill([tokens[11:17]], 11, cache.keys, cache.values)
    eager = KVCache(model.config.n_layer, model.config.block_size)
    with torch.no_grad():
        reference.hidden_states(torch.tensor([tokens[:17]]), cache=eager)
    for layer in range(model.config.n_layer):
        within(cache.keys[layer][:, :, :17].float(), eager.keys[layer][:, :, :17], tolerance)
        within(cache.values[layer][:, :, :17].float(), eager.values[layer][:, :, :17], tolerance)
    token = tokens[17]
    for position in range(17, 23):
        logits, token = step(token, position, cache.keys, cache.values)
        expected = full_pass_logits(reference, tokens)
        within(logits, expected, tolerance)
        if model.config.logit_softcap is not None:
            assert logits.abs().max() < model.config.logit_softcap
        tokens.append(token if weights == "bfloat16" else int(expected.argmax()))


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "q4_0"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_step_of_several_rows_gives_each_row_the_full_passs_logits(name, weights):
    """9 rows of 1 to 14 tokens (filled by the native prefill, row by row) in one native call a step: each row's
    logits are the full pass's over its own tokens so far, whatever the other rows hold."""
    model, dtype, reference, tolerance = weights_and_reference(name, weights)
    prompts = [prompt_of(length, seed=length) for length in (7, 1, 12, 3, 9, 5, 14, 2, 6)]
    cache = allocated_cache(model, dtype, slots=len(prompts) + 1)
    step = NativeStep.for_model(model, dtype)
    for row, prompt in enumerate(prompts):
        if len(prompt) > 1:
            keys, values = ([layer[row : row + 1] for layer in storage] for storage in (cache.keys, cache.values))
            step.prefill([prompt[:-1]], 0, keys, values)
            cache.lengths[row] = len(prompt) - 1
    tokens = [list(prompt) for prompt in prompts]
    for _ in range(4):
        logits, chosen = step.step_rows(
            [t[-1] for t in tokens], cache.lengths[: len(prompts)], cache.keys, cache.values
        )
        for row in range(len(prompts)):
            expected = full_pass_logits(reference, tokens[row])
            within(logits[row], expected, tolerance)
            tokens[row].append(chosen[row] if weights == "bfloat16" else int(expected.argmax()))
            cache.lengths[row] += 1


@pytest.mark.parametrize("weights", ["float32", "int8", "int4", "q4_0"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_engine_gives_each_request_the_greedy_tokens_of_generate(monkeypatch, name, weights):
    """Alone in the engine (native prefill and steps, block 40: the longest prompt's window slides and is filled
    again), then ten requests through 4 slots as the server runs them (rows of different lengths joining as others
    finish): every request gets exactly the greedy tokens of model.py's generate (int8: over the weights it stands
    for, with 16-bit inputs; int4 and q4_0: of the int4 model with 16-bit group inputs)."""
    model, _, reference, _ = weights_and_reference(name, weights, block_size=40)
    for length in (1, 9, 30):
        prompt = prompt_of(length, seed=length)
        request = Request(prompt=prompt, max_new_tokens=20, temperature=0)
        list(Engine(model, decode="native").run([request]))
        assert request.output == reference_greedy(reference, prompt, 20)
    prompts = [prompt_of(length, seed=length) for length in (1, 9, 20, 4, 13, 2, 7, 16, 5, 3)]
    budgets = (24, 5, 12, 20, 3, 18, 9, 22, 14, 6)
    requests = [
        Request(prompt=prompt, max_new_tokens=budget, temperature=0) for prompt, budget in zip(prompts, budgets)
    ]
    row_steps = count_calls(monkeypatch, NativeStep, "step_rows")
    list(Engine(model, slots=4, decode="native").run(requests))
    assert len(row_steps) > 10
    for prompt, request in zip(prompts, requests):
        assert request.output == reference_greedy(reference, prompt, len(request.output))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_threads_sharing_key_and_value_heads_give_the_reference_tokens(monkeypatch, name, threads):
    """Grouped-query attention (6 query heads over 2 key and value heads; Qwen3's 4 over 2, its Q rows twice n_embd):
    with 3 threads the fused product's rows are split evenly and each thread's query heads read key and value heads
    other threads wrote; one thread does it all. One row (native prefill, then one call a step), then three rows of
    different lengths a step: every request gets the reference greedy tokens."""
    model = architecture_model(name, block_size=24)
    reference = plain_copy(model)
    steps = count_calls(monkeypatch, NativeStep, "__call__")
    row_steps = count_calls(monkeypatch, NativeStep, "step_rows")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        request = Request(prompt=[5, 3, 9], max_new_tokens=25, temperature=0)
        list(Engine(model, decode="native").run([request]))
        requests = [
            Request(prompt=prompt_of(length, seed=length), max_new_tokens=12, temperature=0) for length in (2, 7, 11)
        ]
        list(Engine(model, slots=3, decode="native").run(requests))
    finally:
        torch.set_num_threads(before)
    assert request.output == reference_greedy(reference, [5, 3, 9], 25)
    for each in requests:
        assert each.output == reference_greedy(reference, each.prompt, 12)
    assert len(steps) >= 24 and len(row_steps) >= 11


def test_qk_norm_without_an_epsilon_takes_float32s_in_bfloat16_too():
    """make demo's QK-norm has no epsilon of its own: torch's RMSNorm then adds float32's machine epsilon, to bfloat16
    queries and keys too. With queries and keys of magnitude ~1e-3 (mean square ~1e-6, where bfloat16's epsilon, 2^-7,
    would flatten every head's scores) the bfloat16 step's logits stay within bfloat16 rounding of the float32 pass."""
    model = architecture_model("demo")
    queries_and_keys = slice(0, 2 * model.config.n_embd)  # the fused product's Q and K rows, not V's
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[queries_and_keys] *= 1e-3
            block.attn.c_attn.bias[queries_and_keys] *= 1e-3
    model = model.to(torch.bfloat16)
    reference = plain_copy(model).float()
    tokens = prompt_of(12, seed=8)
    cache = allocated_cache(model, torch.bfloat16)
    step = NativeStep.for_model(model, torch.bfloat16)
    step.prefill([tokens[:-1]], 0, cache.keys, cache.values)
    logits, _ = step(tokens[-1], len(tokens) - 1, cache.keys, cache.values)
    within(logits, full_pass_logits(reference, tokens), 0.05)
