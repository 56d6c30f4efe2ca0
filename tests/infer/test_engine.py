"""gptkit/infer/engine.py, gptkit/infer/onednn.py and gptkit/infer/compiled.py: KV cache rows, the step-based engine,
the CPU fast path, the compiled step (decode=compiled), and the model it leaves untouched.

Expected tokens come from helpers.reference_greedy: a full forward pass of the plain model (no cache) over the window
each step should see, written out there from the rule.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch.nn import functional as F

from gptkit.infer import compiled as compiled_decoding
from gptkit.infer.compiled import decode_step
from gptkit.infer.engine import Engine, GenerationError, KVCache, Request, generate, generate_stream
from gptkit.infer.native import build as native_build
from gptkit.infer.onednn import DecodingLinear, onednn_linear_available, optimize_for_cpu_decoding
from gptkit.model import GPT
from gptkit.train.optim import configure_optimizers
from helpers import lively_model, overflowing_model, plain_copy, reference_greedy, step_with_dynamos_eager_backend

POSITIONS = ["learned", "sinusoidal", "rope"]
VOCAB = 37


def run_alone(model: GPT, request: Request) -> list[int]:
    engine = Engine(model, slots=1)
    for _ in engine.run([request]):
        pass
    return request.output


def prompts_of(*lengths: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


# ----------------------------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("pos_encoding", POSITIONS)
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_cache_rows_of_different_lengths_give_each_row_its_own_logits(pos_encoding, attention):
    """Two rows at lengths 3 and 7 step together through a masked pass; each equals its own full forward."""
    model = lively_model(pos_encoding=pos_encoding, attention=attention)
    short, long = prompts_of(8, 12)
    cache = KVCache(model.config.n_layer, model.config.block_size, slots=2)
    with torch.no_grad():
        model(torch.tensor([short[:3]]), cache=cache.rows(0, 1))
        model(torch.tensor([long[:7]]), cache=cache.rows(1, 2))
        for step in range(5):
            idx = torch.tensor([[short[3 + step]], [long[7 + step]]])
            logits, _ = model(idx, cache=cache)
            for row, tokens in enumerate((short[: 4 + step], long[: 8 + step])):
                full, _ = model(torch.tensor([tokens]))
                torch.testing.assert_close(logits[row, -1], full[0, -1], rtol=0, atol=1e-5)
    assert cache.lengths == [8, 12]


def test_cache_refuses_to_pass_its_capacity_and_a_batch_of_the_wrong_size():
    model = lively_model()
    cache = KVCache(model.config.n_layer, 16, slots=2)
    with torch.no_grad(), pytest.raises(ValueError, match="longer than the cache"):
        model(torch.zeros(2, 17, dtype=torch.long), cache=cache)
    with torch.no_grad(), pytest.raises(ValueError, match="a batch of 1 rows"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)


def test_moving_a_row_keeps_its_continuation():
    model = lively_model()
    (prompt,) = prompts_of(9)
    cache = KVCache(model.config.n_layer, 16, slots=3)
    with torch.no_grad():
        model(torch.tensor([prompt[:-1]]), cache=cache.rows(2, 3))
        cache.move(2, 0)
        logits, _ = model(torch.tensor([prompt[-1:]]), cache=cache.rows(0, 1))
        full, _ = model(torch.tensor([prompt]))
    torch.testing.assert_close(logits[0, -1], full[0, -1], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("pos_encoding", POSITIONS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_cached_greedy_equals_uncached_recompute(pos_encoding, qk_norm):
    model = lively_model(pos_encoding=pos_encoding, qk_norm=qk_norm)
    reference = plain_copy(model)
    prompt = torch.tensor(prompts_of(5, 5))
    out = generate(model, prompt, max_new_tokens=30, temperature=0)  # the default call: decode=auto
    for row in range(2):
        expected = reference_greedy(reference, prompt[row].tolist(), 30)
        assert out[row, 5:].tolist() == expected
        assert len(set(expected)) > 4  # the test model really changes tokens
    plain = generate_stream(reference, prompt, 30, temperature=0, decode="eager")
    assert torch.equal(torch.stack(list(plain), dim=1), out[:, 5:])
    assert type(reference.lm_head) is torch.nn.Linear  # decode=eager leaves the model alone


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_different_length_batch_gives_each_row_its_alone_greedy_tokens(attention, pos_encoding):
    """Prompts of 3, 9 and 14 tokens, block 16, 40 new tokens: every row slides, each at its own step."""
    model = lively_model(attention=attention, pos_encoding=pos_encoding)
    reference = plain_copy(model)
    prompts = prompts_of(3, 9, 14)
    requests = [Request(prompt=prompt, max_new_tokens=40, temperature=0) for prompt in prompts]
    engine = Engine(model, slots=3)
    steps = list(engine.run(requests))
    assert len(steps) == 40 and [len(step) for step in steps] == [3] * 40
    for prompt, request in zip(prompts, requests):
        assert request.output == reference_greedy(reference, prompt, 40)
        assert request.finish_reason == "length"
    assert not engine.active and engine.free_slots == 3


@pytest.mark.parametrize("onednn", [True, False])
def test_the_head_runs_once_per_made_token(onednn):
    """Filling the cache with a prompt (and refilling it when the window slides) computes no logits: the head
    turns exactly one position into logits per token made, and the tokens are still the plain model's."""
    model, prompt = lively_model(), prompts_of(10)[0]
    if onednn:
        optimize_for_cpu_decoding(model)
    engine = Engine(model, slots=1, decode="eager")
    head_rows = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: head_rows.append(inputs[0].shape[:2].numel()))
    request = Request(
        prompt=prompt, max_new_tokens=12, temperature=0
    )  # 10 + 12 tokens pass block_size 16: the window slides once
    list(engine.run([request]))
    assert request.output == reference_greedy(plain_copy(model), prompt, 12)
    assert head_rows == [1] * 12


