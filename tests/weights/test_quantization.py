"""gptkit/weights/quantization.py: int8 weights keep a trained model's whole-split val loss within 1% of float32, the
same greedy text, and refuse what they cannot do; sample.py --quantize=int8 end to end. int4 weights are GGUF's Q4_1
(gguf-py's quantizer and a float64 reimplementation), hold Q4_0 exactly, and run in sample.py --quantize=int4. Also
the other way to read fewer bytes per token, the compiled step under bfloat16 autocast (sample.py --decode=compiled
--dtype=bfloat16)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

import sample
import train
from gptkit.core.distributed import Processes
from gptkit.core.errors import UserError
from gptkit.data import loader
from gptkit.infer.compiled import decode_step
from gptkit.infer.engine import Engine, KVCache, Request, generate
from gptkit.infer.onednn import optimize_for_cpu_decoding
from gptkit.model import GPT, GPTConfig
from gptkit.train import loop
from gptkit.train.optim import configure_optimizers
from gptkit.weights.quantization import (
    Int4Linear,
    Int8Linear,
    apply_quantization,
    quantize_int4,
    quantize_int8,
    quantize_q8_0,
)
from helpers import assert_script_error, int8_reference, run_in_process, run_script, tiny_train_args


def trained_char_model(data_dir: Path, steps: int = 250) -> GPT:
    """A small char model trained for a few seconds: its loss is far below a random model's."""
    sampler = loader.BatchSampler(loader.open_split(data_dir, "train"), batch_size=16, block_size=64, seed=0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=1, n_head=4, n_embd=64, dropout=0.0, bias=True))
    optimizer = configure_optimizers(model, 0.1, 3e-3, (0.9, 0.99), "cpu")
    for index in range(steps):
        _, loss = model(*sampler.batch(index))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


def whole_split_loss(model: nn.Module, data_dir: Path) -> float:
    windows = loader.SplitWindows(loader.open_split(data_dir, "val"), block_size=64, batch_size=32)
    with torch.inference_mode():
        return loop.mean_loss(model, windows, torch.autocast("cpu", enabled=False), torch.device("cpu"), Processes())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT, Path]:
    from helpers import make_char_data, sample_text

    directory = tmp_path_factory.mktemp("quant_data")
    make_char_data(directory, text=sample_text(40_000))
    return trained_char_model(directory), directory


def copy_of(model: GPT) -> GPT:
    twin = GPT(model.config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def with_shifted_embeddings(model: GPT) -> GPT:
    """A copy of `model` whose token embeddings (and so its tied head) are moved down one row: the same shapes and
    scale, other logits."""
    shifted = copy_of(model)
    with torch.no_grad():
        shifted.transformer.wte.weight.copy_(model.transformer.wte.weight.roll(1, dims=0))
    return shifted


def compiled_step_logits(model: GPT, prompt: list[int]) -> torch.Tensor:
    """The compiled decoding step's logits (V,) for prompt's last token, after an eager prefill of the rest, as
    gptkit.infer.engine.Engine runs it (under the caller's inference_mode and autocast)."""
    cache = KVCache(model.config.n_layer, model.config.block_size)
    model(torch.tensor([prompt[:-1]]), cache=cache)
    logits, _ = decode_step(model, torch.tensor([prompt[-1:]]), cache.keys, cache.values, cache.lengths, cache.capacity)
    return logits[0, -1]


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to within 5% of the largest logit: the rounding of bfloat16 activations, far below another model's."""
    got, expected = got.float(), expected.float()
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05 * expected.abs().max().item())


@pytest.mark.heavy
def test_int8_keeps_the_whole_split_val_loss_within_one_percent(trained: tuple[GPT, Path]) -> None:
    model, data_dir = trained
    reference = whole_split_loss(model, data_dir)
    quantized = quantize_int8(copy_of(model))
    int8_loss = whole_split_loss(quantized, data_dir)
    assert reference < 3.0  # trained: a random 65-way guess scores ln(65) = 4.17
    assert abs(int8_loss - reference) / reference < 0.01, (reference, int8_loss)
    assert int8_loss != reference  # the weights really changed precision


