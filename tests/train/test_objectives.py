"""Tests for gptkit/train/objectives.py: the interface train.py's loop calls, for each objective. What a step
processes, the micro-batches a process takes and the loss of each (checked against float64 and hand computations),
the figures logged, the settings each refuses, and the state a checkpoint keeps for a resume."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from data.test_packing import write_chat_data
from gptkit.core.distributed import Processes
from gptkit.core.errors import UserError
from gptkit.data.tokenizer import CharTokenizer, ChatTokenizer
from gptkit.model import GPT, GPTConfig, config_to_dict
from gptkit.train import forecast, grpo, objectives
from gptkit.train.objectives import ObjectiveSettings, step_size
from gptkit.train.reference import Reference
from gptkit.weights import checkpoint as ckpt
from gptkit.weights.sources import model_of_checkpoint
from helpers import cli_args, make_char_data, sample_text
from prepare_data import preferences

CPU = torch.device("cpu")


def test_each_objective_states_its_step_in_its_own_unit() -> None:
    # 4 micro-batches of 8 rows: 32 rows a step.
    assert step_size(ObjectiveSettings(objective="lm"), 32, 256) == "8,192 tokens per step"  # 32 x 256
    dpo = step_size(ObjectiveSettings(objective="dpo"), 32, 256)
    assert dpo == "32 preference pairs per step (two rows of up to 256 tokens each)"
    grpo = step_size(ObjectiveSettings(objective="grpo", grpo_group_size=6, grpo_max_new_tokens=48), 32, 256)
    assert grpo == "32 prompts x 6 completions per step (up to 48 new tokens each)"


def test_each_objective_names_the_settings_given_that_it_does_not_read() -> None:
    """A setting of another objective (or token data given to GRPO, which reads prompts) changed from its default is
    named in a note; one left at its default, or one the objective reads, is not."""
    notes = {
        "lm": settings(dpo_beta=0.5, grpo_reward="exact", grpo_group_size=8, data_dir="data/x"),
        "dpo": settings(objective="dpo", dpo_beta=0.5, grpo_kl_beta=0.1, data_dir="data/x"),
        "grpo": settings(objective="grpo", data_dir="data/x", dataset="shakespeare", grpo_reward="exact"),
    }
    assert {name: objectives.build(cfg).unused_settings_note() for name, cfg in notes.items()} == {
        "lm": "note: --objective=lm does not use --dpo_beta=0.5, --grpo_reward='exact'",
        "dpo": "note: --objective=dpo does not use --grpo_kl_beta=0.1",
        "grpo": "note: --objective=grpo does not use --dataset='shakespeare', --data_dir='data/x'",
    }
    assert objectives.build(settings(objective="dpo", dpo_beta=0.5)).unused_settings_note() is None


def settings(**given: object) -> train.TrainSettings:
    """Training settings for an objective on its own: 2 micro-batches a step of 3 rows of 8 tokens."""
    return train.TrainSettings(
        **{"batch_size": 3, "block_size": 8, "gradient_accumulation_steps": 2, "eval_iters": 2, "seed": 1, **given}
    )


def tiny_model(vocab_size: int, block_size: int = 8) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=16))


@contextlib.contextmanager
def started(objective: objectives.Objective, model: GPT, procs: Processes | None = None, **given: object):
    """`objective` started on `model` in one CPU process (or `procs`), closed afterwards."""
    run = {"reference": None, "resumed": None, **given}
    procs = procs or Processes()
    objective.start(model=model, device=CPU, procs=procs, precision=contextlib.nullcontext(), **run)
    try:
        yield objective
    finally:
        objective.close()


def float64_cross_entropy(model: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """(summed cross-entropy, number of targets) of y given x, from the model's logits in float64: log-sum-exp
    minus the target's logit, written out."""
    with torch.no_grad():
        logits = copy.deepcopy(model).double()(x, y)[0].numpy()
    targets = y.numpy()
    total, count = 0.0, 0
    for row, column in zip(*np.nonzero(targets >= 0)):
        values = logits[row, column]
        peak = values.max()
        total += peak + math.log(np.exp(values - peak).sum()) - values[targets[row, column]]
        count += 1
    return total, count


def test_lm_text_micro_batches_are_windows_and_their_loss_is_the_mean_cross_entropy(tmp_path: Path) -> None:
    meta = make_char_data(tmp_path / "data", sample_text(4000))
    lm = objectives.build(settings(data_dir=str(tmp_path / "data")))
    assert lm.open_data().directory == tmp_path / "data" and not lm.needs_reference
    assert forecast.CPU_RECIPES[lm.kind] == "config/train_corpus_cpu.py"
    model = tiny_model(meta["vocab_size"])
    with started(lm, model):
        lm.prepare_step(range(4, 6), range(4, 6))  # the third step of a run of 2 micro-batches a step
        x, y = lm.batch(1)
        loss, logged = lm.micro_loss(model, 1, x, y)
    tokens = np.fromfile(tmp_path / "data" / meta["splits"]["train"]["files"][0], dtype=np.uint16).tolist()
    text = "".join(map(chr, tokens))
    for row, targets in zip(x.tolist(), y.tolist()):  # windows of the train split, targets one token on
        assert targets[:-1] == row[1:] and "".join(map(chr, row + targets[-1:])) in text
    total, count = float64_cross_entropy(model, x, y)
    assert count == 3 * 8
    # The micro-batch's mean counts for half the step's loss (2 micro-batches); logged: the mean itself.
    assert loss.item() == pytest.approx(total / count / 2, rel=1e-5)
    assert logged.item() == pytest.approx(total / count, rel=1e-5)