def test_seeded_requests_draw_the_same_tokens_alone_and_batched():
    model = lively_model(seed=1)
    prompts = prompts_of(2, 11, 6)
    settings = [dict(temperature=0.9, top_k=10), dict(temperature=1.2, top_p=0.9), dict(temperature=0.7)]

    def requests() -> list[Request]:
        return [
            Request(prompt=p, max_new_tokens=30, seed=100 + i, **s) for i, (p, s) in enumerate(zip(prompts, settings))
        ]

    alone = [run_alone(model, request) for request in requests()]
    batched = requests()
    for _ in Engine(model, slots=3).run(batched):
        pass
    assert [request.output for request in batched] == alone
    again = requests()[0]
    assert run_alone(model, again) == alone[0]
    assert run_alone(model, Request(prompt=prompts[0], max_new_tokens=30, seed=7, **settings[0])) != alone[0]


def test_a_stop_token_ends_one_row_while_the_others_go_on():
    model = lively_model(seed=2)
    reference = plain_copy(model)
    prompts = prompts_of(4, 7, 10)
    free = [reference_greedy(reference, prompt, 20) for prompt in prompts]
    stop = next(token for token in free[0][3:] if all(token not in tokens for tokens in free[1:]))
    first = free[0].index(stop)  # row 0 stops there; rows 1 and 2 never make the token
    assert first < 15
    requests = [Request(prompt=prompt, max_new_tokens=20, temperature=0, stop_tokens=[stop]) for prompt in prompts]
    steps = list(Engine(model, slots=3).run(requests))
    assert requests[0].output == free[0][: first + 1] and requests[0].finish_reason == "stop"
    assert [r.output for r in requests[1:]] == free[1:]
    assert [len(step) for step in steps] == [3] * (first + 1) + [2] * (20 - first - 1)


def test_requests_join_and_leave_a_running_batch():
    model = lively_model(seed=3)
    reference = plain_copy(model)
    a, b, c = (Request(prompt=p, max_new_tokens=30, temperature=0) for p in prompts_of(5, 12, 2))
    engine = Engine(model, slots=3)
    engine.add(a)
    engine.add(b)
    for _ in range(6):
        engine.step()
    engine.add(c)  # prefilled on its own while a and b are 6 tokens in
    for _ in range(4):
        engine.step()
    engine.remove(a)  # c moves into a's row
    assert b.finish_reason is None and a.finish_reason == "removed" and engine.active == [c, b]
    while engine.active:
        engine.step()
    assert a.output == reference_greedy(reference, a.prompt, 10)
    assert b.output == reference_greedy(reference, b.prompt, 30)
    assert c.output == reference_greedy(reference, c.prompt, 30)


def test_run_queues_more_requests_than_slots():
    model = lively_model(seed=4)
    reference = plain_copy(model)
    requests = [
        Request(prompt=p, max_new_tokens=n, temperature=0) for p, n in zip(prompts_of(3, 6, 9, 4), (5, 12, 7, 3))
    ]
    for step in Engine(model, slots=2).run(requests):
        assert len(step) <= 2
    assert [r.output for r in requests] == [reference_greedy(reference, r.prompt, r.max_new_tokens) for r in requests]


def test_engine_refuses_bad_requests_and_a_full_batch():
    engine = Engine(lively_model(), slots=1)
    for bad in (
        Request(prompt=[], max_new_tokens=3),
        Request(prompt=[1], max_new_tokens=-1),
        Request(prompt=[1], max_new_tokens=3, temperature=-1.0),
        Request(prompt=[1], max_new_tokens=3, top_k=0),
        Request(prompt=[1], max_new_tokens=3, top_p=1.5),
        Request(prompt=[1], max_new_tokens=3, seed=1, generator=torch.Generator()),
    ):
        with pytest.raises(ValueError):
            engine.add(bad)
    engine.add(Request(prompt=[1, 2], max_new_tokens=3))
    with pytest.raises(RuntimeError, match="slots are busy"):
        engine.add(Request(prompt=[1], max_new_tokens=3))
    nothing = Request(prompt=[1], max_new_tokens=0)
    engine.add(nothing)  # nothing to make: finished at once, no row taken
    assert nothing.finish_reason == "length" and len(engine.active) == 1


def test_generate_past_block_size_and_the_stream_agree():
    model = lively_model(pos_encoding="rope")
    prompt = torch.tensor(prompts_of(20, 20))  # longer than the context: its last 16 tokens are used
    out = generate(model, prompt, max_new_tokens=40, temperature=0)
    assert out.shape == (2, 60) and torch.equal(out[:, :20], prompt)
    steps = list(generate_stream(model, prompt, max_new_tokens=40, temperature=0))
    assert torch.equal(torch.stack(steps, dim=1), out[:, 20:])
    assert out[0, 20:].tolist() == reference_greedy(plain_copy(model), prompt[0].tolist(), 40)
    assert torch.equal(generate(model, prompt, 0), prompt)


