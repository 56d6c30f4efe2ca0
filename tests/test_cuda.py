"""The CUDA path: mixed precision, loss scaling, torch.compile, flash attention, fused AdamW, cached decoding and
checkpoints that move between GPU and CPU.

Every test here carries the `cuda` marker: it runs where torch sees a CUDA GPU and is skipped elsewhere. To check
the test code itself on a machine without one, GPU_TESTS_DEVICE=cpu runs the same bodies on the CPU.
`python benchmarks/bench_gpu.py` runs this file first and records its outcome next to the GPU figures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptkit.data import loader
from gptkit.infer.engine import Engine, Request, generate, generate_stream
from gptkit.model import GPT, GPTConfig
from gptkit.train.optim import configure_optimizers
from gptkit.weights.checkpoint import load_checkpoint
from helpers import run_script, tiny_train_args

pytestmark = pytest.mark.cuda

VOCAB = 65


@pytest.fixture
def exact_float32() -> Iterator[None]:
    """Float32 matmuls in full precision (no TF32), so float32 is a reference the other paths are held to."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def small_model(device: torch.device, seed: int = 0, **overrides: object) -> GPT:
    settings = dict(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    return GPT(GPTConfig(**settings)).to(device)


def copy_of(model: GPT, device: torch.device, **overrides: object) -> GPT:
    twin = small_model(device, seed=99, **overrides)  # other weights first, so the copy below is what makes them equal
    twin.load_state_dict(model.state_dict())
    return twin


def random_batch(device: torch.device, batch: int = 8, length: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, length + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def flat_grads(model: GPT) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


def test_bf16_autocast_step_matches_float32(gpu_device: torch.device, exact_float32: None) -> None:
    reference = small_model(gpu_device)
    mixed = copy_of(reference, gpu_device)
    x, y = random_batch(gpu_device)
    _, loss_fp32 = reference(x, y)
    with torch.autocast(device_type=gpu_device.type, dtype=torch.bfloat16):
        _, loss_bf16 = mixed(x, y)
    loss_fp32.backward()
    loss_bf16.backward()
    assert loss_bf16.item() == pytest.approx(loss_fp32.item(), rel=1e-2)
    expected, got = flat_grads(reference), flat_grads(mixed)
    assert torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected) < 0.05
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0) > 0.995


def test_float16_with_loss_scaling_trains_without_nan(gpu_device: torch.device) -> None:
    model = small_model(gpu_device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(gpu_device.type)
    x, y = random_batch(gpu_device)
    losses = []
    for _ in range(40):  # one batch again and again: the loss must fall as the model learns it by heart
        with torch.autocast(device_type=gpu_device.type, dtype=torch.float16):
            _, loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert scaler.get_scale() > 0
    assert losses[-1] < 0.7 * losses[0], losses


def test_compiled_model_equals_eager(gpu_device: torch.device, exact_float32: None) -> None:
    eager = small_model(gpu_device, pos_encoding="rope", qk_norm=True)
    twin = copy_of(eager, gpu_device, pos_encoding="rope", qk_norm=True)
    compiled = torch.compile(twin)
    x, y = random_batch(gpu_device)
    _, loss_eager = eager(x, y)
    _, loss_compiled = compiled(x, y)
    assert loss_compiled.item() == pytest.approx(loss_eager.item(), rel=1e-4)
    loss_eager.backward()
    loss_compiled.backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_flash_attention_equals_explicit_attention(gpu_device: torch.device) -> None:
    """The sdpa path with only the flash kernel allowed (an error if flash cannot run) against softmax(QK^T)V."""
    explicit = small_model(gpu_device, attention="math").to(torch.bfloat16)
    flash = copy_of(explicit, gpu_device, attention="sdpa").to(torch.bfloat16)
    x, y = random_batch(gpu_device)
    logits_explicit, loss_explicit = explicit(x, y)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        logits_flash, loss_flash = flash(x, y)
        loss_flash.backward()
    loss_explicit.backward()
    torch.testing.assert_close(logits_flash.float(), logits_explicit.float(), rtol=2e-2, atol=2e-2)
    expected, got = flat_grads(explicit), flat_grads(flash)
    assert torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected) < 0.03