def test_lm_chat_loss_is_the_summed_loss_over_the_whole_steps_targets(tmp_path: Path) -> None:
    """Rank 1 of 2 processes, 4 micro-batches a step: it takes micro-batches 2 and 3, and each one's loss is its
    summed cross-entropy over the assistant targets of all four, times the 2 processes (DDP averages them)."""
    tokenizer = write_chat_data(tmp_path / "chat")
    cfg = settings(data_dir=str(tmp_path / "chat"), block_size=63, batch_size=2, gradient_accumulation_steps=4)
    first, second = objectives.build(cfg), objectives.build(cfg)
    first.open_data(), second.open_data()
    assert forecast.CPU_RECIPES[first.kind] == "config/finetune_chat_cpu.py"
    model = tiny_model(tokenizer.vocab_size, block_size=63)
    with started(first, model), started(second, model, Processes(rank=1, world_size=2)):
        first.prepare_step(range(0, 4), range(0, 4))
        step = [first.batch(micro) for micro in range(4)]
        second.prepare_step(range(0, 4), range(2, 4))
        x, y = second.batch(0)
        loss, logged = second.micro_loss(model, 0, x, y)
    assert torch.equal(x, step[2][0]) and torch.equal(y, step[2][1])
    step_targets = sum(int((targets >= 0).sum()) for _, targets in step)
    assert 0 < step_targets < 4 * 2 * 63  # the assistant's tokens only
    total, _ = float64_cross_entropy(model, x, y)
    assert loss.item() == pytest.approx(total / step_targets * 2, rel=1e-5)
    assert logged.item() == pytest.approx(total * 4 / step_targets, rel=1e-5)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A random char-level chat model's checkpoint (with its tokenizer), preference pairs prepared with it, and
    a prompt file."""
    root = tmp_path_factory.mktemp("objectives")
    tokenizer = ChatTokenizer.extending(CharTokenizer.from_text("abcdefgh ", eot=True))
    model = tiny_model(tokenizer.vocab_size, block_size=24)
    record = {**tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_token": tokenizer.eot_token}
    (root / "base").mkdir()
    checkpoint = {"model": model.state_dict(), "model_args": config_to_dict(model.config), "tokenizer": record}
    ckpt.save_checkpoint(root / "base" / "ckpt.pt", checkpoint)
    pairs = [{"prompt": w, "chosen": w[::-1], "rejected": "hgf"} for w in ("abc", "bcd", "cde", "def", "efg", "fga")]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs * 4))
    args = cli_args(input=root / "pairs.jsonl", tokenizer=root / "base", out_dir=root / "prefs", block_size=24)
    assert preferences.main([*args, "--num_workers=1", "--val_fraction=0.25"]) == 0
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ("ab", "cd", "ef")))
    return root


def starting_model(base: Path) -> GPT:
    return model_of_checkpoint(ckpt.load_checkpoint(base / "base" / "ckpt.pt"), "base")


def dpo_settings(base: Path, **given: object) -> train.TrainSettings:
    dpo = {"objective": "dpo", "init_from": str(base / "base"), "data_dir": str(base / "prefs"), "block_size": 24}
    return settings(**{**dpo, **given})


def test_dpo_from_its_reference_scores_log_2_and_chance_accuracy(base: Path) -> None:
    """Before any step the model is its reference: every margin is 0, so each pair's loss is -log sigmoid(0)."""
    dpo = objectives.build(dpo_settings(base))
    dpo.open_data()
    assert forecast.CPU_RECIPES[dpo.kind] == "config/dpo_cpu.py" and dpo.needs_reference
    model = starting_model(base)
    with started(dpo, model, reference=Reference(model)):
        dpo.prepare_step(range(0, 2), range(0, 2))
        x, y = dpo.batch(0)
        loss, logged = dpo.micro_loss(model, 0, x, y)
        figures = dpo.log_entries()
        evaluation = dpo.evaluate(model)
    assert x.shape[0] == 2 * 3  # 3 pairs: the chosen rows, then the rejected ones
    assert logged.item() == pytest.approx(math.log(2)) and loss.item() == pytest.approx(math.log(2) / 2)
    assert figures["train/margin"] == 0 and figures["train/accuracy"] == 0.5  # a tie counts half
    assert evaluation["val/loss"] == pytest.approx(math.log(2)) and evaluation["val/accuracy"] == 0.5
    assert evaluation["val/bpb"] is None


