"""Chat end to end, through the scripts a user runs (their mains, in this process: each script's own tests start it
as a process): a base model is trained on plain text, conversations teach it a skill it does not have (reversing a
four-letter word), and greedy replies to held-out words show that it learnt.

Rows of 33 tokens hold one 21-token conversation each, so the small model learns the task at one place in the row.
The base never saw a conversation, so its exact-match rate on the task is at chance (1 in 4,096); the fine-tuned
model's replies to words it was never trained on must be nearly all right.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import train
from gptkit.infer import generate
from gptkit.weights import load
from helpers import cli_args, run_in_process
from prepare_data import chat as chat_script
from prepare_data import corpus

LETTERS = "abcdefgh"
HELD_OUT = 100
BASE = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32, "dropout": 0.0, "bias": False}


def words(seed: int = 0) -> list[str]:
    """Distinct four-letter words over LETTERS in a seeded order."""
    rng = random.Random(seed)
    found = sorted({"".join(rng.choice(LETTERS) for _ in range(4)) for _ in range(4000)})
    rng.shuffle(found)
    return found


def conversation(word: str) -> dict:
    return {"messages": [{"role": "user", "content": f"reverse {word}"}, {"role": "assistant", "content": word[::-1]}]}


def write_base_corpus(path: Path, vocabulary: list[str]) -> None:
    """Plain text over the same characters: requests without answers, so no reversal is ever shown."""
    rng = random.Random(1)
    path.write_text("\n".join(f"reverse {rng.choice(vocabulary)}" for _ in range(3000)) + "\n", encoding="utf-8")


def exact_match(out_dir: Path, held_out: list[str]) -> float:
    """Share of held-out words whose greedy reply is exactly the reversed word. A model without a chat template
    is asked in its own plain text format."""
    loaded = load(str(out_dir))
    model, tokenizer = loaded.model, loaded.tokenizer
    right = 0
    for word in held_out:
        if tokenizer.chat is None:
            prompt, stop = tokenizer.encode(f"reverse {word}\n"), []
        else:
            prompt = tokenizer.chat.render_prompt(conversation(word)["messages"][:1], tokenizer)
            stop = [tokenizer.chat.end_of_turn]
        idx = torch.tensor([prompt])
        out = generate(model, idx, max_new_tokens=5, temperature=0.0, stop_tokens=stop)[0, len(prompt) :].tolist()
        reply = out[: out.index(stop[0])] if stop and stop[0] in out else out[:4]
        right += tokenizer.decode(reply) == word[::-1]
    return right / len(held_out)


@pytest.mark.heavy
def test_fine_tuning_teaches_a_skill_the_base_model_lacks(tmp_path: Path, capsys) -> None:
    vocabulary = words()
    held_out, trained = vocabulary[:HELD_OUT], vocabulary[HELD_OUT:]
    write_base_corpus(tmp_path / "base.txt", vocabulary)
    base_data, base_out = tmp_path / "base_data", tmp_path / "base_out"
    run = run_in_process(
        corpus.main,
        cli_args(input=tmp_path / "base.txt", tokenizer="char", out_dir=base_data, block_size=32, num_workers=1),
        capsys,
    )
    assert run.returncode == 0, run.stderr
    common = {"device": "cpu", "compile": False, "eval_iters": 2, "log_interval": 50, "curves": False}
    common["gradient_accumulation_steps"] = 1
    run = run_in_process(
        train.main,
        cli_args(
            **BASE,
            **common,
            data_dir=base_data,
            out_dir=base_out,
            max_iters=60,
            batch_size=16,
            eval_interval=60,
            learning_rate=3e-3,
            warmup_iters=5,
            min_lr=6e-5,
        ),
        capsys,
    )
    assert run.returncode == 0, run.stderr

    with (tmp_path / "chat.jsonl").open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(conversation(word)) + "\n" for word in trained)
    chat_data, chat_out = tmp_path / "chat_data", tmp_path / "chat_out"
    run = run_in_process(
        chat_script.main,
        cli_args(input=tmp_path / "chat.jsonl", tokenizer=base_out, out_dir=chat_data, block_size=32),
        capsys,
    )
    assert run.returncode == 0, run.stderr
    run = run_in_process(
        train.main,
        cli_args(
            **common,
            init_from=base_out / "best.pt",
            data_dir=chat_data,
            out_dir=chat_out,
            max_iters=250,  # the held-out replies come out right from about 200 steps on
            batch_size=32,
            eval_interval=250,
            learning_rate=3e-3,
            warmup_iters=10,
            lr_decay_iters=250,
            min_lr=3e-4,
        ),
        capsys,
    )
    assert run.returncode == 0, run.stderr

    base_score, tuned_score = exact_match(base_out, held_out), exact_match(chat_out, held_out)
    assert base_score <= 0.02, base_score
    assert tuned_score >= 0.9, (tuned_score, run.stdout)
