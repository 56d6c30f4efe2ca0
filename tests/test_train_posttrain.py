"""train.py --objective=dpo and grpo end to end on tiny made-up tasks: learning happens (the held-out preference
accuracy leaves chance; the reward rises), runs resume exactly, LoRA keeps its reference without a copy, and bad
input is one line."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

import train
from gptkit.data.tokenizer import CharTokenizer, ChatTokenizer
from gptkit.model import GPT, GPTConfig, config_to_dict
from gptkit.train import curves
from gptkit.weights import checkpoint as ckpt
from helpers import REPO, assert_one_line_error, cli_args, run_main
from prepare_data import preferences
from test_train_ddp import assert_close_weights, train_in_two_processes

LETTERS = "abcdefgh"
RUN = {
    "device": "cpu",
    "compile": False,
    "batch_size": 8,
    "gradient_accumulation_steps": 2,
    "dropout": 0.0,
    "eval_iters": 4,
    "log_interval": 1,
    "warmup_iters": 0,
    "decay_lr": False,
    "curves": False,
    "cpu_threads": 1,
}


def words(count: int, seed: int, letters: str = LETTERS) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 5))) for _ in range(count)]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    """A random char-level chat model (the starting point, as initialised), preference pairs (chosen: the word reversed; rejected:
    another word) prepared with its tokenizer, and prompt files."""
    root = tmp_path_factory.mktemp("posttrain")
    tokenizer = ChatTokenizer.extending(CharTokenizer.from_text(LETTERS + " ", eot=True))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=24, n_layer=2, n_head=2, n_embd=32))
    record = {**tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_token": tokenizer.eot_token}
    (root / "base").mkdir()
    checkpoint = {"model": model.state_dict(), "model_args": config_to_dict(model.config), "tokenizer": record}
    ckpt.save_checkpoint(root / "base" / "ckpt.pt", checkpoint)
    # Prompts and chosen replies in letters a-d, rejected ones in e-h: a preference a small model learns in steps.
    pairs = [
        {"prompt": w, "chosen": w[::-1], "rejected": r} for w, r in zip(words(300, 0, "abcd"), words(300, 1, "efgh"))
    ]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    args = cli_args(
        input=root / "pairs.jsonl", tokenizer=root / "base", out_dir=root / "prefs", block_size=24, num_workers=1
    )
    assert preferences.main([*args, "--val_fraction=0.25"]) == 0
    prompts = [{"prompt": w, "answer": w[::-1]} for w in words(64, 1)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return root


def log_entries(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]


def dpo_args(task: Path, out: Path, **extra: object) -> list[str]:
    settings = {**RUN, "objective": "dpo", "init_from": task / "base", "data_dir": task / "prefs", "out_dir": out}
    return cli_args(**{**settings, "learning_rate": 1e-2, "dpo_beta": 0.5, **extra})


@pytest.mark.heavy
def test_dpo_moves_held_out_accuracy_from_chance_to_well_above(task: Path, tmp_path: Path, capsys) -> None:
    code, stdout, stderr = run_main(
        train.main, dpo_args(task, tmp_path / "dpo", max_iters=20, eval_interval=20), capsys
    )
    assert code == 0, stderr
    assert "| 16 preference pairs per step (two rows of up to 24 tokens each) |" in stdout  # 8 pairs x 2 micro-batches
    evaluations = [e for e in log_entries(tmp_path / "dpo") if "val/accuracy" in e]
    assert evaluations[0]["val/accuracy"] == 0.5  # the model is its reference: every margin 0
    assert evaluations[-1]["val/accuracy"] >= 0.8
    assert evaluations[-1]["val/margin"] > 0 and evaluations[-1]["val/loss"] < 0.69


@pytest.mark.heavy
def test_dpo_resumes_exactly_and_the_reference_stays_the_start(task: Path, tmp_path: Path, capsys) -> None:
    assert run_main(train.main, dpo_args(task, tmp_path / "a", max_iters=4, eval_interval=2), capsys)[0] == 0
    assert run_main(train.main, dpo_args(task, tmp_path / "b", max_iters=2, eval_interval=2), capsys)[0] == 0
    resumed = dpo_args(task, tmp_path / "b", max_iters=4, eval_interval=2, init_from="resume")
    assert run_main(train.main, resumed, capsys)[0] == 0
    a, b = (ckpt.load_checkpoint(tmp_path / name / "ckpt.pt") for name in ("a", "b"))
    start = task / "base" / "ckpt.pt"  # recorded with its digest: a resume compares with the start as it was
    assert b["reference"] == {"source": str(start.resolve()), "sha256": hashlib.sha256(start.read_bytes()).hexdigest()}
    assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])
    # The same run resumed without its objective: the next-token loss would train the rejected replies too.
    lm = [arg for arg in dpo_args(task, tmp_path / "b", max_iters=6, init_from="resume") if arg != "--objective=dpo"]
    code, _, err = run_main(train.main, lm, capsys)
    assert_one_line_error(code, err, "holds preference pairs", "--objective=dpo")
    grpo = grpo_args(task, tmp_path / "b", max_iters=6, init_from="resume", grpo_reward="exact")
    code, _, err = run_main(train.main, grpo, capsys)
    assert_one_line_error(code, err, "was trained with --objective=dpo; resume it with --objective=dpo")


@pytest.mark.heavy
def test_dpo_with_lora(task: Path, tmp_path: Path, capsys) -> None:
    args = dpo_args(task, tmp_path / "lora", max_iters=6, eval_interval=6, lora_rank=4, lora_targets="all")
    code, _, stderr = run_main(train.main, args, capsys)
    assert code == 0, stderr
    evaluations = [e for e in log_entries(tmp_path / "lora") if "val/accuracy" in e]
    assert evaluations[0]["val/accuracy"] == 0.5 and evaluations[-1]["val/accuracy"] > 0.6


@pytest.mark.heavy
def test_a_dpo_run_whose_starting_model_changed_is_not_resumed(task: Path, tmp_path: Path, capsys) -> None:
    """The starting model's path trained further (or replaced) since: a resume would compare with another model."""
    (tmp_path / "start").mkdir()
    shutil.copy(task / "base" / "ckpt.pt", tmp_path / "start" / "ckpt.pt")
    first = dpo_args(task, tmp_path / "dpo", max_iters=2, eval_interval=2, init_from=tmp_path / "start")
    assert run_main(train.main, first, capsys)[0] == 0
    moved = ckpt.load_checkpoint(tmp_path / "start" / "ckpt.pt")
    moved["model"] = {name: value + 0.01 for name, value in moved["model"].items()}
    ckpt.save_checkpoint(tmp_path / "start" / "ckpt.pt", moved)
    resumed = dpo_args(task, tmp_path / "dpo", max_iters=4, eval_interval=2, init_from="resume")
    code, _, err = run_main(train.main, resumed, capsys)
    assert_one_line_error(code, err, "the starting model", "has changed since this run started")
    (tmp_path / "start" / "ckpt.pt").unlink()
    code, _, err = run_main(train.main, resumed, capsys)
    assert_one_line_error(code, err, "the starting model", "is missing; resume with the model this run started from")