@pytest.mark.heavy
def test_int8_layers_replace_every_linear_and_leave_the_embedding_exact(trained: tuple[GPT, Path]) -> None:
    model, _ = trained
    quantized = quantize_int8(copy_of(model))
    assert not any(type(module) is nn.Linear for module in quantized.modules())
    int8_layers = [m for m in quantized.modules() if isinstance(m, Int8Linear)]
    assert len(int8_layers) == 4 * model.config.n_layer + 1  # qkv, proj, fc, proj per block, and the head
    assert torch.equal(quantized.transformer.wte.weight, model.transformer.wte.weight)  # the tie was cut, not shared
    head, weight = quantized.lm_head, model.lm_head.weight.detach()
    row_max = weight.abs().max(dim=1).values  # symmetric per-row scales: the row's largest |w| maps to ~127
    assert head.weight_int8.dtype == torch.int8 and head.weight_int8.abs().max(dim=1).values.min() >= 126
    assert head.scale.dtype == torch.bfloat16
    torch.testing.assert_close(head.scale.float(), row_max / 127, rtol=2**-8, atol=0)  # rounded to bfloat16
    scale = head.scale.float()[:, None]
    assert ((head.weight_int8.float() * scale - weight).abs() <= scale / 2 + 1e-7).all()  # rounding to the nearest


def test_int8_linear_eager_and_compiled_products_match_the_dequantized_weights() -> None:
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(64, 40))
    x = torch.randn(3, 5, 64)
    expected = int8_reference(layer, x)
    with torch.inference_mode():
        eager = layer(x)  # fbgemm: each row's activations rounded to 7 bits on the fly, so a looser match
        compiled = torch.compile(layer, fullgraph=True)(x[:, :1])  # inductor: bfloat16 activations
    assert eager.shape == (3, 5, 40) and compiled.shape == (3, 1, 40)
    torch.testing.assert_close(eager, expected, rtol=0, atol=0.05 * expected.abs().max().item())
    rounded = int8_reference(layer, x[:, :1].bfloat16().float())  # the bfloat16 input, exactly
    torch.testing.assert_close(compiled, rounded, rtol=0.02, atol=0.02)
    x[1, 2] *= 100  # one row far larger than the others: each row is rounded as it is alone
    alone = torch.cat([layer(row[None]) for row in x.reshape(15, 64)])
    assert torch.equal(layer(x).reshape(15, 40), alone)


@pytest.mark.parametrize("decode", ["eager", "native"])
def test_an_int8_requests_tokens_do_not_depend_on_the_rows_beside_it(decode: str) -> None:
    """Two prompts of 40 tokens (past the native prefill of some weights) decoded together give each the greedy tokens
    it gets alone: no product rounds a row by a scale that another row's values set."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=47, n_layer=2, n_head=4, n_embd=40)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 1.0 if "wte" in name or "wpe" in name else 2.0 / param.shape[-1] ** 0.5)
    quantized = quantize_int8(model)
    prompts = torch.randint(0, 47, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        together = generate(quantized, prompts, 20, temperature=0.0, decode=decode)
        alone = [generate(quantized, prompts[i : i + 1], 20, temperature=0.0, decode=decode)[0] for i in range(2)]
    assert torch.equal(together, torch.stack(alone))


@pytest.mark.heavy
def test_int8_converts_layers_already_in_the_cpu_decoding_layout(trained: tuple[GPT, Path]) -> None:
    """A model that has generated has DecodingLinear layers (transposed storage): they are quantized like the rest."""
    model, data_dir = trained
    fresh, decoded = quantize_int8(copy_of(model)), quantize_int8(optimize_for_cpu_decoding(copy_of(model)))
    assert sum(isinstance(m, Int8Linear) for m in decoded.modules()) == 4 * model.config.n_layer + 1
    for ours, theirs in zip(fresh.modules(), decoded.modules()):
        if isinstance(ours, Int8Linear):
            assert torch.equal(ours.weight_int8, theirs.weight_int8) and torch.equal(ours.scale, theirs.scale)
    prompt = torch.from_numpy(loader.open_split(data_dir, "val").read_windows([0], 32)[0].astype("int64"))[None]
    with torch.inference_mode():
        torch.testing.assert_close(decoded(prompt)[0], fresh(prompt)[0])


def assert_int8_engine_follows_eager_int8(model: GPT, data_dir: Path, window: int, **engine_options) -> None:
    """An engine (with engine_options) over an int8 copy of `model` gives the greedy tokens of the eager int8 model
    and of float32: 24 tokens after the val split's window `window` (24 tokens)."""
    quantized = quantize_int8(copy_of(model))
    prompt = loader.open_split(data_dir, "val").read_windows([window], 24)[0].astype("int64").tolist()
    requests = [Request(prompt=prompt, max_new_tokens=24, temperature=0)]
    assert len(list(Engine(quantized, **engine_options).run(requests))) == 24
    with torch.inference_mode():
        eager = generate(quantized, torch.tensor([prompt]), 24, temperature=0.0, decode="eager")
        fp32 = generate(model, torch.tensor([prompt]), 24, temperature=0.0, decode="eager")
    assert requests[0].output == eager[0, len(prompt) :].tolist() == fp32[0, len(prompt) :].tolist()