def test_fused_adamw_equals_plain(gpu_device: torch.device, exact_float32: None) -> None:
    fast = small_model(gpu_device, seed=3)
    plain = copy_of(fast, gpu_device)
    fused = configure_optimizers(fast, 0.1, 1e-2, (0.9, 0.95), gpu_device.type)
    assert fused.defaults["fused"] is True
    groups = [
        {"params": [p for p in plain.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in plain.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    reference = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), foreach=False, fused=False)
    x, y = random_batch(gpu_device)
    for model, optimizer in ((fast, fused), (plain, reference)):
        for _ in range(5):
            _, loss = model(x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for (name, a), (_, b) in zip(fast.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


def trained_char_model(data_dir: Path, device: torch.device, steps: int = 300) -> GPT:
    """A small model trained on tiny Shakespeare's characters until its greedy choices are clear-cut."""
    sampler = loader.BatchSampler(loader.open_split(data_dir, "train"), batch_size=16, block_size=64, seed=0)
    model = small_model(device)
    optimizer = configure_optimizers(model, 0.1, 3e-3, (0.9, 0.99), device.type)
    for index in range(steps):
        x, y = loader.to_device(*sampler.batch(index), device)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


def test_kv_cached_greedy_on_gpu_equals_cpu_greedy(
    gpu_device: torch.device, char_data_dir: Path, exact_float32: None
) -> None:
    on_gpu = trained_char_model(char_data_dir, gpu_device)
    on_cpu = copy_of(on_gpu, torch.device("cpu")).eval()
    prompt = loader.open_split(char_data_dir, "val").read_windows([0], 16)[0].astype("int64")
    idx = torch.from_numpy(prompt)[None]
    with torch.inference_mode():
        tokens_gpu = generate(on_gpu, idx.to(gpu_device), 100, temperature=0.0)[0].tolist()
        tokens_cpu = generate(on_cpu, idx, 100, temperature=0.0)[0].tolist()
    assert tokens_gpu == tokens_cpu
    assert len(set(tokens_gpu[16:])) > 3  # a trained model says something, not one character over and over


def test_compiled_decoding_on_gpu_makes_the_eager_tokens(
    gpu_device: torch.device, char_data_dir: Path, exact_float32: None
) -> None:
    """The compiled step (on CUDA replayed as a CUDA graph, its cache a static input) chooses the eager step's tokens:
    greedy, and sampled with the same seed; past the block's 64 positions (the window slides); and in a second call,
    whose new cache lies elsewhere, so that its graph is recorded again."""
    model = trained_char_model(char_data_dir, gpu_device)
    window = loader.open_split(char_data_dir, "val").read_windows([0], 16)[0].astype("int64")
    prompt = torch.from_numpy(window)[None].to(gpu_device)

    def tokens(compiled: bool, temperature: float) -> list[int]:
        generator = torch.Generator(device=gpu_device).manual_seed(7)
        decode = "compiled" if compiled else "eager"
        with torch.inference_mode():
            stream = generate_stream(
                model, prompt, 80, temperature=temperature, top_k=10, generator=generator, decode=decode
            )
            return [token.item() for token in stream]

    greedy = tokens(False, 0.0)
    assert len(set(greedy)) > 3  # a trained model says something, not one character over and over
    assert tokens(True, 0.0) == greedy
    sampled = tokens(False, 0.8)
    assert sampled != greedy
    assert tokens(True, 0.8) == sampled
    assert tokens(True, 0.8) == sampled  # a new engine: a new cache, the graph recorded at its address


def test_sixteen_requests_batched_by_default_each_make_their_tokens_alone(
    gpu_device: torch.device, char_data_dir: Path, exact_float32: None
) -> None:
    """What serve.py does with 16 concurrent clients: one engine of 16 slots with the default decoding (CUDA graphs
    on a GPU) decodes prompts of different lengths together; each request's greedy tokens are those it makes alone
    through the eager path."""
    model = trained_char_model(char_data_dir, gpu_device)
    windows = loader.open_split(char_data_dir, "val").read_windows(list(range(0, 1600, 100)), 24)
    prompts = [window[: 4 + row].astype("int64").tolist() for row, window in enumerate(windows)]
    batched = [Request(prompt=prompt, max_new_tokens=40, temperature=0.0) for prompt in prompts]
    with torch.inference_mode():
        for _ in Engine(model, slots=16).run(batched):
            pass
        alone = []
        for prompt in prompts:
            request = Request(prompt=prompt, max_new_tokens=40, temperature=0.0)
            for _ in Engine(model, slots=1, decode="eager").run([request]):
                pass
            alone.append(request.output)
    assert [request.output for request in batched] == alone
    assert len({tuple(output) for output in alone}) > 1  # different prompts, different continuations


def train_into(data_dir: Path, out_dir: Path, device: str, **overrides: object) -> list[dict]:
    result = run_script("train.py", *tiny_train_args(data_dir, out_dir, device=device, dtype="float32", **overrides))
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("first, then", [("gpu", "cpu"), ("cpu", "gpu")])
def test_checkpoint_moves_between_gpu_and_cpu(
    gpu_device: torch.device, char_data_dir: Path, tmp_path: Path, first: str, then: str
) -> None:
    devices = {"gpu": str(gpu_device), "cpu": "cpu"}
    out_dir = tmp_path / "out"
    train_into(char_data_dir, out_dir, devices[first], max_iters=4)
    saved = load_checkpoint(out_dir / "ckpt.pt")
    assert saved["iter_num"] == 4
    log = train_into(char_data_dir, out_dir, devices[then], max_iters=8, init_from="resume")
    resumed = load_checkpoint(out_dir / "ckpt.pt")
    assert resumed["iter_num"] == 8
    assert [entry["iter"] for entry in log if "train/loss" in entry and "lr" in entry][-1] >= 4
    for name, tensor in resumed["model"].items():  # every weight moved on, and none became NaN
        assert tensor.device.type == "cpu" and torch.isfinite(tensor.float()).all(), name
    assert any(not torch.equal(resumed["model"][name], saved["model"][name]) for name in saved["model"])


def test_gpu_tests_run_on_the_gpu(gpu_device: torch.device) -> None:
    """Where CUDA is, these tests use it: a batch placed on the GPU device really lives there."""
    x, _ = random_batch(gpu_device)
    assert x.device.type == gpu_device.type
    if gpu_device.type == "cuda":
        assert torch.cuda.is_available() and x.is_cuda