def grpo_args(task: Path, out: Path, **extra: object) -> list[str]:
    settings = {
        **RUN,
        "objective": "grpo",
        "init_from": task / "base",
        "grpo_prompts": task / "prompts.jsonl",
        "grpo_eval_prompts": task / "prompts.jsonl",
        "grpo_max_new_tokens": 6,
        "grpo_group_size": 4,
        "batch_size": 4,
        "out_dir": out,
    }
    return cli_args(**{**settings, **extra})


@pytest.mark.heavy
def test_grpo_raises_a_users_reward(task: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "letter_rewards.py").write_text(
        "def share_of_a(completion, sample):\n    return completion.count('a') / max(len(completion), 1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = grpo_args(
        task,
        tmp_path / "rl",
        max_iters=24,
        eval_interval=24,
        learning_rate=1e-2,
        grpo_reward="letter_rewards:share_of_a",
        curves=True,
    )
    code, stdout, stderr = run_main(train.main, args, capsys)
    assert code == 0, stderr
    assert "| 8 prompts x 4 completions per step (up to 6 new tokens each) |" in stdout  # 4 prompts x 2 micro-batches
    rewards = [e["train/reward"] for e in log_entries(tmp_path / "rl") if "train/reward" in e]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.2, rewards
    evaluations = [e for e in log_entries(tmp_path / "rl") if "val/pass@1" in e]
    assert len(evaluations) == 2 and "val pass@1" in stdout
    assert (tmp_path / "rl" / "curves.png").stat().st_size > 0  # drawn, with no loss at evaluations