@pytest.mark.heavy
def test_compiled_int8_decoding_follows_eager_int8(trained: tuple[GPT, Path]) -> None:
    """sample.py --decode=compiled --quantize=int8: the compiled step's weight-only int8 kernel gives the greedy tokens of
    the eager int8 model, and of float32. (That a second model of the same shapes runs its own frozen weights, int8 as
    bfloat16, is the bfloat16 test's: one step setting, inductor's FX-graph cache off, keeps both apart.)"""
    model, data_dir = trained
    assert_int8_engine_follows_eager_int8(model, data_dir, 0, decode="compiled")


@pytest.mark.heavy
def test_native_int8_decoding_follows_eager_int8(trained: tuple[GPT, Path]) -> None:
    """sample.py --decode=native --quantize=int8 (and auto, which takes it at one row): the native step's int8 products (16-bit integer inputs) give the
    greedy tokens of the eager int8 model, and of float32."""
    model, data_dir = trained
    assert_int8_engine_follows_eager_int8(model, data_dir, 1, decode="native")


@pytest.mark.heavy
def test_compiled_bfloat16_decoding_follows_eager_bfloat16(trained: tuple[GPT, Path]) -> None:
    """sample.py --decode=compiled --dtype=bfloat16: float32 weights under bfloat16 autocast, which the frozen compiled
    step folds into bfloat16 constants (half the bytes a token reads). Its logits match eager bfloat16's, and its
    greedy tokens are eager bfloat16's and float32's. A second model of the same shapes, compiled next, runs its own
    weights: with inductor's FX-graph cache, which keys an entry by the weights' shapes and saves the constants made
    from them (bfloat16 and int8 alike), it ran the first model's (gptkit/infer/compiled.py's STEP_COMPILE_OPTIONS)."""
    model, data_dir = trained
    prompt = loader.open_split(data_dir, "val").read_windows([0], 25)[0].astype("int64").tolist()
    compiled_model, other = copy_of(model), with_shifted_embeddings(model)
    with torch.inference_mode():
        fp32 = generate(model, torch.tensor([prompt]), 24, temperature=0.0, decode="eager")[0, len(prompt) :].tolist()
        with torch.autocast("cpu", torch.bfloat16):
            eager_logits = model(torch.tensor([prompt]))[0][0, -1]
            eager = generate(model, torch.tensor([prompt]), 24, temperature=0.0, decode="eager")
            eager = eager[0, len(prompt) :].tolist()
            assert_same_logits(compiled_step_logits(compiled_model, prompt), eager_logits)
            request = Request(prompt=prompt, max_new_tokens=24, temperature=0)
            assert len(list(Engine(compiled_model, decode="compiled").run([request]))) == 24
            assert_same_logits(compiled_step_logits(other, prompt), other(torch.tensor([prompt]))[0][0, -1])
    assert request.output == eager == fp32