@pytest.mark.parametrize("decode", ["eager", "native"])
def test_an_engine_told_how_far_its_rows_go_holds_that_many_positions(decode):
    """Engine(positions=9) on a 16-token context: a cache of 9 positions, a request of 5 prompt tokens and 4 new
    ones gets its reference greedy tokens, one of 5 and 5 is refused; 20 positions (past the context) keep 16."""
    model = lively_model()
    engine = Engine(model, slots=2, decode=decode, positions=9)
    assert engine.cache.capacity == 9
    prompt = prompts_of(5)[0]
    request = Request(prompt=prompt, max_new_tokens=4, temperature=0)
    list(engine.run([request]))
    assert request.output == reference_greedy(plain_copy(model), prompt, 4)
    with pytest.raises(ValueError, match="reaching 10 positions, past the engine's 9"):
        engine.add(Request(prompt=prompt, max_new_tokens=5, temperature=0))
    assert Engine(model, slots=2, decode=decode, positions=20).cache.capacity == 16


def test_generate_stop_tokens_repeat_in_stopped_rows():
    model = lively_model(seed=5)
    prompt = torch.tensor(prompts_of(3, 3))
    free = generate(model, prompt, 12, temperature=0)
    stop = free[0, 6].item()
    first = [(row[3:] == stop).nonzero() for row in free]
    stopped = generate(model, prompt, 12, temperature=0, stop_tokens=[stop])
    ends = [int(f[0]) + 3 if len(f) else free.shape[1] - 1 for f in first]
    assert stopped.shape[1] == max(ends) + 1
    for row, end in enumerate(ends):
        assert torch.equal(stopped[row, : end + 1], free[row, : end + 1])
        assert (stopped[row, end + 1 :] == stop).all()