def test_a_resumed_objective_reads_the_next_batches_and_keeps_the_starting_reference(base: Path) -> None:
    """A checkpoint holds the sampler's state and the objective's entries; a run resumed from it continues with the
    same micro-batches and names the same starting model, not the checkpoint it resumed from."""
    running = objectives.build(dpo_settings(base))
    running.open_data()
    model = starting_model(base)
    with started(running, model, reference=Reference(model)):
        running.sampler.position = 4  # two steps done
        saved = {"sampler": running.sampler.state_dict(), **running.checkpoint_entries()}
        running.prepare_step(range(4, 6), range(4, 6))
        expected = [running.batch(micro) for micro in range(2)]
    start = base / "base" / "ckpt.pt"
    recorded = {"source": str(start.resolve()), "sha256": hashlib.sha256(start.read_bytes()).hexdigest()}
    assert running.checkpoint_entries() == {"reference": recorded}
    resumed = objectives.build(dpo_settings(base, init_from="resume"))
    resumed.open_data()
    with started(resumed, model, reference=Reference(model), resumed=saved):
        resumed.sampler.load_state_dict(saved["sampler"])  # as the checkpoint's restore does
        position = resumed.sampler.position
        resumed.prepare_step(range(position, position + 2), range(position, position + 2))
        batches = [resumed.batch(micro) for micro in range(2)]
    assert position == 4
    assert all(torch.equal(a, b) for pair in zip(expected, batches) for a, b in zip(*pair))
    assert resumed.checkpoint_entries() == {"reference": recorded}


def scripted_sampler(tokenizer):
    """An engine stand-in: completion j of every prompt is j + 1 letters 'a'."""

    def sample(model, prompts, group_size, seed, *, temperature, max_new_tokens, stop_tokens):
        return [tokenizer.encode("a" * (j + 1)) for _ in prompts for j in range(group_size)]

    return sample


def test_grpo_loss_is_minus_each_tokens_advantage_over_the_steps_completion_tokens(base: Path) -> None:
    """Two completions per prompt, 'a' (1 token, reward 0) and 'aa' (2 tokens, reward 1): advantages -+A with
    A = 0.5 / (std([0, 1]) + 1e-4). A micro-batch of 3 prompts sums -A*1 ... over its tokens: -(-A) - 2A = -A per
    prompt; the step (2 micro-batches) has 2 * 3 * 3 completion tokens."""
    cfg = settings(
        objective="grpo",
        init_from=str(base / "base"),
        grpo_prompts=str(base / "prompts.jsonl"),
        grpo_reward="regex:^aa",
        grpo_group_size=2,
    )
    record = ckpt.load_checkpoint(base / "base" / "ckpt.pt")["tokenizer"]
    tokenizer = ChatTokenizer.extending(CharTokenizer.from_text("abcdefgh ", eot=True))
    assert tokenizer.vocab_size == record["vocab_size"]
    rl = objectives.build(cfg, scripted_sampler(tokenizer))
    data = rl.open_data()
    assert forecast.CPU_RECIPES[rl.kind] == "config/grpo_cpu.py" and not rl.needs_reference and data.splits == {}
    model = starting_model(base)
    with started(rl, model):
        rl.prepare_step(range(0, 2), range(0, 2))
        x, y = rl.batch(1)
        loss, logged = rl.micro_loss(model, 1, x, y)
        figures = rl.log_entries()
    advantage = 0.5 / (math.sqrt(0.5) + grpo.ADVANTAGE_EPS)
    assert x.shape[0] == 3 * 2 and int((y >= 0).sum()) == 3 * 3
    assert loss.item() == pytest.approx(-3 * advantage / 18, rel=1e-5)
    assert logged.item() == pytest.approx(-3 * advantage * 2 / 18, rel=1e-5)
    assert figures == {"train/reward": 0.5, "train/pass": 0.5, "train/completion_tokens": 1.5}
    assert objectives.build(dataclasses.replace(cfg, grpo_kl_beta=0.1)).needs_reference


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"objective": "dpo"}, "--objective=dpo improves a trained model"),
        ({"objective": "dpo", "init_from": "out", "parallel": "fsdp"}, "takes neither --parallel=fsdp"),
        ({"objective": "dpo", "init_from": "out", "eval_full_split": True}, "no whole-split loss"),
        ({"objective": "grpo", "init_from": "out", "grpo_prompts": "p.jsonl", "grpo_group_size": 1}, "group of 1"),
        ({"objective": "grpo", "init_from": "out"}, "needs --grpo_prompts=FILE"),
        ({"objective": "grpo", "init_from": "out", "grpo_prompts": "p.jsonl", "eval_only": True}, "eval.py"),
    ],
)
def test_post_training_refuses_settings_it_cannot_work_with(given: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        objectives.build(settings(**given)).check_settings()
    objectives.build(settings()).check_settings()  # lm takes them all
