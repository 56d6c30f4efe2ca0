"""gptkit/weights/quantization.py: int8 weights keep a trained model's whole-split val loss within 1% of float32, the same
greedy text, and refuse what they cannot do; sample.py --quantize=int8 end to end. Also the other way to read fewer
bytes per token, the compiled step under bfloat16 autocast (sample.py --decode=compiled --dtype=bfloat16)."""

from __future__ import annotations

from pathlib import Path

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
from gptkit.weights.quantization import Int8Linear, apply_quantization, quantize_int8
from helpers import assert_script_error, int8_reference, run_in_process, run_script, tiny_train_args


def trained_char_model(data_dir: Path, steps: int = 250) -> GPT:
    """A small char model trained for a few seconds: its loss is far below a random model's."""
    sampler = loader.BatchSampler(loader.open_split(data_dir, "train"), batch_size=16, block_size=64, seed=0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True))
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
        eager = layer(x)  # fbgemm: activations quantized to 7 bits on the fly, so a looser match
        compiled = torch.compile(layer, fullgraph=True)(x[:, :1])  # inductor: bfloat16 activations
    assert eager.shape == (3, 5, 40) and compiled.shape == (3, 1, 40)
    torch.testing.assert_close(eager, expected, rtol=0, atol=0.05 * expected.abs().max().item())
    rounded = int8_reference(layer, x[:, :1].bfloat16().float())  # the bfloat16 input, exactly
    torch.testing.assert_close(compiled, rounded, rtol=0.02, atol=0.02)


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


def assert_int8_engine_follows_eager_int8(model: GPT, data_dir: Path, window: int, **engine_options) -> list[int]:
    """An engine (with engine_options) over an int8 copy of `model` gives the greedy tokens of the eager int8 model
    and of float32: 24 tokens after the val split's window `window` (24 tokens), which is returned."""
    quantized = quantize_int8(copy_of(model))
    prompt = loader.open_split(data_dir, "val").read_windows([window], 24)[0].astype("int64").tolist()
    requests = [Request(prompt, 24, temperature=0)]
    assert len(list(Engine(quantized, **engine_options).run(requests))) == 24
    with torch.inference_mode():
        eager = generate(quantized, torch.tensor([prompt]), 24, temperature=0.0, decode="eager")
        fp32 = generate(model, torch.tensor([prompt]), 24, temperature=0.0, decode="eager")
    assert requests[0].output == eager[0, len(prompt) :].tolist() == fp32[0, len(prompt) :].tolist()
    return prompt


@pytest.mark.heavy
def test_compiled_int8_decoding_follows_eager_int8(trained: tuple[GPT, Path]) -> None:
    """sample.py --decode=compiled --quantize=int8: the compiled step's weight-only int8 kernel gives the greedy tokens of
    the eager int8 model, and of float32. A second model of the same shapes, compiled next, runs its own weights."""
    model, data_dir = trained
    prompt = assert_int8_engine_follows_eager_int8(model, data_dir, 0, decode="compiled")
    other = quantize_int8(with_shifted_embeddings(model))
    with torch.inference_mode():
        assert_same_logits(compiled_step_logits(other, prompt), other(torch.tensor([prompt]))[0][0, -1])


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
    weights."""
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
            request = Request(prompt, 24, temperature=0)
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
    with pytest.raises(UserError, match=r"unknown --quantize='int4'"):
        apply_quantization(model, "int4")
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
