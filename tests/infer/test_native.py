"""gptkit/infer/native (its step, packing and C++): the native step's logits, cache writes, tokens and refusals,
against the plain model's full forward pass (no cache) and the eager engine; int8 weights against the float32 pass of
the weights they stand for (each int8 value times its row's scale), with each product's input rounded to 16 bits as
the native int8 products round it; int4 weights against the eager pass of the same int4 model with each product's
input rounded to 16 bits per group of 32 values as the native int4 products round it.

The first test builds the C++ extension (once; torch caches the build)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from torch.utils.file_baton import FileBaton  # torch's build lock

from gptkit.core.errors import UserError
from gptkit.infer import native as native_decoding
from gptkit.infer.engine import Engine, KVCache, Request
from gptkit.infer.native import NativeStep, huge_page_zeros
from gptkit.infer.native import build as native_build
from gptkit.infer.native import step as native_step
from gptkit.infer.native.packing import int4_panel_bytes, int4_panels, int8_panel_bytes, layer_tensors
from gptkit.weights.quantization import Int4Linear, Int8GroupedLinear, Int8Linear, quantize_int4, quantize_int8
from helpers import (
    as_q4_0,
    as_q8_0,
    assert_one_line_message,
    count_calls,
    dequantized_model,
    lively_model,
    plain_copy,
    reference_greedy,
    with_16_bit_group_inputs,
    with_16_bit_inputs,
    with_q8_0_head,
)

# int8 steps and prefills against a reference that rounds each product's input to 16 bits as they do: where the two
# passes' float32 rounding puts a value on either side of a rounding boundary, that input differs by one step
# (2^-15 of its row's largest) and an output by up to ~1e-4 of the largest; 1e-3 of it leaves room for a few.
INT8_TOLERANCE = 1e-3
# int4 steps and prefills against the eager pass of the same int4 model with its inputs rounded as theirs are (per group
# of 32 values, in steps of 2^-15 of the group's largest): the first layer's products agree to float32 rounding; after
# it, as for int8, a value the two passes' float32 rounding puts on either side of a rounding boundary differs by one
# step, and the lively models' layers carry that to up to ~1.5e-4 of the logits' largest (every architecture, in
# tests/infer/test_native_architectures.py; ~1e-4 here): 5e-4 leaves room for a few more.
INT4_TOLERANCE = 5e-4

NO_BIASES = dict(bias=False, activation="gelu", pos_encoding="sinusoidal", tie_embeddings=True)
SHAPES = {
    "gpt2": {},
    "no biases, exact gelu, sinusoidal, tied": NO_BIASES,
    "squared relu, 3 layers, 4 heads": dict(activation="relu2", n_layer=3, n_head=4, n_embd=48),
    "36 wide: float32 rows one after another": dict(n_embd=36, n_head=4),  # not whole chunks of 8 or 16 values
    "40 wide: an odd number of chunks": dict(n_embd=40, n_head=4),  # 5 of 8 values (AVX2); 48 wide: 3 of 16
}


def native_steps(model, dtype: torch.dtype, prompt: list[int], steps: int, prefill_model=None):
    """Logits of `steps` greedy native steps after the eager model (or prefill_model) fills the cache with
    prompt[:-1], and the cache."""
    cache = KVCache(model.config.n_layer, model.config.block_size)
    cache.allocate(model.config.n_head, model.config.n_embd // model.config.n_head, dtype, torch.device("cpu"))
    with torch.no_grad():
        (prefill_model or model).hidden_states(torch.tensor([prompt[:-1]]), cache=cache)
    step, token, all_logits = NativeStep.for_model(model, dtype), prompt[-1], []
    for _ in range(steps):
        logits, token = step(token, cache.lengths[0], cache.keys, cache.values)
        cache.lengths[0] += 1
        all_logits.append(logits)
    return all_logits, cache


def full_pass_logits(model, tokens: list[int]) -> torch.Tensor:
    """The last position's logits by the plain model's forward pass over all of `tokens` (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0][0, -1].float()


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, tolerance: float | None, atol: float = 1e-5) -> None:
    """actual is expected up to float32 rounding (tolerance None: rtol 1e-4 and `atol`), or within tolerance times
    expected's largest magnitude."""
    if tolerance is None:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=atol)
    else:
        assert (actual - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_float32_logits_and_cache_match_the_full_forward_pass(shape):
    """Each step's logits are the full pass's over the prompt and the greedy tokens so far (float32 rounding), and
    the cache holds the keys and values an eager pass writes."""
    model = lively_model(vocab_size=61, block_size=32, seed=3, **SHAPES[shape])
    prompt = torch.randint(0, 61, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    logits, cache = native_steps(model, torch.float32, prompt, 10)
    tokens = list(prompt)
    for step_logits in logits:
        expected = full_pass_logits(model, tokens)
        torch.testing.assert_close(step_logits, expected, rtol=1e-4, atol=1e-4)
        tokens.append(int(expected.argmax()))
    eager = KVCache(model.config.n_layer, model.config.block_size)
    with torch.no_grad():
        model.hidden_states(torch.tensor([tokens[:-1]]), cache=eager)
    length = len(tokens) - 1
    for layer in range(model.config.n_layer):
        torch.testing.assert_close(cache.keys[layer][:, :, :length], eager.keys[layer][:, :, :length])
        torch.testing.assert_close(cache.values[layer][:, :, :length], eager.values[layer][:, :, :length])


@pytest.mark.parametrize("width", [32, 768])
def test_bfloat16_logits_are_the_float32_pass_of_the_same_weights_within_bfloat16_rounding(width):
    """bfloat16 weights: the step's logits stay within bfloat16 rounding of a float32 pass over the same (rounded)
    weights, at a small width and at GPT-2's (768: its rows are 24 vectors of 32 bfloat16 values)."""
    shape = dict(n_embd=width, n_head=width // 16, n_layer=1) if width == 768 else {}
    model = lively_model(vocab_size=61, block_size=32, seed=4, **shape).to(torch.bfloat16)
    reference = plain_copy(model).float()
    prompt = torch.randint(0, 61, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    logits, _ = native_steps(model, torch.bfloat16, prompt, 6)
    tokens = list(prompt)
    for step_logits in logits:
        expected = full_pass_logits(reference, tokens)
        scale = expected.abs().max()
        assert (step_logits - expected).abs().max() <= 0.03 * scale
        tokens.append(int(step_logits.argmax()))


@pytest.mark.parametrize("shape", [*SHAPES, "gpt2 width"])
def test_int8_logits_match_the_float32_pass_of_the_weights_they_stand_for(shape):
    """int8 weights (--quantize=int8): each step's logits are the full float32 pass's over the dequantized weights
    with each product's input rounded to 16 bits (within INT8_TOLERANCE), tied heads included; at GPT-2's width too
    (768: rows of 12 blocks of 64 weights, where the small widths take the kernel's tail loop). That reference fills
    the cache (the eager int8 prefill rounds its activations to 7 bits, gptkit.weights.quantization)."""
    overrides = dict(n_embd=768, n_head=12, n_layer=1) if shape == "gpt2 width" else SHAPES[shape]
    original = lively_model(vocab_size=61, block_size=32, seed=6, **overrides)
    model = quantize_int8(plain_copy(original))
    reference = with_16_bit_inputs(dequantized_model(model, original))
    prompt = torch.randint(0, 61, (8,), generator=torch.Generator().manual_seed(2)).tolist()
    logits, _ = native_steps(model, torch.float32, prompt, 6, prefill_model=reference)
    tokens = list(prompt)
    for step_logits in logits:
        expected = full_pass_logits(reference, tokens)
        assert_close_to(step_logits, expected, INT8_TOLERANCE)
        tokens.append(int(expected.argmax()))


@pytest.mark.parametrize("shape", [*SHAPES, "gpt2 width"])
def test_int4_logits_match_the_eager_pass_of_the_same_model(shape):
    """int4 weights (--quantize=int4): each step's logits are the eager pass's of the same Int4Linear model with 16-bit
    group inputs (within INT4_TOLERANCE), tied heads included; rows of 36 and 40 values end in a group of 4 or 8; at
    GPT-2's width too (768: 24 whole groups). That reference fills the cache."""
    overrides = dict(n_embd=768, n_head=12, n_layer=1) if shape == "gpt2 width" else SHAPES[shape]
    model = quantize_int4(lively_model(vocab_size=61, block_size=32, seed=6, **overrides))
    reference = with_16_bit_group_inputs(model)
    prompt = torch.randint(0, 61, (8,), generator=torch.Generator().manual_seed(2)).tolist()
    logits, _ = native_steps(model, torch.float32, prompt, 6, prefill_model=reference)
    tokens = list(prompt)
    for step_logits in logits:
        expected = full_pass_logits(reference, tokens)
        assert_close_to(step_logits, expected, INT4_TOLERANCE)
        tokens.append(int(expected.argmax()))


def test_an_int8_model_in_the_engine_gets_the_reference_greedy_tokens(monkeypatch):
    """An int8 model alone in the engine: the greedy tokens of the float32 model with the dequantized weights and
    16-bit inputs, over a prompt of 9 tokens and a window that slides (block 16: it keeps 12). The native prefill
    fills the cache each time, with 16-bit inputs (the eager int8 pass would round them to 7 bits)."""
    original = lively_model(block_size=16, seed=8)
    model = quantize_int8(plain_copy(original))
    prompt = [4, 9, 1, 30, 2, 2, 17, 5, 11]
    request = Request(prompt=prompt, max_new_tokens=23, temperature=0)
    engine = Engine(model, decode="native")
    assert engine.backend.name == "native"
    assert engine.backend.step.weights == "int8" and engine.backend.step.dtype == torch.float32
    prefills = count_calls(monkeypatch, NativeStep, "prefill")
    list(engine.run([request]))
    assert request.output == reference_greedy(with_16_bit_inputs(dequantized_model(model, original)), prompt, 23)
    assert len(prefills) == 4  # the prompt (8 tokens filled), then 11 of the 12 kept before outputs 9, 14 and 19


def test_requests_admitted_together_fill_their_prompts_in_one_prefill(monkeypatch):
    """Three requests that fit at once, two prompts of 9 tokens and one of 5: the two are filled in one native
    prefill, the third in one of its own; every request gets its reference greedy tokens."""
    model = lively_model(block_size=40)
    lengths_and_seeds = [(9, 0), (5, 1), (9, 2)]
    prompts = [
        torch.randint(0, 37, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        for n, seed in lengths_and_seeds
    ]
    calls = count_calls(monkeypatch, NativeStep, "prefill")
    requests = [Request(prompt=prompt, max_new_tokens=6, temperature=0) for prompt in prompts]
    list(Engine(model, slots=3, decode="native").run(requests))
    assert len(calls) == 2
    for request, prompt in zip(requests, prompts):
        assert request.output == reference_greedy(plain_copy(model), prompt, 6)


@pytest.mark.parametrize(("past_limit", "prefills"), [(1, 1), (2, 0)])
def test_a_float32_prompt_past_the_prefill_limit_is_filled_eagerly(monkeypatch, past_limit, prefills):
    """The engine fills a float32 prompt of up to the step's prefill_limit tokens (the last is fed by the first step)
    with the native prefill and a longer one with the eager pass; the greedy tokens are the reference's either way."""
    limit = NativeStep.for_model(lively_model(), torch.float32).prefill_limit
    model = lively_model(block_size=limit + 8)
    prompt = torch.randint(0, 37, (limit + past_limit,), generator=torch.Generator().manual_seed(3)).tolist()
    calls = count_calls(monkeypatch, NativeStep, "prefill")
    request = Request(prompt=prompt, max_new_tokens=5, temperature=0)
    list(Engine(model, decode="native").run([request]))
    assert request.output == reference_greedy(plain_copy(model), prompt, 5)
    assert len(calls) == prefills


def assert_prefill_matches_eager_pass(model, reference, tokens: list[int], tolerance: float | None = None) -> None:
    """model's native prefill of tokens[:11], then of tokens[11:17] from position 11, stores the keys and values the
    eager pass of `reference` over tokens[:17] stores (assert_close_to); the step after it gets the full pass's
    logits."""
    config = model.config
    cache = KVCache(config.n_layer, config.block_size)
    cache.allocate(config.n_head, config.n_embd // config.n_head, torch.float32, torch.device("cpu"))
    step = NativeStep.for_model(model, torch.float32)
    step.prefill([tokens[:11]], 0, cache.keys, cache.values)
    step.prefill([tokens[11:17]], 11, cache.keys, cache.values)
    eager = KVCache(config.n_layer, config.block_size)
    with torch.no_grad():
        reference.hidden_states(torch.tensor([tokens[:17]]), cache=eager)
    for layer in range(config.n_layer):
        assert_close_to(cache.keys[layer][:, :, :17], eager.keys[layer][:, :, :17], tolerance)
        assert_close_to(cache.values[layer][:, :, :17], eager.values[layer][:, :, :17], tolerance)
    logits, _ = step(tokens[17], 17, cache.keys, cache.values)
    assert_close_to(logits, full_pass_logits(reference, tokens), tolerance, atol=1e-4)


@pytest.mark.parametrize("shape", [*SHAPES, "gpt2 width"])
def test_the_prefill_writes_the_keys_and_values_of_the_eager_pass(shape):
    """The native prefill (the tokens in one pass: 4 at a time over 2 weight rows, or 2 at a time over a block of
    float32 rows) stores the keys and values an eager pass over the same tokens stores, also when it goes on from a
    filled position. 11 and 6 tokens: neither a whole number of 4-token blocks."""
    overrides = dict(n_embd=768, n_head=12, n_layer=1) if shape == "gpt2 width" else SHAPES[shape]
    model = lively_model(vocab_size=61, block_size=32, seed=5, **overrides)
    tokens = torch.randint(0, 61, (18,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_prefill_matches_eager_pass(model, plain_copy(model), tokens)


@pytest.mark.parametrize("shape", [*SHAPES, "gpt2 width"])
def test_a_prefill_of_several_rows_writes_each_rows_keys_and_values_of_the_eager_pass(shape):
    """Three rows in one prefill (7 tokens each, then 4 more each from position 7): cache row r holds the keys and
    values the eager pass over the three rows stores in its row r, each row attending over its own tokens only."""
    overrides = dict(n_embd=768, n_head=12, n_layer=1) if shape == "gpt2 width" else SHAPES[shape]
    model = lively_model(vocab_size=61, block_size=32, seed=5, **overrides)
    tokens = torch.randint(0, 61, (3, 11), generator=torch.Generator().manual_seed(8))
    config = model.config
    cache = KVCache(config.n_layer, config.block_size, slots=3)
    cache.allocate(config.n_kv_head, config.head_dim, torch.float32, torch.device("cpu"))
    step = NativeStep.for_model(model, torch.float32)
    step.prefill(tokens[:, :7].tolist(), 0, cache.keys, cache.values)
    step.prefill(tokens[:, 7:].tolist(), 7, cache.keys, cache.values)
    eager = KVCache(config.n_layer, config.block_size, slots=3)
    with torch.no_grad():
        plain_copy(model).hidden_states(tokens, cache=eager)
    for layer in range(config.n_layer):
        assert_close_to(cache.keys[layer][:, :, :11], eager.keys[layer][:, :, :11], None)
        assert_close_to(cache.values[layer][:, :, :11], eager.values[layer][:, :, :11], None)


@pytest.mark.parametrize("overrides", [{}, dict(n_embd=40, n_head=4)], ids=["32 wide", "40 wide"])
def test_an_int8_prefill_writes_the_keys_and_values_of_its_reference(overrides):
    """int8 weights: the native prefill's integer products (2 rows and 4 tokens at a time, 16 weights a turn) store
    the keys and values of the eager float32 pass over the dequantized weights with 16-bit inputs, within
    INT8_TOLERANCE; 40 wide, the values past the last whole 16 count too."""
    original = lively_model(vocab_size=61, block_size=32, seed=9, **overrides)
    model = quantize_int8(plain_copy(original))
    tokens = torch.randint(0, 61, (18,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = with_16_bit_inputs(dequantized_model(model, original))
    assert_prefill_matches_eager_pass(model, reference, tokens, INT8_TOLERANCE)


@pytest.mark.parametrize("shape", ["gpt2", "36 wide: float32 rows one after another", "gpt2 width"])
def test_an_int4_prefill_writes_the_keys_and_values_of_the_eager_pass(shape):
    """int4 weights: the native prefill (one row of 11 tokens, then 6 more from position 11; then three rows of 7
    tokens, 21 inputs a product: more than one pass over each panel) stores the keys and values of the eager pass of
    the same int4 model with 16-bit group inputs, within INT4_TOLERANCE; the step after it gets that pass's logits."""
    overrides = dict(n_embd=768, n_head=12, n_layer=1) if shape == "gpt2 width" else SHAPES[shape]
    model = quantize_int4(lively_model(vocab_size=61, block_size=32, seed=9, **overrides))
    reference = with_16_bit_group_inputs(model)
    tokens = torch.randint(0, 61, (18,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_prefill_matches_eager_pass(model, reference, tokens, INT4_TOLERANCE)
    rows = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(8))
    config = model.config
    cache = KVCache(config.n_layer, config.block_size, slots=3)
    cache.allocate(config.n_kv_head, config.head_dim, torch.float32, torch.device("cpu"))
    NativeStep.for_model(model, torch.float32).prefill(rows.tolist(), 0, cache.keys, cache.values)
    eager = KVCache(config.n_layer, config.block_size, slots=3)
    with torch.no_grad():
        reference.hidden_states(rows, cache=eager)
    for layer in range(config.n_layer):
        assert_close_to(cache.keys[layer][:, :, :7], eager.keys[layer][:, :, :7], INT4_TOLERANCE)
        assert_close_to(cache.values[layer][:, :, :7], eager.values[layer][:, :, :7], INT4_TOLERANCE)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_bfloat16_or_int8_prefill_gives_the_steps_their_reference_logits(dtype):
    """bfloat16 and int8 weights, at GPT-2's width: after a native prefill of 13 tokens, the steps' logits stay within
    bfloat16 rounding of the float32 pass over the same bfloat16 weights, or match the float32 pass over the
    weights int8 stands for with 16-bit inputs (the prefill's int8 products round their inputs as the step's)."""
    original = lively_model(vocab_size=61, block_size=32, seed=7, n_embd=768, n_head=12, n_layer=1)
    if dtype == "bfloat16":
        model, compute = original.to(torch.bfloat16), torch.bfloat16
        reference, tolerance = plain_copy(model).float(), 0.03
    else:
        model, compute = quantize_int8(plain_copy(original)), torch.float32
        reference, tolerance = with_16_bit_inputs(dequantized_model(model, original)), INT8_TOLERANCE
    tokens = torch.randint(0, 61, (14,), generator=torch.Generator().manual_seed(6)).tolist()
    cache = KVCache(1, 32)
    cache.allocate(12, 64, compute, torch.device("cpu"))
    step = NativeStep.for_model(model, compute)
    step.prefill([tokens[:13]], 0, cache.keys, cache.values)
    token = tokens[13]
    for position in range(13, 18):
        logits, token = step(token, position, cache.keys, cache.values)
        expected = full_pass_logits(reference, tokens)
        assert (logits - expected).abs().max() <= tolerance * expected.abs().max()
        tokens.append(token)


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
def test_the_engine_gives_each_request_its_reference_greedy_tokens(pos_encoding):
    """Prompts of 1, 9 and 26 tokens (the first with no prefill), block 40, 30 new tokens: the longest slides its
    window. Alone in the engine, each request gets exactly its reference greedy tokens."""
    model = lively_model(block_size=40, pos_encoding=pos_encoding)
    reference = plain_copy(model)
    for length in (1, 9, 26):
        prompt = torch.randint(0, 37, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        request = Request(prompt=prompt, max_new_tokens=30, temperature=0)
        list(Engine(model, decode="native").run([request]))
        assert request.output == reference_greedy(reference, prompt, 30)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 5, None), (0.7, None, None), (1.0, 40, None), (1.0, 5, 0.8)]
)
def test_seeded_sampling_draws_the_eager_engines_tokens(temperature, top_k, top_p):
    """The step samples inside the C++ call (top-k, or the whole vocabulary at top_k >= vocab) with the uniform
    number the eager engine would draw; with top-p the engine samples the step's logits itself. Same seed, same
    tokens as the eager engine, over a window that slides."""
    model = lively_model(block_size=24)
    outputs = {}
    for native in (True, False):
        request = Request(
            prompt=[3, 1, 4, 1, 5], max_new_tokens=40, temperature=temperature, top_k=top_k, top_p=top_p, seed=11
        )
        list(Engine(model if native else plain_copy(model), decode="native" if native else "eager").run([request]))
        outputs[native] = request.output
    assert outputs[True] == outputs[False]
    assert len(set(outputs[True])) > 5  # sampled, not one repeated token


def rows_native_steps(model, dtype: torch.dtype, prompts: list[list[int]], steps: int, prefill_model=None):
    """Logits (rows, vocab) of `steps` greedy steps of several rows in one native call each, after the eager model
    (or prefill_model) fills row r of the cache with prompts[r][:-1] (rows of different lengths)."""
    config = model.config
    cache = KVCache(config.n_layer, config.block_size, slots=len(prompts) + 1)  # a row more than the step's
    cache.allocate(config.n_head, config.n_embd // config.n_head, dtype, torch.device("cpu"))
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            if len(prompt) > 1:
                (prefill_model or model).hidden_states(torch.tensor([prompt[:-1]]), cache=cache.rows(row, row + 1))
    step, tokens, all_logits = NativeStep.for_model(model, dtype), [prompt[-1] for prompt in prompts], []
    for _ in range(steps):
        logits, tokens = step.step_rows(tokens, cache.lengths[: len(prompts)], cache.keys, cache.values)
        cache.lengths[: len(prompts)] = [length + 1 for length in cache.lengths[: len(prompts)]]
        all_logits.append(logits)
    return all_logits


# Rows of 1 to 14 tokens: 9 rows take the 4-row (and 2-row) blocks of the products and one left over.
ROW_PROMPT_LENGTHS = (7, 1, 12, 3, 9, 5, 14, 2, 6)


def row_prompts(vocab: int, lengths=ROW_PROMPT_LENGTHS) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_step_of_several_rows_gives_each_row_the_full_passs_logits(shape):
    """9 rows of different lengths in one native call per step: each row's logits are the full pass's over its own
    prompt and greedy tokens so far (float32 rounding), whatever the other rows hold."""
    model = lively_model(vocab_size=61, block_size=32, seed=3, **SHAPES[shape])
    prompts = row_prompts(61)
    logits = rows_native_steps(model, torch.float32, prompts, 6)
    for row, prompt in enumerate(prompts):
        tokens = list(prompt)
        for step_logits in logits:
            expected = full_pass_logits(model, tokens)
            torch.testing.assert_close(step_logits[row], expected, rtol=1e-4, atol=1e-4)
            tokens.append(int(expected.argmax()))


@pytest.mark.parametrize("width", [32, 768])
def test_a_bfloat16_step_of_several_rows_stays_within_bfloat16_rounding(width):
    """bfloat16 weights, 5 rows of different lengths a step: each row's logits within bfloat16 rounding of a
    float32 pass over the same weights, at a small width and at GPT-2's."""
    shape = dict(n_embd=width, n_head=width // 16, n_layer=1) if width == 768 else {}
    model = lively_model(vocab_size=61, block_size=32, seed=4, **shape).to(torch.bfloat16)
    reference = plain_copy(model).float()
    prompts = row_prompts(61, (9, 2, 5, 1, 11))
    logits = rows_native_steps(model, torch.bfloat16, prompts, 4)
    for row, prompt in enumerate(prompts):
        tokens = list(prompt)
        for step_logits in logits:
            expected = full_pass_logits(reference, tokens)
            assert (step_logits[row] - expected).abs().max() <= 0.03 * expected.abs().max()
            tokens.append(int(step_logits[row].argmax()))


@pytest.mark.parametrize("shape", ["gpt2", "36 wide: float32 rows one after another", "gpt2 width"])
def test_an_int8_step_of_several_rows_matches_the_float32_pass_of_its_weights(shape):
    """int8 weights, 9 rows of different lengths a step: each row's logits are the float32 pass's over the
    dequantized weights with 16-bit inputs (within INT8_TOLERANCE), each row's input rounded with its own scale."""
    overrides = dict(n_embd=768, n_head=12, n_layer=1) if shape == "gpt2 width" else SHAPES[shape]
    original = lively_model(vocab_size=61, block_size=32, seed=6, **overrides)
    model = quantize_int8(plain_copy(original))
    reference = with_16_bit_inputs(dequantized_model(model, original))
    prompts = row_prompts(61)
    logits = rows_native_steps(model, torch.float32, prompts, 4, prefill_model=reference)
    for row, prompt in enumerate(prompts):
        tokens = list(prompt)
        for step_logits in logits:
            expected = full_pass_logits(reference, tokens)
            assert_close_to(step_logits[row], expected, INT8_TOLERANCE)
            tokens.append(int(expected.argmax()))


@pytest.mark.parametrize("shape", ["gpt2", "36 wide: float32 rows one after another", "gpt2 width"])
def test_an_int4_step_of_several_rows_matches_the_eager_pass_of_the_same_model(shape):
    """int4 weights, 9 rows of different lengths a step (with AVX2, more than one pass over each panel): each row's
    logits are the eager pass's of the same int4 model with 16-bit group inputs over its own tokens (within
    INT4_TOLERANCE), each row's groups rounded with their own scales. The tokens are the step's own choices: at one
    step of the 32-wide model two logits lie 2e-6 of the largest apart, where float32 rounding picks either."""
    overrides = dict(n_embd=768, n_head=12, n_layer=1) if shape == "gpt2 width" else SHAPES[shape]
    model = quantize_int4(lively_model(vocab_size=61, block_size=32, seed=6, **overrides))
    reference = with_16_bit_group_inputs(model)
    prompts = row_prompts(61)
    logits = rows_native_steps(model, torch.float32, prompts, 4, prefill_model=reference)
    for row, prompt in enumerate(prompts):
        tokens = list(prompt)
        for step_logits in logits:
            expected = full_pass_logits(reference, tokens)
            assert_close_to(step_logits[row], expected, INT4_TOLERANCE)
            tokens.append(int(step_logits[row].argmax()))


@pytest.mark.parametrize(
    "shape", ["gpt2", "no biases, exact gelu, sinusoidal, tied", "36 wide: float32 rows one after another"]
)
def test_requests_joining_and_leaving_get_their_reference_greedy_tokens(monkeypatch, shape):
    """Ten requests through 6 slots as the server runs them: rows of different lengths join as others finish
    (a stop token or their budget), and windows slide (block 24). Every step of several rows is one native call,
    and each request gets exactly its reference greedy tokens."""
    model = lively_model(block_size=24, **SHAPES[shape])
    reference = plain_copy(model)
    row_steps = count_calls(monkeypatch, NativeStep, "step_rows")
    prompts = row_prompts(37, (1, 9, 20, 4, 13, 2, 7, 16, 5, 3))
    budgets = (30, 5, 12, 26, 3, 18, 9, 22, 14, 6)
    stop_tokens = {row: (reference_greedy(reference, prompts[row], 4)[-1],) for row in (3, 7)}  # stop early
    requests = [
        Request(prompt=prompt, max_new_tokens=budget, temperature=0, stop_tokens=stop_tokens.get(row, ()))
        for row, (prompt, budget) in enumerate(zip(prompts, budgets))
    ]
    engine = Engine(model, slots=6, decode="native")
    list(engine.run(requests))
    for row, (prompt, request) in enumerate(zip(prompts, requests)):
        expected = reference_greedy(reference, prompt, len(request.output))
        assert request.output == expected
        assert len(request.output) <= 4 if row in stop_tokens else len(request.output) == budgets[row]
    assert len(row_steps) > 10


def greedy_outputs(model, prompts: list[list[int]], budgets: list[int], slots: int) -> list[list[int]]:
    """The greedy tokens the native engine with `slots` slots gives each prompt (its budget of new tokens)."""
    requests = [
        Request(prompt=prompt, max_new_tokens=budget, temperature=0) for prompt, budget in zip(prompts, budgets)
    ]
    list(Engine(model, slots=slots, decode="native").run(requests))
    return [request.output for request in requests]


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("slots", [1, 5, 8, 12, 16])
def test_every_row_of_a_full_engine_gets_its_reference_greedy_tokens(slots, weights):
    """Half again as many requests as slots, of prompts and budgets of different lengths, through 1 to 16 slots:
    rows join as others finish, windows slide (block 24), and the products take 8 rows by 3 at a time, 4 by 4 and
    the rows left over (64 wide: float32 matrices in blocks). Each request gets the greedy tokens of the float32
    model its weights stand for: float32 ones themselves, int8 ones dequantized with 16-bit inputs, int4 ones the
    eager int4 model's (its dequantized weights). bfloat16 steps
    round the cache and the products' inputs, so their tokens part from a float32 pass's within a few steps: each
    request gets those of the one-row step (tested above against the float32 pass), one request at a time."""
    original = lively_model(block_size=24, seed=slots, n_embd=64, n_head=4)
    count = slots + slots // 2 + 1
    prompts = row_prompts(37, [1 + (7 * row) % 13 for row in range(count)])
    budgets = [4 + (5 * row) % 17 for row in range(count)]
    if weights == "bfloat16":
        model = plain_copy(original).to(torch.bfloat16)
        expected = greedy_outputs(model, prompts, budgets, slots=1)
    elif weights == "int4":
        model = quantize_int4(plain_copy(original))
        expected = [reference_greedy(model, prompt, budget) for prompt, budget in zip(prompts, budgets)]
    else:
        model = quantize_int8(plain_copy(original)) if weights == "int8" else original
        reference = with_16_bit_inputs(dequantized_model(model, original)) if weights == "int8" else plain_copy(model)
        expected = [reference_greedy(reference, prompt, budget) for prompt, budget in zip(prompts, budgets)]
    assert greedy_outputs(model, prompts, budgets, slots) == expected


def test_seeded_rows_sampled_in_one_step_draw_the_eager_engines_tokens():
    """Four seeded requests with the same settings sample inside the native call (each row with its own uniform
    number, drawn from its own generator); mixed settings are sampled from the step's logits. Same seeds, same
    tokens as the eager engine."""
    model = lively_model(block_size=24)
    for settings in ([(1.0, 5)] * 4, [(1.0, 5), (0.7, None), (0.0, None), (1.0, 40)]):
        outputs = {}
        for native in (True, False):
            requests = [
                Request(
                    prompt=[3, 1, 4, 1 + row, 5], max_new_tokens=30, temperature=temperature, top_k=top_k, seed=11 + row
                )
                for row, (temperature, top_k) in enumerate(settings)
            ]
            engine = Engine(model if native else plain_copy(model), slots=4, decode="native" if native else "eager")
            list(engine.run(requests))
            outputs[native] = [request.output for request in requests]
        assert outputs[True] == outputs[False]
        assert len(set(outputs[True][0])) > 5  # sampled, not one repeated token


def test_a_step_lets_other_python_threads_run():
    """A step of several rows releases Python's lock while it computes (a server streams tokens meanwhile): with
    the lock taken from a thread only when it lets go (a 100 s switch interval), a thread that lets go at every
    count counts while the steps run, and not at all if they held the lock."""
    model = lively_model(block_size=64, n_embd=256, n_head=4, n_layer=8, vocab_size=8192)
    step = NativeStep.for_model(model, torch.float32)
    cache = KVCache(8, 64, slots=16)
    cache.allocate(4, 64, torch.float32, torch.device("cpu"))
    counted, stop = [0], threading.Event()

    def count() -> None:  # hands the lock back at every turn
        while not stop.is_set():
            counted[0] += 1
            time.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    counter = threading.Thread(target=count)
    try:
        counter.start()
        time.sleep(0.01)  # the counter waits for the lock
        before = counted[0]
        for position in range(20):
            step.step_rows(list(range(16)), [position] * 16, cache.keys, cache.values)
        during = counted[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        counter.join()
    assert during > 10 * 20  # a few a step when the lock is held (the step's Python parts let go)


def test_the_packed_weights_follow_a_changed_model():
    """One packed copy per model and dtype, made again after a weight changes in place (load_state_dict) or is
    replaced."""
    model, other = lively_model(seed=1), lively_model(seed=2)
    first = NativeStep.for_model(model, torch.float32)
    assert NativeStep.for_model(model, torch.float32) is first
    assert NativeStep.for_model(model, torch.bfloat16) is not first
    model.load_state_dict(other.state_dict())
    assert NativeStep.for_model(model, torch.float32) is not first
    request = Request(prompt=[1, 2, 3], max_new_tokens=12, temperature=0)
    list(Engine(model, decode="native").run([request]))
    assert request.output == reference_greedy(plain_copy(other), [1, 2, 3], 12)
    # A weight's tensor replaced whole (.data =, as Module.to and float() do), its version counter kept.
    third = lively_model(seed=3)
    for mine, theirs in zip(model.parameters(), third.parameters()):
        mine.data = theirs.data.clone()
    request = Request(prompt=[1, 2, 3], max_new_tokens=12, temperature=0)
    list(Engine(model, decode="native").run([request]))
    assert request.output == reference_greedy(plain_copy(third), [1, 2, 3], 12)


def test_bfloat16_autocast_packs_bfloat16_weights():
    """Under CPU bfloat16 autocast (sample.py --dtype=bfloat16) float32 weights are packed in bfloat16, as the cache
    the eager prefill makes; the logits stay within bfloat16 rounding of the float32 pass."""
    model = lively_model(block_size=32, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine = Engine(model, decode="native")
        assert engine.backend.step.dtype == torch.bfloat16
        request = Request(prompt=[2, 7, 1, 8], max_new_tokens=4, temperature=0)
        engine.add(request)
        engine.step()
        assert engine.cache.keys[0].dtype == torch.bfloat16
    prompt = [2, 7, 1, 8]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the prefill writes bfloat16 keys, as in the engine
        logits, _ = native_steps(model, torch.bfloat16, prompt, 1)
    expected = full_pass_logits(model, prompt)
    assert (logits[0] - expected).abs().max() <= 0.05 * expected.abs().max()


def with_one_int8_layer(model):
    """`model` (in place) with its first MLP's input product int8 and every other product a plain Linear."""
    mlp = model.transformer.h[0].mlp
    mlp.c_fc = Int8Linear.from_linear(mlp.c_fc)
    return model


def test_a_model_with_some_int8_products_is_one_clear_error():
    with pytest.raises(UserError) as error:
        Engine(with_one_int8_layer(lively_model()), decode="native")
    assert_one_line_message(error.value, "every one int8", "--decode=auto")


def test_a_float16_compute_dtype_is_one_clear_error():
    with pytest.raises(UserError) as error:
        NativeStep(lively_model(), torch.float16)
    assert_one_line_message(error.value, "float32 or bfloat16, not float16")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_under_bfloat16_autocast_are_one_clear_error(weights):
    quantize = quantize_int8 if weights == "int8" else quantize_int4
    with pytest.raises(UserError) as error:
        NativeStep(quantize(lively_model()), torch.bfloat16)
    assert_one_line_message(error.value, f"{weights} products compute in float32 only", "--decode=auto")


def test_without_a_build_auto_decodes_eagerly_and_native_says_why_in_one_line(monkeypatch):
    """No compiler or ninja: decode=auto falls back without a word and gives the reference tokens; decode=native is
    one line saying what is missing and what to use instead."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'gptkit_decode_step': c++: not found\nmore detail")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(native_build, "is_built", lambda: False)
    native_decoding.extension.cache_clear()
    try:
        model = lively_model()
        request = Request(prompt=[5, 3, 2], max_new_tokens=10, temperature=0)
        engine = Engine(model)
        list(engine.run([request]))
        assert engine.backend.name == "eager" and request.output == reference_greedy(plain_copy(model), [5, 3, 2], 10)
        with pytest.raises(UserError) as error:
            Engine(model, decode="native")
        assert_one_line_message(error.value, "c++: not found", "g++", "ninja", "--decode=auto")
    finally:
        native_decoding.extension.cache_clear()  # the next call loads the real build again


@pytest.mark.parametrize("threads", [1, 3])
def test_any_thread_count_gives_the_reference_tokens(threads):
    """The threads split the heads and the rows: one thread does it all, and of three threads over two heads one
    has no head (its share of the heads is empty) yet takes its share of every product."""
    model = lively_model(block_size=24)
    reference = plain_copy(model)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        request = Request(prompt=[5, 3, 9], max_new_tokens=30, temperature=0)
        list(Engine(model, decode="native").run([request]))
    finally:
        torch.set_num_threads(before)
    assert request.output == reference_greedy(reference, [5, 3, 9], 30)


@pytest.mark.parametrize("width", [32, 36])
def test_float32_matrices_lie_in_panels_of_rows_column_after_column(width):
    """The float32 head of 61 rows is packed in panels of `rows` rows, each holding its rows' values column after
    column (the first value of each row, then the second...); the last panel holds the rows left, and `rows` zeros
    follow the buffer's last matrix. Any width, whole vectors or not. The expected order is built here value by
    value."""
    blocks = native_decoding.extension().float32_blocks()
    if not blocks:
        pytest.skip("a build without vector lanes reads float32 rows one after another")
    rows, chunk = blocks
    assert rows > 1 and chunk == 1
    model = lively_model(vocab_size=61, n_embd=width, n_head=4, seed=2)
    head = model.lm_head.weight.detach()
    expected = []
    for first in range(0, 61, rows):
        panel = range(first, min(first + rows, 61))
        expected += [head[row, column].reshape(1) for column in range(width) for row in panel]
    packed = NativeStep.for_model(model, torch.float32).matrices
    assert torch.equal(packed[-head.numel() - rows : -rows], torch.cat(expected))
    assert torch.equal(packed[-rows:], torch.zeros(rows))


@pytest.mark.parametrize("blocks", ["q4_1", "q4_0"])
def test_int4_matrices_lie_in_panels_of_rows_with_a_record_per_group(blocks):
    """The int4 head of 61 rows, 40 wide (a group of 32 and one of 8), is packed in panels of `rows` rows (the last
    filled up with zero rows), each a record per group: word w of row r (4 bytes, little-endian) holds the codes of
    the group's columns 8w .. 8w + 7, column 8w + 2k + h in its bits 16h + 4k .. 16h + 4k + 3, then come the rows'
    float16 scales and minimums; the scales alone where every product's minimums are -8 times its scales (Q4_0's
    blocks). The expected bytes are built here value by value."""
    rows = native_decoding.extension().int4_panel_rows()
    model = quantize_int4(lively_model(vocab_size=61, n_embd=40, n_head=4, seed=2))
    model = as_q4_0(model) if blocks == "q4_0" else model
    head = model.lm_head
    codes, expected = head.codes().tolist(), bytearray()
    for first in range(0, 61, rows):
        panel = range(first, first + rows)
        for group in range(2):
            for word in range(4):
                for row in panel:
                    column = [8 * word + 2 * k + h for h in range(2) for k in range(4)]
                    shift = [16 * h + 4 * k for h in range(2) for k in range(4)]
                    value = sum(codes[row][group][c] << b for c, b in zip(column, shift)) if row < 61 else 0
                    expected += value.to_bytes(4, "little")
            for halves in (head.scale, head.minimum) if blocks == "q4_1" else (head.scale,):
                for row in panel:
                    expected += halves[row, group].numpy().tobytes() if row < 61 else bytes(2)
    packed = NativeStep.for_model(model, torch.float32).matrices
    assert bytes(packed[-len(expected) :].numpy()) == bytes(expected)


def test_int4_panels_packed_a_slice_at_a_time_are_those_of_whole_products(monkeypatch):
    """int4 products are packed a slice of whole panels at a time (step.PACKED_WEIGHTS): with slices of one panel,
    the packed buffer is byte for byte every product's panels made whole (int4_panels), back to back."""
    rows = native_decoding.extension().int4_panel_rows()
    model = quantize_int4(lively_model(vocab_size=3 * rows + 5, n_embd=64, n_head=4, seed=3))
    products = [m for block in model.transformer.h for m in layer_tensors(block)[0]] + [model.lm_head]
    monkeypatch.setattr(native_step, "PACKED_WEIGHTS", 1)
    packed = NativeStep.for_model(model, torch.float32).matrices
    assert torch.equal(packed, torch.cat([int4_panels(product, rows) for product in products]))


@pytest.mark.parametrize("head", ["q4_0", "q4_1"])
def test_q4_0_panels_without_minimums_give_what_the_same_blocks_with_minimums_give(monkeypatch, head):
    """A model of Q4_0 blocks (every minimum -8 times its scale) is packed without minimums, 18 bytes a row's group
    of 32 weights where panels with them take 20, and so are its layers beside a Q4_1 head (as a GGUF file's Q4_0
    products may come), the head packed with its minimums; a prefill of two rows of 17 tokens (several passes over
    each panel), steps of one row and of two rows give the keys, values and logits of the same blocks packed with
    their minimums (the step's Q4_1 panels), and the logits of a float64 eager pass over the same blocks and inputs
    rounded as the step rounds them, within INT4_TOLERANCE (float32's rounding, and the inputs' roundings it moves)."""
    model = quantize_int4(lively_model(vocab_size=70, n_embd=64, n_head=4, seed=4, block_size=32))
    head_minimum = model.lm_head.minimum.clone()
    as_q4_0(model)
    if head == "q4_1":
        model.lm_head.minimum = head_minimum
    head_bytes = int4_panel_bytes(model.lm_head, native_decoding.extension().int4_panel_rows(), True)
    without = NativeStep(model, torch.float32)
    monkeypatch.setattr(Int4Linear, "symmetric", lambda self: False)
    with_minimums = NativeStep(model, torch.float32)
    smaller = with_minimums.matrices.numel() if head == "q4_0" else with_minimums.matrices.numel() - head_bytes
    assert without.matrices.numel() == with_minimums.matrices.numel() - smaller // 10  # 18 bytes where 20 were
    prompts = [list(range(3, 20)), list(range(40, 57))]
    results = []
    for step in (without, with_minimums):
        cache = KVCache(model.config.n_layer, 32, slots=2)
        cache.allocate(model.config.n_kv_head, model.config.head_dim, torch.float32, torch.device("cpu"))
        step.prefill(prompts, 0, cache.keys, cache.values)
        row_logits, token = step(5, 17, cache.keys, cache.values)
        rows_logits, _ = step.step_rows([token, 9], [18, 17], cache.keys, cache.values)
        results.append([row_logits, *rows_logits, *cache.keys, *cache.values])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=INT4_TOLERANCE * expected.abs().max().item())
    reference = with_16_bit_group_inputs(model).double()
    sequences = [prompts[0] + [5], prompts[0] + [5, token], prompts[1] + [9]]
    with torch.no_grad():
        expected = [reference(torch.tensor([sequence]))[0][0, -1] for sequence in sequences]
    for logits in (result[:3] for result in results):
        for got, wanted in zip(logits, expected):
            torch.testing.assert_close(got.double(), wanted, rtol=0, atol=INT4_TOLERANCE * wanted.abs().max().item())


def test_a_q8_0_head_lies_in_panels_of_8_bit_codes_with_a_record_per_group():
    """A Q8_0 head of 61 rows, 64 wide (two groups), beside int4 layers, is packed in panels of `rows` rows (the last
    filled up with zero rows), each a record per group: a pair of the group's columns after another, columns 2j and
    2j + 1 of each row in turn, then come the rows' float16 scales. The expected bytes are built here value by
    value."""
    rows = native_decoding.extension().int4_panel_rows()
    model = with_q8_0_head(quantize_int4(lively_model(vocab_size=61, n_embd=64, n_head=4, seed=2)))
    blocks = model.lm_head.blocks()
    codes, expected = blocks.codes.tolist(), bytearray()
    for first in range(0, 61, rows):
        panel = range(first, first + rows)
        for group in range(2):
            for pair in range(16):
                for row in panel:
                    values = [codes[row][group][c] if row < 61 else 0 for c in (2 * pair, 2 * pair + 1)]
                    expected += bytes(value % 256 for value in values)
            for row in panel:
                expected += blocks.scale[row, group].numpy().tobytes() if row < 61 else bytes(2)
    step = NativeStep.for_model(model, torch.float32)
    assert step.weights == "int4" and len(expected) == int8_panel_bytes(model.lm_head, rows)
    assert bytes(step.matrices[-len(expected) :].numpy()) == bytes(expected)


@pytest.mark.parametrize(
    ("layers", "head"), [("q4_1", "q8_0"), ("q4_0", "q8_0"), ("q8_0", "q8_0"), ("q8_0", "q4_1"), ("q8_0", "q4_0")]
)
def test_q8_0_products_beside_int4_ones_or_alone_give_the_eager_pass_logits(layers, head):
    """Q8_0 blocks as the native step reads them: a Q8_0 head beside int4 layers (Q4_1's or Q4_0's panels: a GGUF
    file's 4-bit products often come with one), Q8_0 layers (a Q8_0 file's) with a head of their kind or of int4's. A
    prefill of two rows of 17 tokens, steps of one row and of two rows give the logits of a float64 eager pass over
    the same blocks, its inputs rounded as the step rounds them (per group of 32), within INT4_TOLERANCE; the Q8_0
    codes span -127 .. 127."""
    model = quantize_int4(lively_model(vocab_size=70, n_embd=64, n_head=4, seed=4, block_size=32))
    model = as_q4_0(model) if "q4_0" in (layers, head) else model
    if layers == "q8_0":
        lm_head, model.lm_head = model.lm_head, torch.nn.Identity()  # the head apart: its kind is `head`
        model = as_q8_0(model)
        model.lm_head = lm_head
    model = with_q8_0_head(model) if head == "q8_0" else model
    assert all(m.blocks().codes.abs().max() == 127 for m in model.modules() if isinstance(m, Int8GroupedLinear))
    step = NativeStep.for_model(model, torch.float32)
    assert step.weights == ("q8_0" if layers == "q8_0" else "int4")
    cache = KVCache(model.config.n_layer, 32, slots=2)
    cache.allocate(model.config.n_kv_head, model.config.head_dim, torch.float32, torch.device("cpu"))
    prompts = [list(range(3, 20)), list(range(40, 57))]
    step.prefill(prompts, 0, cache.keys, cache.values)
    row_logits, token = step(5, 17, cache.keys, cache.values)
    rows_logits, _ = step.step_rows([token, 9], [18, 17], cache.keys, cache.values)
    reference = with_16_bit_group_inputs(model).double()
    sequences = [prompts[0] + [5], prompts[0] + [5, token], prompts[1] + [9]]
    with torch.no_grad():
        expected = [reference(torch.tensor([sequence]))[0][0, -1] for sequence in sequences]
    for got, wanted in zip([row_logits, *rows_logits], expected):
        torch.testing.assert_close(got.double(), wanted, rtol=0, atol=INT4_TOLERANCE * wanted.abs().max().item())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_stream_sum_adds_every_value_of_a_buffer(threads):
    """The read-speed measure's sum (benchmarks/measure.py) over an odd number of small whole numbers, split
    between 1 to 3 threads (shares that end inside a vector): exact, so every value is read once."""
    values = (torch.arange(1_000_003) % 7).float()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        total = native_decoding.extension().stream_sum(values)
    finally:
        torch.set_num_threads(before)
    assert total == 142_857 * 21 + 0 + 1 + 2 + 3  # 142857 whole cycles of 0..6, then 0, 1, 2, 3


def test_huge_page_buffers_are_zeros_from_a_2_mb_boundary():
    """The packed weights' and the KV cache's buffers: zeros, writable, starting at a 2 MB boundary (so whole huge
    pages hold them); a buffer under 2 MB is a plain tensor."""
    buffer = huge_page_zeros(3 * 2**20, torch.bfloat16)
    assert buffer.dtype == torch.bfloat16 and buffer.shape == (3 * 2**20,) and buffer.data_ptr() % (2 << 20) == 0
    assert not buffer.any()
    buffer.fill_(1.0)
    assert buffer.float().sum().item() == 3 * 2**20
    small = huge_page_zeros(10, torch.float32)
    assert small.shape == (10,) and not small.any()


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_build(tmp_path):
    """torch's build waits while its `lock` file exists; a build killed midway leaves one, and the next build in
    that directory must not wait for it forever."""
    (tmp_path / "lock").write_text("")  # what a killed build leaves
    assert not FileBaton(str(tmp_path / "lock")).try_acquire()
    with native_decoding.builder_lock(tmp_path):
        baton = FileBaton(str(tmp_path / "lock"))
        assert baton.try_acquire()
        baton.release()