@pytest.mark.heavy
def test_int8_greedy_text_and_logits_follow_float32(trained: tuple[GPT, Path]) -> None:
    model, data_dir = trained
    quantized = quantize_int8(copy_of(model))
    prompt = torch.from_numpy(loader.open_split(data_dir, "val").read_windows([0], 32)[0].astype("int64"))[None]
    with torch.inference_mode():
        logits_fp32, _ = model(prompt)
        logits_int8, _ = quantized(prompt)
        greedy_fp32 = generate(model, prompt, 40, temperature=0.0)[0].tolist()
        greedy_int8 = generate(quantized, prompt, 40, temperature=0.0)[0].tolist()
    probs_fp32, probs_int8 = logits_fp32.softmax(-1), logits_int8.softmax(-1)
    assert (probs_fp32 - probs_int8).abs().max() < 0.05
    assert greedy_int8 == greedy_fp32


def test_int8_refuses_what_it_cannot_run() -> None:
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(UserError, match=r"float32 model on the CPU, got torch\.bfloat16"):
        quantize_int8(GPT(model.config).to(torch.bfloat16))
    with pytest.raises(UserError, match=r"computes in float32, not bfloat16"):
        apply_quantization(model, "int8", torch.bfloat16)
    with pytest.raises(UserError, match=r"unknown --quantize='int2'; use none, int8, int4"):
        apply_quantization(model, "int2")
    assert apply_quantization(model, "none") is model and type(model.lm_head) is nn.Linear
    assert isinstance(apply_quantization(model, "int8").lm_head, Int8Linear)


