"""gptkit/infer/decoding.py: the rules decode=auto follows, on explicit inputs; that the engine's backend is the
answer of those rules for every case a CPU meets; what each decode value runs; and the engine through the backend
interface (gptkit/infer/backend.py) with each CPU backend. (The compiled backend has its own tests in
test_engine.py, where its slow compiles are shared.)"""

from __future__ import annotations

import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.infer import generate
from gptkit.infer.decoding import BACKENDS, auto_choice, backend_name, compute_name
from gptkit.infer.engine import Engine, Request
from gptkit.infer.native import build as native_build
from gptkit.infer.onednn import onednn_linear_available
from gptkit.weights.quantization import quantize_int4, quantize_int8
from helpers import assert_one_line_message, lively_model, plain_copy, reference_greedy


@pytest.mark.parametrize(
    ("device", "compute", "rows", "native_ready", "onednn_ready", "expected"),
    [
        # CUDA: CUDA graphs at every batch, in every dtype
        ("cuda", "bfloat16", 1, False, False, "compiled"),
        ("cuda", "float32", 8, False, False, "compiled"),
        # CPU with the native step built: native for one row and for several, whatever the weights
        ("cpu", "float32", 1, True, True, "native"),
        ("cpu", "float32", 8, True, True, "native"),
        ("cpu", "float32", 8, True, False, "native"),
        ("cpu", "bfloat16", 8, True, True, "native"),
        ("cpu", "int8", 8, True, True, "native"),
        ("cpu", "int4", 8, True, True, "native"),
        # no native build: plain eager at one row (oneDNN loses there), oneDNN for more float32 rows
        ("cpu", "float32", 1, False, True, "eager"),
        ("cpu", "float32", 8, False, True, "onednn"),
        # no oneDNN (not x86): plain eager for more rows
        ("cpu", "float32", 8, False, False, "eager"),
        # bfloat16, int8 and int4 without a native build: eager (oneDNN's copy is for float32 products)
        ("cpu", "bfloat16", 8, False, True, "eager"),
        ("cpu", "int8", 8, False, True, "eager"),
        ("cpu", "int4", 8, False, True, "eager"),
        # other devices: eager
        ("mps", "float32", 1, False, False, "eager"),
    ],
)
def test_auto_choice_rules(device, compute, rows, native_ready, onednn_ready, expected):
    assert auto_choice(device, compute, rows, native_ready, onednn_ready) == expected
    assert expected in BACKENDS


def test_compute_name_counts_quantized_weights_and_autocast():
    model = lively_model()
    assert compute_name(model, torch.float32) == "float32"
    assert compute_name(model, torch.bfloat16) == "bfloat16"
    assert compute_name(quantize_int8(lively_model()), torch.float32) == "int8"
    assert compute_name(quantize_int4(lively_model()), torch.float32) == "int4"


@pytest.mark.parametrize("built", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("weights", ["float32", "bfloat16 autocast", "int8", "int4"])
def test_an_auto_engines_backend_is_auto_choices_answer(monkeypatch, weights, rows, built):
    """decode=auto on the CPU, for each kind of weights, one row or several, the native step built or not: the
    backend the engine runs is the one auto_choice names for that case, and the engine's only choice."""
    if not built:
        monkeypatch.setattr(native_build, "is_built", lambda: False)
    model = {"int8": quantize_int8, "int4": quantize_int4}.get(weights, lambda m: m)(lively_model())
    compute = "bfloat16" if weights == "bfloat16 autocast" else weights
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == "bfloat16"):
        engine = Engine(model, slots=rows)
    assert engine.backend.name == auto_choice("cpu", compute, rows, built, onednn_linear_available())


def test_explicit_values_are_the_backend_they_name():
    model = lively_model()
    assert backend_name("eager", model, 8, torch.float32) == "eager"
    assert backend_name("compiled", model, 1, torch.float32) == "compiled"
    assert backend_name("native", model, 1, torch.float32) == "native"
    assert Engine(model, slots=2, decode="eager").backend.name == "eager"
    with pytest.raises(UserError) as error:
        backend_name("native", model, 1, torch.float16)
    assert_one_line_message(error.value, "--decode=native", "not float16")
    with pytest.raises(UserError) as error:
        backend_name("fastest", model, 1, torch.float32)
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


def engine_on(backend: str, model, slots: int, monkeypatch) -> Engine:
    """An engine whose backend is `backend` (eager, native, or onednn: auto's answer for float32 rows on an x86 CPU
    without the native build)."""
    if backend == "onednn":
        if not onednn_linear_available():
            pytest.skip("oneDNN's direct linear needs an x86 CPU")
        monkeypatch.setattr(native_build, "is_built", lambda: False)
        engine = Engine(model, slots=slots)
    else:
        engine = Engine(model, slots=slots, decode=backend)
    assert engine.backend.name == backend
    return engine


def requests_of_every_kind() -> list[Request]:
    """Greedy and seeded requests of three prompt lengths, one that slides its window (block 24), sampled whole or
    from the top 5, one with a penalty (sampled from its changed logits) and one asking for log-probabilities."""
    prompts = [torch.randint(0, 37, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 20)]
    return [
        Request(prompt=prompts[0], max_new_tokens=12, temperature=0),
        Request(prompt=prompts[1], max_new_tokens=12, temperature=0.8, top_k=5, seed=1),
        Request(prompt=prompts[2], max_new_tokens=12, temperature=0),  # 20 + 12 passes block 24: the row slides
        Request(prompt=prompts[0], max_new_tokens=12, temperature=1.0, seed=2),
        Request(prompt=prompts[1], max_new_tokens=12, temperature=0.9, seed=3, frequency_penalty=0.5),
        Request(prompt=prompts[2], max_new_tokens=12, temperature=0, logprobs=2),
    ]


@pytest.mark.parametrize("backend", ["eager", "native", "onednn"])
def test_the_engine_runs_every_kind_of_request_through_each_backend(backend, monkeypatch):
    """Six requests through three slots (rows join and leave, of different lengths, some sharing settings and some
    not): each backend gives the greedy rows the plain model's tokens and every row the eager backend's tokens and
    log-probabilities, the seeded sampled rows included (a backend that samples inside its step draws with the
    numbers the engine's own sampling would)."""
    model = lively_model(seed=4, block_size=24)
    reference = plain_copy(model)
    expected = requests_of_every_kind()
    list(Engine(plain_copy(model), slots=3, decode="eager").run(expected))
    requests = requests_of_every_kind()
    list(engine_on(backend, model, 3, monkeypatch).run(requests))
    assert [request.output for request in requests] == [request.output for request in expected]
    for request in (requests[0], requests[2], requests[5]):
        assert request.output == reference_greedy(reference, request.prompt, 12)
    logprobs = [entry.logprob for entry in requests[5].token_logprobs]
    assert logprobs == pytest.approx([entry.logprob for entry in expected[5].token_logprobs], abs=1e-5)