def test_seeded_generate_is_reproducible():
    model = lively_model()
    prompt = torch.tensor(prompts_of(3, 3))
    a = generate(model, prompt, 10, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(7))
    b = generate(model, prompt, 10, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- CPU fast path


@pytest.mark.parametrize("bias", [True, False])
def test_fast_path_changes_speed_not_results(bias):
    model = lively_model(seed=6, bias=bias, tie_embeddings=True)
    plain = plain_copy(model)
    keys = list(model.state_dict())
    optimize_for_cpu_decoding(model)
    optimize_for_cpu_decoding(model)  # idempotent
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert list(model.state_dict()) == keys
    fc = model.transformer.h[0].mlp.c_fc
    assert isinstance(fc, DecodingLinear) and fc.weight.stride() == (1, 128)  # (in, out) contiguous in memory
    assert fc.onednn == onednn_linear_available()
    prompt = torch.tensor(prompts_of(4, 4))
    with torch.no_grad():
        torch.testing.assert_close(model(prompt)[0], plain(prompt)[0], rtol=0, atol=1e-5)
    expected = torch.stack(list(generate_stream(plain, prompt, 20, temperature=0, decode="eager")), dim=1)
    assert torch.equal(generate(model, prompt, 20, temperature=0)[:, 4:], expected)


def model_state(model: GPT) -> list[tuple[str, type, int, torch.Size, tuple[int, ...], torch.Tensor]]:
    """Everything of `model` an engine could change: each module's class, each parameter's and buffer's object, shape,
    memory layout (strides) and values."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    state = [(name, type(module), 0, torch.Size(), (), torch.empty(0)) for name, module in model.named_modules()]
    return state + [(name, type(t), id(t), t.shape, t.stride(), t.detach().clone()) for name, t in tensors]


def assert_same_state(before: list, after: list) -> None:
    assert [entry[:5] for entry in before] == [entry[:5] for entry in after]
    for entry_before, entry_after in zip(before, after):
        assert torch.equal(entry_before[5], entry_after[5]), entry_before[0]


@pytest.mark.parametrize("native_built", [True, False])
@pytest.mark.parametrize("rows", [1, 4])
def test_the_default_generate_call_never_changes_the_callers_model(monkeypatch, native_built, rows):
    """generate (decode=auto) at one row and at four, with the native step built and without it (then four rows
    decode through oneDNN's direct kernel, in a copy): the caller's model keeps its modules, parameter objects, memory
    layout and values, and the tokens are the plain model's."""
    model = lively_model(seed=7, pos_encoding="rope")
    if not native_built:
        monkeypatch.setattr(native_build, "is_built", lambda: False)
    before = model_state(model)
    prompt = torch.tensor(prompts_of(*[4] * rows))
    with torch.profiler.profile() as profile:
        out = generate(model, prompt, 6, temperature=0)
    assert_same_state(before, model_state(model))
    calls = {event.name for event in profile.events()}
    if not native_built and rows > 1 and onednn_linear_available():
        assert "mkldnn::_linear_pointwise" in calls  # the direct kernel really ran
    for row in range(rows):
        assert out[row, 4:].tolist() == reference_greedy(plain_copy(model), prompt[row].tolist(), 6)


@pytest.mark.parametrize("decode", ["eager", "native"])
def test_a_model_in_training_mode_decodes_without_dropout_and_stays_in_it(decode: str):
    """A fresh GPT is in training mode: generate decodes it as in eval mode (every backend the same greedy tokens,
    none with dropout's noise) and gives it back in training mode."""
    model = lively_model(seed=3, dropout=0.5).train()
    prompt = torch.tensor(prompts_of(4))
    out = generate(model, prompt, 8, temperature=0, decode=decode)
    assert model.training and all(module.training for module in model.modules())
    assert out[0, 4:].tolist() == reference_greedy(plain_copy(model).eval(), prompt[0].tolist(), 8)


def test_the_decoding_copy_follows_a_changed_model(monkeypatch):
    """The oneDNN copy (decode=auto's rows where the native step is not built) is made once per model and again
    after a weight changes in place (an optimizer step): the next generate decodes with the new weights."""
    monkeypatch.setattr(native_build, "is_built", lambda: False)
    model, other = lively_model(seed=8, pos_encoding="rope"), lively_model(seed=9, pos_encoding="rope")
    prompt = torch.tensor(prompts_of(3, 3))
    generate(model, prompt, 2)
    model.load_state_dict(other.state_dict())
    out = generate(model, prompt, 8, temperature=0)
    for row in range(2):
        assert out[row, 3:].tolist() == reference_greedy(plain_copy(other), prompt[row].tolist(), 8)


def test_training_still_works_after_the_fast_path():
    model, plain = lively_model(seed=8), lively_model(seed=8)
    optimize_for_cpu_decoding(model)
    model.train()
    idx = torch.randint(0, VOCAB, (2, 16))
    for net in (model, plain):
        _, loss = net(idx, idx)
        loss.backward()
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    optimizer = configure_optimizers(model, 0.1, 1e-2, (0.9, 0.95), "cpu")
    before = model.lm_head.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model.lm_head.weight)
    _, after = model(idx, idx)
    assert after.item() < loss.item()


def test_compiled_model_after_the_fast_path():
    """torch.compile cannot lower the direct oneDNN call, so a compiled model must trace F.linear instead."""
    model = optimize_for_cpu_decoding(lively_model(seed=2, n_layer=1))
    prompt = torch.tensor(prompts_of(6, 6))
    with torch.no_grad():
        expected, _ = model(prompt)
        compiled, _ = torch.compile(model)(prompt)
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_linear_available(), reason="needs oneDNN on an x86 CPU")
@pytest.mark.parametrize("shape", [(3, 48), (2, 5, 48), (1, 1, 48)])
def test_decoding_linear_matches_f_linear(shape):
    torch.manual_seed(0)
    layer = optimize_for_cpu_decoding(torch.nn.Sequential(torch.nn.Linear(48, 40)))[0]
    x = torch.randn(*shape)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        strided = torch.randn(*shape[:-1], 96)[..., ::2]  # a view with gaps between its elements
        torch.testing.assert_close(layer(strided), F.linear(strided, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    y = layer(x)  # with gradients on (training), the module stays on F.linear and autograd works
    y.sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((40,), float(x[..., 0].numel())))


# ------------------------------------------------------------------------------ the compiled decoding step


# The compiled step's test models: one layer, since a graph's compile time grows with the layers and nothing these
# tests check (spans, guards, sampling inside the graph, graph counts) needs a second.
STEP_MODEL = dict(block_size=40, pos_encoding="rope", n_layer=1)


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@dataclasses.dataclass(kw_only=True)
class CompiledGreedyRun:
    model: GPT
    reference: GPT  # the same weights in a plain model, copied before the run
    requests: list[Request]
    step_sizes: list[int]  # rows in each step the engine yielded
    new_graphs: int


@pytest.fixture(scope="module")
def compiled_greedy() -> CompiledGreedyRun:
    """One compiled greedy run of 4 slots: rows of 1, 9 and 26 tokens, block 40, 30 new tokens each. Each inductor
    graph of the step takes many seconds to compile, so the tests below reuse this model and its graph (batch 4,
    greedy) where their checks allow it."""
    model = lively_model(**STEP_MODEL)
    reference = plain_copy(model)
    requests = [Request(prompt=prompt, max_new_tokens=30, temperature=0) for prompt in prompts_of(1, 9, 26)]
    graphs_before = unique_graphs()
    step_sizes = [len(step) for step in Engine(model, slots=4, decode="compiled").run(requests)]
    new_graphs = unique_graphs() - graphs_before
    return CompiledGreedyRun(
        model=model, reference=reference, requests=requests, step_sizes=step_sizes, new_graphs=new_graphs
    )


@pytest.mark.heavy  # inductor compiles (the fast tier would make the fixture, then skip)
def test_compiled_steps_give_each_row_its_greedy_tokens_from_one_graph(compiled_greedy):
    """gptkit/infer/compiled.py: rows of 1, 9 and 26 tokens (the first with no prefill, so the step makes the
    cache itself), block 40, 30 new tokens: the attended span grows 16 -> 32 -> 40 and the last row slides. Every row
    gets exactly its reference greedy tokens, and one compiled graph serves every span. The engine has 4 slots, so the
    step runs 4 rows, the fourth a padding row that changes nothing."""
    assert compiled_greedy.step_sizes == [3] * 30
    assert compiled_greedy.new_graphs == 1
    for request in compiled_greedy.requests:
        assert request.output == reference_greedy(compiled_greedy.reference, request.prompt, 30)


def test_each_model_gets_a_graph_of_its_own_told_apart_by_one_weights_identity(monkeypatch):
    """The compiled step checks one weight's identity in place of every module's guards, so that each graph, which
    holds its model's frozen weights, serves that model alone: two models of the same shapes (and a third made after
    the second is freed, which may reuse its memory) each get a graph of their own and their own greedy tokens,
    whichever ran last. Through dynamo's eager backend with the step's own guard filter: the guards are dynamo's,
    whatever the backend (that a graph inductor compiles holds its own model's weights, a second model's too, is
    tests/weights/test_quantization.py's compiled bfloat16 check)."""
    step_with_dynamos_eager_backend(monkeypatch)
    first, second = lively_model(**STEP_MODEL), lively_model(**STEP_MODEL, seed=2)
    prompts = prompts_of(1, 9, 26)
    expected = {
        model: [reference_greedy(plain_copy(model), prompt, 12) for prompt in prompts] for model in (first, second)
    }
    assert expected[first] != expected[second]
    for model, new_graphs in ((first, 1), (second, 1), (first, 0)):
        graphs_before = unique_graphs()
        assert greedy_compiled_outputs(model, prompts, 12) == expected[model]
        assert unique_graphs() - graphs_before == new_graphs
    del expected, second
    gc.collect()
    third = lively_model(**STEP_MODEL, seed=3)
    reference = plain_copy(third)
    graphs_before = unique_graphs()
    assert greedy_compiled_outputs(third, prompts, 12) == [reference_greedy(reference, p, 12) for p in prompts]
    assert unique_graphs() - graphs_before == 1


def greedy_compiled_outputs(model: GPT, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from a compiled engine of 4 slots (so a step of 4 rows: compiled_greedy's batch)."""
    requests = [Request(prompt=prompt, max_new_tokens=new_tokens, temperature=0) for prompt in prompts]
    list(Engine(model, slots=4, decode="compiled").run(requests))
    return [request.output for request in requests]


@pytest.mark.heavy
def test_compiled_steps_sample_the_tokens_of_eager_steps(compiled_greedy):
    """Sampling happens inside the compiled graph, with uniform numbers drawn as the eager path draws them: seeded
    requests (a generator per row, or one generator shared by the rows) get the eager engine's tokens. One graph per
    top_k; a new temperature needs none, even after a greedy graph (which, with the temperature a Python float,
    made dynamo specialize it); top-p, which stays eager, runs on the greedy graph's logits. (The greedy graph is
    compiled_greedy's: no new one.)"""
    model, reference = compiled_greedy.model, compiled_greedy.reference
    prompts = prompts_of(1, 9, 26)
    greedy = [reference_greedy(reference, prompt, 20) for prompt in prompts]
    cases = [
        ((0.0, None, None), "seeds", 0),
        ((1.0, 5, None), "seeds", 1),
        ((0.7, None, None), "seeds", 1),
        ((0.9, None, None), "shared", 0),
        ((1.0, 5, 0.8), "seeds", 0),
    ]
    for (temperature, top_k, top_p), draws, new_graphs in cases:
        outputs = {}
        graphs_before = unique_graphs()
        for engine_model, compiled in ((model, True), (reference, False)):
            shared = torch.Generator().manual_seed(4)
            requests = [
                Request(
                    prompt=prompt,
                    max_new_tokens=20,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    seed=row if draws == "seeds" else None,
                    generator=shared if draws == "shared" else None,
                )
                for row, prompt in enumerate(prompts)
            ]
            list(Engine(engine_model, slots=4, decode="compiled" if compiled else "eager").run(requests))
            outputs[compiled] = [request.output for request in requests]
        assert outputs[True] == outputs[False] and (outputs[True] == greedy) == (temperature == 0)
        assert unique_graphs() - graphs_before == new_graphs


def test_compiled_rows_of_different_settings_each_sample_as_eager_rows_do(monkeypatch):
    """One greedy row beside seeded rows at their own temperatures and top-k: each row gets the eager engine's
    tokens, so no row's settings stand in for another's."""
    step_with_dynamos_eager_backend(monkeypatch)
    model = lively_model(block_size=40, n_layer=1)
    prompts = prompts_of(1, 9, 26)
    settings = [(0.0, None), (1.0, 5), (0.8, None)]
    outputs = {}
    for decode in ("compiled", "eager"):
        requests = [
            Request(prompt=prompt, max_new_tokens=20, temperature=temperature, top_k=top_k, top_p=None, seed=row)
            for row, (prompt, (temperature, top_k)) in enumerate(zip(prompts, settings))
        ]
        list(Engine(plain_copy(model), slots=3, decode=decode).run(requests))
        outputs[decode] = [request.output for request in requests]
    greedy = [reference_greedy(plain_copy(model), prompt, 20) for prompt in prompts]
    assert outputs["compiled"] == outputs["eager"]
    assert [out == best for out, best in zip(outputs["compiled"], greedy)] == [True, False, False]


def test_the_compiled_step_holds_more_graphs_than_dynamos_default_limit(monkeypatch):
    """Every model (as every batch size and top_k) is a graph of its own, and past dynamo's default of 8 graphs a
    function, fullgraph=True made the next one a hard error. The step's own limit lets a process hold more; other
    compiled functions keep the default."""
    step_with_dynamos_eager_backend(monkeypatch)
    prompt = prompts_of(5)[0]
    graphs_before = unique_graphs()
    for seed in range(9):  # the ninth graph is one past the default
        model = lively_model(seed=seed, n_layer=1)
        request = Request(prompt=prompt, max_new_tokens=3, temperature=0)
        list(Engine(model, decode="compiled").run([request]))
        assert request.output == reference_greedy(plain_copy(model), prompt, 3)
    assert unique_graphs() - graphs_before == 9


def test_building_the_step_leaves_its_options_whole():
    """torch.compile takes the guard filter out of the options it is given: the step gives it a copy, so the declared
    options of every device keep the filter for any later build (after compiled_step's cache is cleared, say)."""
    for device_type in ("cpu", "cuda", "mps"):
        compiled_decoding.compiled_step(device_type)
    for options in (
        compiled_decoding.CPU_COMPILE_OPTIONS,
        compiled_decoding.CUDA_COMPILE_OPTIONS,
        compiled_decoding.STEP_COMPILE_OPTIONS,
    ):
        assert options["guard_filter_fn"] is compiled_decoding.model_identity_guards


def test_the_step_sets_freezing_and_its_graph_limit_for_its_own_call_only(monkeypatch):
    """Freezing and the step's graph limit hold while the step runs (dynamo and inductor read them when it compiles),
    and the process's own values come back after it, also when the step raises."""
    seen = []

    def failing_step(*args):
        seen.append((torch._inductor.config.freezing, torch._dynamo.config.recompile_limit))
        raise RuntimeError("the step failed")

    monkeypatch.setattr(compiled_decoding, "compiled_step", lambda device_type: failing_step)
    model = lively_model()
    cache = KVCache(model.config.n_layer, model.config.block_size)
    monkeypatch.setattr(torch._inductor.config, "freezing", False)  # the process's own values, set by the test
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 5)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the step failed"):
            decode_step(model, torch.tensor([[1]]), cache.keys, cache.values, cache.lengths, cache.capacity)
        assert (torch._inductor.config.freezing, torch._dynamo.config.recompile_limit) == (False, 5)
    assert seen == [(True, compiled_decoding.STEP_GRAPH_LIMIT)] * 2


def test_a_step_called_in_grad_mode_keeps_the_cache_out_of_autograd(monkeypatch):
    step_with_dynamos_eager_backend(monkeypatch)
    model = lively_model()
    config = model.config
    cache = KVCache(config.n_layer, config.block_size)
    cache.allocate(config.n_head, config.n_embd // config.n_head, torch.float32, torch.device("cpu"))
    assert torch.is_grad_enabled()
    logits, token = decode_step(model, torch.tensor([[7]]), cache.keys, cache.values, [0], cache.capacity)
    assert not logits.requires_grad and not any(t.requires_grad for t in cache.keys + cache.values)
    with torch.no_grad():
        expected, _ = plain_copy(model)(torch.tensor([[7]]))
    torch.testing.assert_close(logits[:, -1], expected[:, -1])
    assert token.tolist() == [int(expected[0, -1].argmax())]


def test_a_sampled_compiled_step_needs_its_uniform_numbers():
    model = lively_model()
    cache = KVCache(model.config.n_layer, model.config.block_size)
    with pytest.raises(ValueError, match="uniform numbers"):
        decode_step(model, torch.tensor([[1]]), cache.keys, cache.values, cache.lengths, cache.capacity, 1.0, 5)


def test_the_compiled_step_leaves_the_models_attention_alone(monkeypatch):
    """The compiled step runs math attention in a twin of the model that shares its very parameters: the user's
    model still computes with its own path afterwards, and the twin reads weights changed in the model."""
    step_with_dynamos_eager_backend(monkeypatch)
    model = lively_model(attention="sdpa")
    prompt = prompts_of(5)[0]
    request = Request(prompt=prompt, max_new_tokens=6, temperature=0)
    list(Engine(model, decode="compiled").run([request]))
    assert request.output == reference_greedy(plain_copy(model), prompt, 6)
    assert {block.attn.path for block in model.transformer.h} == {"sdpa"}
    twin = compiled_decoding.math_attention_twin(model)
    assert {block.attn.path for block in twin.transformer.h} == {"math"}
    assert all(a is b for a, b in zip(twin.parameters(), model.parameters()))
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)  # in place: the twin must see it
    request = Request(prompt=prompt, max_new_tokens=6, temperature=0)
    list(Engine(model, decode="compiled").run([request]))
    assert request.output == reference_greedy(plain_copy(model), prompt, 6)


@pytest.mark.parametrize(
    "rows, slots, expected",
    [(1, 16, 1), (2, 16, 2), (3, 16, 4), (5, 16, 8), (8, 16, 8), (9, 16, 16), (16, 16, 16), (9, 12, 12), (3, 3, 3)],
)
def test_a_compiled_step_runs_the_next_power_of_two_rows_within_the_slots(rows, slots, expected):
    assert compiled_decoding.padded_batch(rows, slots) == expected


# ----------------------------------------------------------------------------- logit rules and log-probabilities


def reference_with_rules(model: GPT, prompt: list[int], steps: int, presence=0.0, frequency=0.0, bias=None):
    """Greedy tokens and each one's raw log-probability and top-3, by full passes of the plain model in float64, with
    OpenAI's rule written out: logit[t] + bias[t] - frequency * count[t] - presence * (count[t] > 0)."""
    tokens, made, logprobs, tops = list(prompt), [], [], []
    with torch.no_grad():
        for _ in range(steps):
            logits, _ = model(torch.tensor([tokens]), torch.zeros(1, len(tokens), dtype=torch.long))
            raw = logits[0, -1].double()
            changed = raw.clone()
            for token, value in (bias or {}).items():
                changed[token] += value
            for token in set(made):
                changed[token] -= frequency * made.count(token) + presence
            best_two = changed.topk(2).values
            assert best_two[0] - best_two[1] > 1e-4, "a near tie: pick another prompt"
            token = int(changed.argmax())
            log_softmax = raw - torch.logsumexp(raw, dim=0)
            logprobs.append(float(log_softmax[token]))
            tops.append([(int(i), float(log_softmax[i])) for i in log_softmax.topk(3).indices])
            made.append(token)
            tokens.append(token)
    return made, logprobs, tops


@pytest.mark.parametrize("decode", ["eager", "compiled", "native"])
def test_penalties_bias_and_logprobs_follow_openais_rule(decode, monkeypatch):
    """Greedy with presence and frequency penalties and a logit bias, against the rule computed in float64; each
    token's log-probability and top 3 are the raw model's. In a batch beside a plain request, which keeps its own
    tokens. (The compiled step runs through dynamo's eager backend: the same graph and logits path, no inductor.)"""
    if decode == "compiled":
        step_with_dynamos_eager_backend(monkeypatch)
    model = lively_model()
    reference = plain_copy(model)
    prompt, plain_prompt = prompts_of(5, 4, seed=3)
    rules = {"presence": 0.4, "frequency": 0.9, "bias": {3: 2.0, 7: -100.0}}
    expected, logprobs, tops = reference_with_rules(reference, prompt, 9, **rules)
    request = Request(
        prompt=prompt,
        max_new_tokens=9,
        temperature=0,
        presence_penalty=0.4,
        frequency_penalty=0.9,
        logit_bias={3: 2.0, 7: -100.0},
        logprobs=3,
    )
    plain = Request(prompt=plain_prompt, max_new_tokens=9, temperature=0)
    batch = [request] if decode == "native" else [request, plain]  # the native step runs one row
    for _ in Engine(model, slots=len(batch), decode=decode).run(batch):
        pass
    assert request.output == expected and 7 not in request.output
    assert [entry.token for entry in request.token_logprobs] == expected
    assert [entry.logprob for entry in request.token_logprobs] == pytest.approx(logprobs, abs=1e-5)
    for entry, top in zip(request.token_logprobs, tops):
        assert [token for token, _ in entry.top] == [token for token, _ in top]
        assert [value for _, value in entry.top] == pytest.approx([value for _, value in top], abs=1e-5)
    if decode != "native":
        assert plain.output == reference_greedy(reference, plain_prompt, 9)


def test_a_large_bias_forces_a_token_and_sampling_draws_from_the_changed_logits():
    model = lively_model()
    forced = Request(prompt=prompts_of(4)[0], max_new_tokens=6, temperature=1.0, seed=5, logit_bias={11: 100.0})
    banned = Request(
        prompt=prompts_of(4)[0],
        max_new_tokens=40,
        temperature=1.0,
        seed=5,
        logit_bias={t: -100.0 for t in range(0, VOCAB, 2)},
    )
    for _ in Engine(model, slots=2).run([forced, banned]):
        pass
    assert forced.output == [11] * 6
    assert all(token % 2 == 1 for token in banned.output)


def test_prompt_logprobs_score_every_token_after_the_first():
    model = lively_model()
    reference = plain_copy(model)
    (prompt,) = prompts_of(10, seed=4)
    scored = Engine(model, slots=1).prompt_logprobs(prompt, top=2)
    with torch.no_grad():
        logits, _ = reference(torch.tensor([prompt]), torch.zeros(1, len(prompt), dtype=torch.long))
    log_softmax = logits[0].double().log_softmax(-1)
    assert [entry.token for entry in scored] == prompt
    assert scored[0].logprob is None and scored[0].top == []
    expected = [float(log_softmax[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert [entry.logprob for entry in scored[1:]] == pytest.approx(expected, abs=1e-5)
    assert [[t for t, _ in e.top] for e in scored[1:]] == log_softmax[:-1].topk(2).indices.tolist()


def test_bad_logit_rules_are_refused():
    model = lively_model()
    engine = Engine(model, slots=1)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.add(Request(prompt=[1, 2], max_new_tokens=3, logit_bias={VOCAB + 30: 1.0}))
    with pytest.raises(ValueError, match="finite"):
        engine.add(Request(prompt=[1, 2], max_new_tokens=3, presence_penalty=float("nan")))
    for logprobs in (-1, True, 2.0, VOCAB + 1):
        with pytest.raises(ValueError, match="logprobs"):
            engine.add(Request(prompt=[1, 2], max_new_tokens=3, logprobs=logprobs))
    for wrong in ({"max_new_tokens": 3.0}, {"max_new_tokens": 3, "top_k": 2.5}, {"max_new_tokens": 3, "top_k": True}):
        with pytest.raises(ValueError, match=r"max_new_tokens must be a whole number|top_k must be a positive integer"):
            engine.add(Request(prompt=[1, 2], **wrong))
    with pytest.raises(ValueError, match="stop_tokens is a list of token ids"):
        engine.add(Request(prompt=[1, 2], max_new_tokens=3, stop_tokens=torch.tensor([1])))


@pytest.mark.parametrize("decode", ["eager", "native"])
def test_a_prompt_token_outside_the_vocabulary_is_refused_before_it_joins(decode: str):
    """A bad id first or last in a prompt: the request never joins (all or none), and the request beside it finishes
    as it would alone."""
    model = lively_model()
    engine = Engine(model, slots=2, decode=decode)
    good = Request(prompt=[1, 2], max_new_tokens=3, temperature=0.0)
    engine.add(good)
    for prompt in ([1, VOCAB], [VOCAB, 1], [-1, 1], [1.5, 1], [True, 1], torch.tensor([1, 2])):
        with pytest.raises(ValueError, match=r"no id of the model's vocabulary|prompt is a list of token ids"):
            engine.add(Request(prompt=prompt, max_new_tokens=3, temperature=0.0))
        assert engine.active == [good]
    list(engine.run([]))
    alone = Request(prompt=[1, 2], max_new_tokens=3, temperature=0.0)
    list(Engine(model, slots=1, decode=decode).run([alone]))
    assert good.output == alone.output and good.finish_reason == "length"
    for idx in (torch.tensor([1, 2]), torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 2]], dtype=torch.uint8)):
        with pytest.raises(ValueError, match=r"idx must be a \(batch, tokens\) tensor of int64 or int32 token ids"):
            generate(model, idx, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
        generate(model, torch.tensor([[1, 2]]), 2.0)  # said at the call, before any decoding
    for stop_tokens in ([1.7], [True], "12", 5):
        with pytest.raises(ValueError, match="stop_tokens is a list of token ids"):
            generate(model, torch.tensor([[1, 2]]), 2, stop_tokens=stop_tokens)
    with pytest.raises(ValueError, match="stop_tokens holds a token outside the model's vocabulary"):
        generate(model, torch.tensor([[1, 2]]), 2, stop_tokens=[-1])


# ----------------------------------------------------------------------------------------------- non-finite logits

OVERFLOWING = 5  # the token after which overflowing_model's logits overflow


@pytest.mark.parametrize("decode", ["eager", "native"])
def test_a_request_whose_logits_overflow_ends_with_an_error_and_its_batch_goes_on(decode):
    """Finite weights whose logits overflow to infinity after one token (helpers.overflowing_model): the request fed
    it ends with finish_reason "error", a reason and no token, while a greedy request (with log-probabilities) and a
    seeded sampled one in the same batch make the tokens they make alone; Engine.run, whose callers want every
    request's tokens, raises GenerationError instead."""
    model = overflowing_model(VOCAB, OVERFLOWING)
    reference = plain_copy(model)
    greedy_prompt, sampled_prompt = [14, 14, 6, 3], [1, 35, 34, 14, 33]
    failing = Request(prompt=[30, 6, 28, OVERFLOWING], max_new_tokens=6, temperature=0)
    greedy = Request(prompt=greedy_prompt, max_new_tokens=6, temperature=0, logprobs=2)
    sampled = Request(prompt=sampled_prompt, max_new_tokens=6, temperature=0.8, seed=3)
    engine = Engine(model, slots=3, decode=decode)
    engine.add_many([failing, greedy, sampled])
    made = []
    while engine.active:
        made += engine.step()
    assert failing.finish_reason == "error" and failing.output == [] and failing not in [r for r, _ in made]
    assert "logits for new token 1 are NaN or infinite" in failing.error
    expected = reference_greedy(reference, greedy_prompt, 6)
    assert OVERFLOWING not in expected  # it would end this request too
    assert greedy.output == expected and greedy.finish_reason == "length" and len(greedy.token_logprobs) == 6
    alone = Request(prompt=sampled_prompt, max_new_tokens=6, temperature=0.8, seed=3)
    list(Engine(model, slots=1, decode=decode).run([alone]))
    assert sampled.output == alone.output and len(alone.output) == 6
    with pytest.raises(GenerationError, match="NaN or infinite"):
        list(
            Engine(model, slots=2, decode=decode).run(
                [Request(prompt=greedy_prompt, max_new_tokens=6), Request(prompt=[2, OVERFLOWING], max_new_tokens=3)]
            )
        )


def test_a_row_left_with_nan_keys_and_values_serves_the_next_requests_cleanly():
    """A token whose embedding (1e20) overflows LayerNorm's variance makes its keys, values and logits NaN. Its
    request ends with an error; the shorter request moved into its row and a longer one added beside it (whose steps
    make the first one read its row's masked positions, where the NaN were) make their reference greedy tokens."""
    model = lively_model()
    with torch.no_grad():
        model.transformer.wte.weight[OVERFLOWING] = 1e20
    reference = plain_copy(model)
    failing = Request(prompt=[1, 2, 3, OVERFLOWING, 6, 7, 8, 9, 10], max_new_tokens=8, temperature=0)
    moved = Request(prompt=[30, 6, 28, 14], max_new_tokens=8, temperature=0)
    later = Request(prompt=[14, 6, 3, 1, 35, 34], max_new_tokens=8, temperature=0)
    engine = Engine(model, slots=2, decode="eager")
    engine.add_many([failing, moved])
    assert engine.step() == [(moved, moved.output[0])] and engine.active == [moved]
    assert failing.finish_reason == "error" and failing.output == []
    engine.add(later)
    while engine.active:
        engine.step()
    assert moved.output == reference_greedy(reference, moved.prompt, 8)
    assert later.output == reference_greedy(reference, later.prompt, 8)
    assert OVERFLOWING not in moved.output + later.output


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_native_step_whose_every_logit_is_nan_ends_the_request_without_a_token(temperature: float):
    """Every logit NaN (a final norm's weight damaged in memory): the native step has no candidate to choose from,
    greedy or sampled over the top k, and the request ends with an error instead of a token (or a crash)."""
    if native_build.build_problem(build=False):
        pytest.skip(native_build.build_problem(build=False))
    model = lively_model()
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(float("nan"))
    request = Request(prompt=[1, 2, 3], max_new_tokens=4, temperature=temperature, top_k=5, seed=1)
    engine = Engine(model, slots=1, decode="native")
    engine.add(request)
    while engine.active:
        engine.step()
    assert request.finish_reason == "error" and request.output == [] and "NaN or infinite" in request.error


def test_prompt_logprobs_of_a_prompt_whose_logits_overflow_are_refused():
    model = overflowing_model(VOCAB, OVERFLOWING)
    engine = Engine(model, slots=1)
    with pytest.raises(GenerationError, match="NaN or infinite"):
        engine.prompt_logprobs([3, OVERFLOWING, 7], top=1)
    assert [entry.token for entry in engine.prompt_logprobs([3, 7, OVERFLOWING], top=1)] == [3, 7, OVERFLOWING]