def test_sample_with_int8_weights(char_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """sample.py --quantize=int8 as a process; the native run and the refusal call its main in this process."""
    out_dir = tmp_path / "out"
    assert train.main(tiny_train_args(char_data_dir, out_dir)) == 0  # the checkpoint is the input, not the test
    result = run_script(
        "sample.py", f"--out_dir={out_dir}", "--quantize=int8", "--max_new_tokens=20", "--start=ROMEO:", "--device=cpu"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:") and len(result.stdout) > len("ROMEO:")
    native = run_in_process(
        sample.main,
        [
            f"--out_dir={out_dir}",
            "--quantize=int8",
            "--decode=native",
            "--max_new_tokens=20",
            "--start=ROMEO:",
            "--device=cpu",
            "--seed=5",
        ],
        capsys,
    )
    assert native.returncode == 0, native.stderr
    assert native.stdout.startswith("ROMEO:") and len(native.stdout) > len("ROMEO:")
    refused = [f"--out_dir={out_dir}", "--quantize=int8", "--dtype=bfloat16", "--device=cpu"]
    assert_script_error(run_in_process(sample.main, refused, capsys), "--quantize=int8 computes in float32")


def gguf_q4_1_blocks(weight: torch.Tensor) -> np.ndarray:
    """gguf-py's Q4_1 blocks of `weight` (rows, in), as (rows, groups, 20) bytes: the scale d and the minimum m
    (float16), then the 16 bytes of codes."""
    blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1)
    return blocks.reshape(weight.shape[0], -1, 20)


def test_int4_weights_are_ggufs_q4_1_blocks() -> None:
    """Int4Linear.from_linear stores, byte for byte, the scales, minimums and packed codes gguf-py's Q4_1 quantizer
    writes (llama.cpp's reference), and its dequantized weight is gguf-py's dequantization of them."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 24)
    with torch.no_grad():
        linear.weight[3, 32:64] = 0.25  # a group of equal weights: scale 0
    layer = Int4Linear.from_linear(linear)
    blocks = gguf_q4_1_blocks(linear.weight.detach())
    assert layer.weight_int4.shape == (24, 3, 16) and layer.weight_int4.dtype == torch.uint8
    assert np.array_equal(layer.scale.numpy(), blocks[..., 0:2].copy().view(np.float16)[..., 0])
    assert np.array_equal(layer.minimum.numpy(), blocks[..., 2:4].copy().view(np.float16)[..., 0])
    assert np.array_equal(layer.weight_int4.numpy(), blocks[..., 4:])
    dequantized = gguf.quants.dequantize(blocks.reshape(24, -1), gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(layer.dequantized_weight().numpy(), dequantized)
    assert layer.scale[3, 1] == 0 and (layer.dequantized_weight()[3, 32:64] == 0.25).all()


def test_q8_0_blocks_are_ggufs_bytes_for_byte() -> None:
    """quantize_q8_0 makes, byte for byte, the scales and int8 codes gguf-py's Q8_0 quantizer writes (llama.cpp's
    reference), ties at half a step included (rounded away from zero), a group of zeros too; and its values are
    gguf-py's dequantization of them. A row of 40 weights quantizes as the same row filled with zeros to 64."""
    torch.manual_seed(0)
    weight = torch.randn(24, 96)
    weight[3, 32:64] = 0.0
    weight[5, :32] = torch.arange(32) - 15.5  # d = 16.5 / 127: some w / d land on half steps
    weight[6, :32] = torch.tensor([127.0, 0.5, -0.5, 1.5, -1.5, 2.5] + [0.0] * 26)  # d = 1: exact halves
    blocks = quantize_q8_0(weight)
    expected = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(24, -1, 34)
    assert blocks.codes.shape == (24, 3, 32) and blocks.codes.dtype == torch.int8
    assert np.array_equal(blocks.scale.numpy().view(np.uint16), expected[..., :2].copy().view(np.uint16)[..., 0])
    assert np.array_equal(blocks.codes.numpy(), expected[..., 2:].view(np.int8))
    assert blocks.codes[6, 0, :6].tolist() == [127, 1, -1, 2, -2, 3]
    dequantized = gguf.quants.dequantize(expected.reshape(24, -1), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(blocks.values(96).numpy(), dequantized)
    short = quantize_q8_0(weight[:, :40])
    padded = quantize_q8_0(torch.cat((weight[:, :40], torch.zeros(24, 24)), dim=1))
    assert all(map(torch.equal, short, padded)) and torch.equal(short.values(40), padded.values(64)[:, :40])


def float64_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 by hand in float64 over groups of 32 along each row (a shorter last group): scale = (largest -
    smallest) / 15, minimum = smallest, code = round((w - minimum) / scale) in 0 .. 15. Returns the codes (rows, in),
    each weight's scale and minimum (rows, in), and how far each (w - minimum) / scale lies from a rounding boundary
    (x.5), where float32 arithmetic may round either way."""
    w = weight.double()
    scales, minimums = torch.empty_like(w), torch.empty_like(w)
    for start in range(0, w.shape[1], 32):
        group = w[:, start : start + 32]
        smallest, largest = group.min(dim=1, keepdim=True).values, group.max(dim=1, keepdim=True).values
        scales[:, start : start + 32] = (largest - smallest) / 15
        minimums[:, start : start + 32] = smallest
    steps = (w - minimums) / scales
    codes = torch.round(steps).clamp(0, 15)
    return codes, scales, minimums, ((steps - steps.floor()) - 0.5).abs()


def test_int4_codes_and_dequantized_weight_follow_a_float64_q4_1() -> None:
    """Rows of 72 weights (two groups of 32, one of 8): each code is the float64 reimplementation's except within
    float32 rounding of a rounding boundary; scale and minimum are its float16 roundings; each dequantized weight is
    scale * code + minimum of the stored float16 values (to float32 rounding) and within half a step (and float16's
    rounding of the scale and the minimum) of the weight."""
    torch.manual_seed(1)
    linear = nn.Linear(72, 16, bias=False)
    layer = Int4Linear.from_linear(linear)
    weight = linear.weight.detach()
    codes, scales, minimums, off_boundary = float64_q4_1(weight)
    ours = layer.codes().reshape(16, -1)[:, :72].double()
    clear = off_boundary > 1e-4
    assert clear.float().mean() > 0.99 and torch.equal(ours[clear], codes[clear])
    assert (ours - codes).abs().max() <= 1
    stored_scale = layer.scale.double().repeat_interleave(32, dim=1)[:, :72]
    stored_minimum = layer.minimum.double().repeat_interleave(32, dim=1)[:, :72]
    torch.testing.assert_close(stored_scale, scales, rtol=2**-11, atol=0)  # float16's rounding
    torch.testing.assert_close(stored_minimum, minimums, rtol=2**-11, atol=0)
    dequantized = layer.dequantized_weight().double()
    torch.testing.assert_close(dequantized, stored_scale * ours + stored_minimum, rtol=2**-23, atol=0)
    rounding = (15 * scales + minimums.abs()) * 2**-11
    assert ((dequantized - weight.double()).abs() <= scales / 2 + rounding + 1e-7).all()


def test_int4_holds_q4_0_blocks_exactly() -> None:
    """A Q4_0 block (weight = d * (code - 8)) is an Int4Linear with scale d and minimum -8 d: its dequantized weight
    is gguf-py's dequantization of gguf-py's Q4_0 blocks, exactly."""
    torch.manual_seed(2)
    weight = torch.randn(8, 64)
    blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_0).reshape(8, 2, 18)
    scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    layer = Int4Linear(torch.from_numpy(blocks[..., 2:].copy()), scale, -8 * scale, 64, None)
    dequantized = gguf.quants.dequantize(blocks.reshape(8, -1), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(layer.dequantized_weight().numpy(), dequantized)


def test_int4_linear_computes_with_its_dequantized_weight_in_the_inputs_dtype() -> None:
    torch.manual_seed(3)
    layer = Int4Linear.from_linear(nn.Linear(40, 24))
    x = torch.randn(3, 5, 40)
    expected = x.double() @ layer.dequantized_weight().double().T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = layer(x)
    assert rounded.dtype == torch.bfloat16
    torch.testing.assert_close(rounded.double(), expected, rtol=0.02, atol=0.05)


def test_int4_quantizes_every_product_in_any_compute_dtype() -> None:
    """quantize_int4 (and --quantize=int4, also under bfloat16 compute) makes every Linear an Int4Linear; a tied head
    gets codes of its own and the embedding stays exact; the greedy text of a model whose weights are plain Linear
    layers holding the dequantized weights is the int4 model's."""
    from helpers import lively_model, plain_copy, reference_greedy

    model = lively_model(tie_embeddings=True)
    quantized = apply_quantization(plain_copy(model), "int4", torch.bfloat16)
    int4_layers = [m for m in quantized.modules() if isinstance(m, Int4Linear)]
    assert len(int4_layers) == 4 * model.config.n_layer + 1
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    assert torch.equal(quantized.transformer.wte.weight, model.transformer.wte.weight)
    dequantized = plain_copy(model)
    with torch.no_grad():
        for name, module in dequantized.named_modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(dict(quantized.named_modules())[name].dequantized_weight())
    assert reference_greedy(quantized, [1, 2, 3], 8) == reference_greedy(dequantized, [1, 2, 3], 8)
    assert isinstance(quantize_int4(plain_copy(model)).lm_head, Int4Linear)


def test_sample_with_int4_weights(char_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """sample.py --quantize=int4 (main in this process): text after the prompt."""
    out_dir = tmp_path / "out"
    assert train.main(tiny_train_args(char_data_dir, out_dir)) == 0  # the checkpoint is the input, not the test
    args = [f"--out_dir={out_dir}", "--quantize=int4", "--max_new_tokens=20", "--start=the king", "--device=cpu"]
    result = run_in_process(sample.main, args, capsys)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("the king") and len(result.stdout) > len("the king")
