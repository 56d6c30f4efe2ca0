"""train.py on chat data: the step's gradient is the one of all its trained tokens at once (however the step is split
into micro-batches and processes), fine-tuning a base checkpoint into a new run with the template's new token rows,
exact resume, and DDP against one process."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train
from data.test_packing import write_chat_data
from gptkit.data.conversations import open_conversations
from gptkit.data.packing import PackedBatches
from gptkit.data.prepare.writer import write_dataset
from gptkit.data.tokenizer import CharTokenizer
from gptkit.model import GPT, GPTConfig
from gptkit.train import batches
from gptkit.weights import checkpoint as ckpt
from helpers import REPO, assert_script_error, cli_args, run_in_process
from test_train_ddp import assert_close_weights, train_in_two_processes

RUN = {
    "device": "cpu",
    "compile": False,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 32,
    "block_size": 63,
    "batch_size": 2,
    "gradient_accumulation_steps": 4,
    "dropout": 0.0,
    "eval_interval": 3,
    "eval_iters": 2,
    "log_interval": 1,
    "learning_rate": 3e-3,
    "warmup_iters": 2,
    "lr_decay_iters": 6,
    "curves": False,
}


def write_text_data(directory: Path, text: str) -> None:
    """Plain text data whose character tokenizer has an end-of-text token, as prepare_data/corpus.py writes."""
    tokenizer = CharTokenizer.from_text(text, eot=True)
    ids = tokenizer.encode_array(text)
    cut = len(ids) * 9 // 10
    write_dataset(directory, tokenizer, {"train": (ids[:cut], cut, 1), "val": (ids[cut:], len(ids) - cut, 1)}, {})


def step_gradients(model: GPT, packed: PackedBatches, indices: list[int], world_size: int) -> dict:
    """The gradients one process accumulates over micro-batches `indices` of a step of 4, through the training
    loss of gptkit.train.batches (the one train.py's step takes)."""
    model.zero_grad()
    total = batches.step_target_count(packed, position=0, micro_batches=4)  # the whole step: micro-batches 0..3
    assert total == sum(packed.counted(i) for i in range(4))
    for index in indices:
        x, y = packed.batch(index)
        loss, _ = batches.micro_batch_loss(
            model, x, y, contextlib.nullcontext(), step_targets=total, micro_batches=4, world_size=world_size
        )
        loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def test_a_step_gives_the_gradient_of_all_its_trained_tokens_at_once(tmp_path: Path) -> None:
    tokenizer = write_chat_data(tmp_path / "data")
    packed = PackedBatches(open_conversations(tmp_path / "data", "train"), 2, 63, seed=1)
    counts = [packed.counted(i) for i in range(4)]
    assert len(set(counts)) > 1  # micro-batches of different sizes: a mean of their means would differ
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=63, vocab_size=tokenizer.vocab_size, dropout=0.0)
    model = GPT(config).double()
    reference = copy.deepcopy(model)
    x = torch.cat([packed.batch(i)[0] for i in range(4)])
    y = torch.cat([packed.batch(i)[1] for i in range(4)])
    logits, _ = reference(x, y)
    (F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum") / (y >= 0).sum()).backward()
    expected = {name: param.grad for name, param in reference.named_parameters()}

    one_process = step_gradients(model, packed, [0, 1, 2, 3], world_size=1)
    # Two processes take two micro-batches each; DDP averages their gradients.
    rank0 = step_gradients(model, packed, [0, 1], world_size=2)
    rank1 = step_gradients(model, packed, [2, 3], world_size=2)
    for name, grad in expected.items():
        torch.testing.assert_close(one_process[name], grad, rtol=1e-4, atol=1e-8)  # the model takes its loss in float32
        torch.testing.assert_close(
            (rank0[name] + rank1[name]) / 2, grad, rtol=1e-4, atol=1e-8
        )  # the model takes its loss in float32


@pytest.fixture(scope="module")
def base_and_chat(tmp_path_factory) -> tuple[Path, Path]:
    """A base checkpoint trained on plain text over the chat data's characters, and chat data with its tokenizer."""
    root = tmp_path_factory.mktemp("chat")
    write_text_data(root / "text", "abcdefgh " * 400)
    base = root / "base"
    args = {**RUN, "max_iters": 3, "eval_interval": 3, "gradient_accumulation_steps": 1}
    assert train.main(cli_args(**args, data_dir=root / "text", out_dir=base)) == 0  # in this process: the tests' input
    write_chat_data(root / "chat")
    return base, root / "chat"


def test_fine_tuning_a_base_checkpoint_adds_the_template_rows_and_starts_afresh(
    base_and_chat, tmp_path, capsys
) -> None:
    base, chat = base_and_chat
    args = cli_args(**RUN, max_iters=3, init_from=base, data_dir=chat, out_dir=tmp_path / "o")
    result = run_in_process(train.main, args, capsys)
    assert result.returncode == 0, result.stderr
    tuned = ckpt.load_checkpoint(tmp_path / "o" / "ckpt.pt")
    start = ckpt.load_checkpoint(base / "best.pt")
    assert tuned["iter_num"] == 3 and tuned["tokenizer"]["chat"]["template"] == "gptkit-chat-1"
    rows = start["model"]["transformer.wte.weight"].shape[0]
    assert tuned["model"]["transformer.wte.weight"].shape[0] == rows + 4  # the template's four markers
    assert "val/bpb" not in result.stdout


def test_the_laptop_chat_recipe_fine_tunes_a_base_of_the_laptop_corpus_recipe(base_and_chat, tmp_path, capsys) -> None:
    base, chat = base_and_chat
    flags = cli_args(init_from=base, data_dir=chat, out_dir=tmp_path / "o", max_iters=4, eval_interval=4, eval_iters=2)
    flags.append("--curves=False")  # curves.png is checked where curves are what a test is about (test_plot.py)
    result = run_in_process(train.main, [str(REPO / "config" / "finetune_chat_cpu.py"), *flags], capsys)
    assert result.returncode == 0, result.stderr
    tuned = ckpt.load_checkpoint(tmp_path / "o" / "ckpt.pt")
    assert tuned["iter_num"] == 4 and tuned["config"]["batch_size"] == 8
    assert tuned["model_args"]["block_size"] == 63  # the base's context: shorter than the recipe's 256
    assert "warmup_iters=20 does not end before max_iters=4" in result.stdout  # the recipe, shortened


def test_a_chat_run_resumes_exactly(base_and_chat, tmp_path, capsys) -> None:
    base, chat = base_and_chat
    common = {**RUN, "data_dir": chat}
    run = cli_args(**common, max_iters=6, init_from=base, out_dir=tmp_path / "a")
    straight = run_in_process(train.main, run, capsys)
    assert straight.returncode == 0, straight.stderr
    first = run_in_process(train.main, cli_args(**common, max_iters=3, init_from=base, out_dir=tmp_path / "b"), capsys)
    assert first.returncode == 0, first.stderr
    rest = cli_args(**common, max_iters=6, init_from="resume", out_dir=tmp_path / "b")
    rest = run_in_process(train.main, rest, capsys)
    assert rest.returncode == 0, rest.stderr
    a = ckpt.load_checkpoint(tmp_path / "a" / "ckpt.pt")["model"]
    b = ckpt.load_checkpoint(tmp_path / "b" / "ckpt.pt")["model"]
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_chat_data_of_another_tokenizer_is_one_clear_error(tmp_path, capsys) -> None:
    write_chat_data(tmp_path / "other")
    write_text_data(tmp_path / "text", "xyz " * 400)  # a base over other characters
    other_base = tmp_path / "other_base"
    args = {**RUN, "max_iters": 1, "eval_interval": 1, "gradient_accumulation_steps": 1}
    assert train.main(cli_args(**args, data_dir=tmp_path / "text", out_dir=other_base)) == 0
    tune = cli_args(**RUN, init_from=other_base, data_dir=tmp_path / "other", out_dir=tmp_path / "o")
    result = run_in_process(train.main, tune, capsys)
    assert_script_error(result, "another tokenizer", "prepare_data/chat.py --tokenizer=")


def test_ddp_on_chat_data_matches_one_process(base_and_chat, tmp_path, capsys) -> None:
    base, chat = base_and_chat
    args = cli_args(**RUN, max_iters=3, init_from=base, data_dir=chat)
    single = run_in_process(train.main, [*args, f"--out_dir={tmp_path / 'one'}"], capsys)  # the one process: this one
    assert single.returncode == 0, single.stderr
    train_in_two_processes([*args, f"--out_dir={tmp_path / 'two'}"])
    assert_close_weights(tmp_path / "one", tmp_path / "two")