@pytest.mark.parametrize("recipe", ["dpo_cpu.py", "grpo_cpu.py"])
def test_the_cpu_recipes_train_from_a_small_chat_model(task: Path, tmp_path: Path, recipe: str, capsys) -> None:
    """The README's post-training commands, 2 steps (no curves.png: test_grpo_raises_a_users_reward draws it): the
    recipe's settings hold for a small base (its 24-token context is kept) and the run says what a step processes."""
    given = {
        "init_from": task / "base",
        "out_dir": tmp_path / "out",
        "max_iters": 2,
        "eval_interval": 2,
        "curves": False,
    }
    grpo = {"grpo_prompts": task / "prompts.jsonl", "grpo_reward": "exact"}  # the task's answers are words
    given.update({"data_dir": task / "prefs"} if recipe == "dpo_cpu.py" else grpo)
    code, stdout, stderr = run_main(train.main, [str(REPO / "config" / recipe), *cli_args(**given)], capsys)
    assert code == 0, stderr
    assert "8 preference pairs per step" in stdout if recipe == "dpo_cpu.py" else "4 prompts x 8 completions" in stdout
    assert ckpt.load_checkpoint(tmp_path / "out" / "ckpt.pt")["model_args"]["block_size"] == 24


@pytest.mark.heavy
def test_grpo_resumes_exactly(task: Path, tmp_path: Path, capsys) -> None:
    extra = {"learning_rate": 1e-2, "grpo_reward": r"regex:^a", "eval_interval": 2, "grpo_kl_beta": 0.1}
    assert run_main(train.main, grpo_args(task, tmp_path / "a", max_iters=4, **extra), capsys)[0] == 0
    assert run_main(train.main, grpo_args(task, tmp_path / "b", max_iters=2, **extra), capsys)[0] == 0
    resumed = grpo_args(task, tmp_path / "b", max_iters=4, init_from="resume", **extra)
    assert run_main(train.main, resumed, capsys)[0] == 0
    a, b = (ckpt.load_checkpoint(tmp_path / name / "ckpt.pt") for name in ("a", "b"))
    assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])


def test_bad_input_is_one_line(task: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    code, _, stderr = run_main(train.main, grpo_args(task, tmp_path / "g1", max_iters=1, grpo_group_size=1), capsys)
    assert_one_line_error(code, stderr, "--grpo_group_size=1", "group of 1")
    (tmp_path / "bad_rewards.py").write_text("def boom(completion, sample):\n    raise KeyError('score')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bad_rewards", raising=False)
    args = grpo_args(task, tmp_path / "boom", max_iters=1, grpo_reward="bad_rewards:boom")
    code, _, stderr = run_main(train.main, args, capsys)
    assert_one_line_error(code, stderr, "bad_rewards:boom", "KeyError", "'answer':")
    code, _, stderr = run_main(train.main, dpo_args(task, tmp_path / "text", data_dir=task / "base"), capsys)
    assert code == 2
    # no --data_dir: the line names the preference data DPO needs, not the pretraining corpus of the default dataset
    args = [arg for arg in dpo_args(task, tmp_path / "nodata") if not arg.startswith("--data_dir=")]
    code, _, stderr = run_main(train.main, args, capsys)
    assert_one_line_error(code, stderr, "--objective=dpo", "prepare_data/preferences.py")


@pytest.mark.heavy
@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_two_ddp_processes_end_with_the_weights_of_one(task: Path, tmp_path: Path, objective: str, capsys) -> None:
    """gradient_accumulation_steps=2 in one process (this one: train.main) against 2 gloo processes with one
    micro-batch each (test_train_ddp.train_in_two_processes)."""
    make_args = dpo_args if objective == "dpo" else grpo_args
    extra: dict[str, object] = {"max_iters": 3, "eval_interval": 3}
    if objective == "grpo":
        extra.update(grpo_reward="regex:^a", learning_rate=1e-2, grpo_kl_beta=0.1)
    code, _, stderr = run_main(train.main, make_args(task, tmp_path / "one", **extra), capsys)
    assert code == 0, stderr
    train_in_two_processes(make_args(task, tmp_path / "two", **extra))
    assert_close_weights(tmp_path / "one", tmp_path / "two")


def test_curves_draw_the_objectives_figures() -> None:
    grpo_log = [
        {"iter": 0, "train/loss": None, "val/loss": None, "val/pass@1": 0.1, "val/reward": 0.1, "time": 0.0},
        {"iter": 1, "train/loss": -0.01, "lr": 1e-3, "train/reward": 0.2, "train/pass": 0.2, "time": 1.0},
    ]
    dpo_log = [{"iter": 0, "train/loss": 0.69, "val/loss": 0.69, "val/accuracy": 0.5, "val/margin": 0.0}]
    panels = dict(curves.panels_for([curves.run_curves(grpo_log, "rl"), curves.run_curves(dpo_log, "dpo")]))
    assert panels["pass@1 (GRPO)"] == ("train/pass", "val/pass@1")
    assert "reward (GRPO)" in panels and "preference accuracy (DPO)" in panels and "reward margin (DPO)" in panels
    assert "val bits per byte" not in panels
