"""gptkit/infer/decoding.py: the rules decode=auto follows, on explicit inputs, and what each decode value runs."""

from __future__ import annotations

import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.infer import generate
from gptkit.infer.decoding import Plan, auto_plan, compute_name, plan_for
from gptkit.weights.quantization import quantize_int4, quantize_int8
from helpers import assert_one_line_message, lively_model, plain_copy, reference_greedy


@pytest.mark.parametrize(
    ("device", "compute", "slots", "native_ready", "onednn_ready", "expected"),
    [
        # CUDA: CUDA graphs at every batch, in every dtype
        ("cuda", "bfloat16", 1, False, False, Plan(compiled=True)),
        ("cuda", "float32", 8, False, False, Plan(compiled=True)),
        # CPU float32: native for a row alone, oneDNN for the steps with more rows
        ("cpu", "float32", 1, True, True, Plan(native=True)),
        ("cpu", "float32", 8, True, True, Plan(native=True)),
        # no native build: plain eager at one row (oneDNN lost there on a Xeon), oneDNN for more
        ("cpu", "float32", 1, False, True, Plan()),
        ("cpu", "float32", 8, False, True, Plan(onednn=True)),
        # no oneDNN (not x86): plain eager for more rows
        ("cpu", "float32", 8, True, False, Plan(native=True)),
        # bfloat16 and int8: native for a row alone, eager for more (oneDNN is float32 only)
        ("cpu", "bfloat16", 8, True, True, Plan(native=True)),
        ("cpu", "int8", 8, True, True, Plan(native=True)),
        ("cpu", "int4", 8, True, True, Plan(native=True)),
        # int4 without a native build: eager (oneDNN's copy would leave its products as they are)
        ("cpu", "int4", 8, False, True, Plan()),
        # other devices: eager
        ("mps", "float32", 1, False, False, Plan()),
    ],
)
def test_auto_plan_rules(device, compute, slots, native_ready, onednn_ready, expected):
    assert auto_plan(device, compute, slots, native_ready, onednn_ready) == expected


def test_compute_name_counts_quantized_weights_and_autocast():
    model = lively_model()
    assert compute_name(model, torch.float32) == "float32"
    assert compute_name(model, torch.bfloat16) == "bfloat16"
    assert compute_name(quantize_int8(lively_model()), torch.float32) == "int8"
    assert compute_name(quantize_int4(lively_model()), torch.float32) == "int4"


def test_explicit_values_are_the_backend_they_name():
    model = lively_model()
    assert plan_for("eager", model, 8, torch.float32) == Plan()
    assert plan_for("compiled", model, 1, torch.float32) == Plan(compiled=True)
    assert plan_for("native", model, 1, torch.float32).native
    with pytest.raises(UserError) as error:
        plan_for("native", model, 1, torch.float16)
    assert_one_line_message(error.value, "--decode=native", "not float16")
    with pytest.raises(UserError) as error:
        plan_for("fastest", model, 1, torch.float32)
    assert_one_line_message(error.value, "auto, eager, compiled, native")


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("decode", ["auto", "eager", "native"])
def test_every_cpu_backend_gives_the_plain_models_greedy_tokens(decode, rows):
    """The documented call, at one row and at three, with each backend that runs here without compiling (the compiled
    step has its own tests): the tokens of a full forward pass of the plain model, window sliding included."""
    model = lively_model(seed=3, block_size=24)
    reference = plain_copy(model)
    prompt = torch.randint(0, 37, (rows, 6), generator=torch.Generator().manual_seed(2))
    out = generate(model, prompt, 30, temperature=0, decode=decode)
    for row in range(rows):
        assert out[row, 6:].tolist() == reference_greedy(reference, prompt[row].tolist(), 30)
