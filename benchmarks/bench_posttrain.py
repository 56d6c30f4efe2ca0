"""Post-training on a small verifiable task made here: reversing a word. SFT, then GRPO and DPO, each measured on
held-out words with the tools a user runs (train.py, eval.py), and GRPO's rollout sampling batched against one
completion at a time.

    python benchmarks/bench_posttrain.py [--json_out=bench_results/posttrain.json]

The task: the user's message is a word of 3 to 5 letters from a-h, the reply is the word reversed. The SFT data
ends `suffix_share` of its replies with a full stop, as demonstration data often carries a habit the reward does not
want; greedy decoding of the SFT model then keeps the habit and fails exact match. Steps, all with train.py:

1. SFT: a small char-level chat model trained from scratch on the demonstrations (prepare_data/chat.py).
2. GRPO from the SFT model, reward `exact` against the reversed word; eval.py's greedy pass@1 on held-out words
   before and after.
3. DPO from the SFT model on pairs (chosen: the reversed word; rejected: a near miss, two neighbouring letters
   swapped, prepare_data/preferences.py); the held-out chosen-over-rejected accuracy of the implicit reward at the
   start (chance: every margin is 0) and at the end, from train.py's log.
4. Rollout throughput: G completions of each of a few prompts with the engine of gptkit.infer.groups, all rows in
   one batch against one row at a time, the same seeded completions, alternating rounds; tokens/s medians.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data.prompts import load_prompts
from gptkit.eval.generative import stop_tokens_of
from gptkit.infer.groups import sample_groups
from gptkit.weights import load
from measure import print_table, run_benchmark

REPO = Path(__file__).resolve().parent.parent
LETTERS = "abcdefgh"
MODEL = ["--n_layer=2", "--n_head=4", "--n_embd=64", "--block_size=32", "--dropout=0.0"]


@dataclass(kw_only=True)
class PosttrainBench:
    sft_iters: int = setting(800, "SFT steps (32 conversations each)", rule="positive")
    suffix_share: float = setting(0.7, "share of SFT replies that end in a full stop", rule="fraction")
    grpo_iters: int = setting(80, "GRPO steps", rule="positive")
    grpo_prompts: int = setting(16, "GRPO prompts per step", rule="positive")
    group_size: int = setting(8, "GRPO completions per prompt (G)", rule="positive")
    grpo_lr: float = setting(1e-3, "GRPO learning rate", rule="positive_number")
    dpo_iters: int = setting(60, "DPO steps (16 pairs each)", rule="positive")
    held_out: int = setting(
        200, "held-out words (pass@1, DPO val pairs come from the pairs' own split)", rule="positive"
    )
    throughput_prompts: int = setting(4, "rollout throughput: prompts, each sampled G times", rule="positive")
    repeats: int = setting(3, "rollout throughput: alternating rounds", rule="positive")
    threads: int = setting(1, "CPU threads of every run (a shared machine: keep it small)", rule="positive")
    work_dir: str = setting("bench_results/posttrain", "where the data, checkpoints and logs go")
    json_out: str = setting("bench_results/posttrain.json", "where to write the JSON results ('' = nowhere)")


def make_task(cfg: PosttrainBench, root: Path) -> None:
    """sft.jsonl (demonstrations), rl.jsonl (GRPO prompts), held.jsonl (held-out prompts), pairs.jsonl (DPO)."""
    rng = random.Random(0)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < 2600 + cfg.held_out:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    sft, rl, held = words[:1500], words[1500:2600], words[2600:]

    def reply(word: str) -> str:
        return word[::-1] + ("." if rng.random() < cfg.suffix_share else "")

    def near_miss(word: str) -> str:
        letters = list(word[::-1])
        at = rng.randrange(len(letters) - 1)
        letters[at], letters[at + 1] = letters[at + 1], letters[at]
        return "".join(letters) if letters != list(word[::-1]) else word

    write_jsonl(root / "sft.jsonl", [{"prompt": w, "completion": reply(w)} for w in sft])
    write_jsonl(root / "rl.jsonl", [{"prompt": w, "answer": w[::-1]} for w in rl])
    write_jsonl(root / "held.jsonl", [{"prompt": w, "answer": w[::-1]} for w in held])
    pairs = [{"prompt": w, "chosen": w[::-1], "rejected": near_miss(w)} for w in rl]
    write_jsonl(root / "pairs.jsonl", [p for p in pairs if p["chosen"] != p["rejected"]])


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def run(script: str, *args: str) -> str:
    """Run one of the project's scripts; its stdout, or a UserError with its last error line."""
    result = subprocess.run([sys.executable, str(REPO / script), *args], capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise UserError(f"{script} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return result.stdout


def held_out_pass(cfg: PosttrainBench, root: Path, out_dir: Path) -> float:
    """eval.py's greedy pass@1 on the held-out words."""
    json_out = out_dir / "held_out.json"
    run(
        "eval.py",
        f"--out_dir={out_dir}",
        "--tasks=",
        f"--prompts={root / 'held.jsonl'}",
        "--reward=exact",
        "--max_new_tokens=8",
        "--device=cpu",
        "--decode=eager",
        f"--json_out={json_out}",
    )
    return json.loads(json_out.read_text())["generative"]["pass@1"]


def common(cfg: PosttrainBench, out_dir: Path, iters: int) -> list[str]:
    return [
        f"--out_dir={out_dir}",
        "--device=cpu",
        "--compile=False",
        f"--cpu_threads={cfg.threads}",
        "--curves=False",
        f"--max_iters={iters}",
        f"--lr_decay_iters={iters}",
        "--gradient_accumulation_steps=1",
        "--overwrite=True",
    ]


def sft(cfg: PosttrainBench, root: Path) -> Path:
    data, out = root / "sft_data", root / "sft"
    run(
        "prepare_data/chat.py",
        f"--input={root / 'sft.jsonl'}",
        f"--out_dir={data}",
        "--tokenizer=char",
        "--overwrite=True",
    )
    run(
        "train.py",
        *common(cfg, out, cfg.sft_iters),
        *MODEL,
        f"--data_dir={data}",
        "--batch_size=32",
        "--learning_rate=3e-3",
        "--min_lr=3e-4",
        f"--warmup_iters={min(20, cfg.sft_iters // 10)}",
        f"--eval_interval={cfg.sft_iters}",
        "--eval_iters=5",
        "--log_interval=100",
    )
    return out


def grpo(cfg: PosttrainBench, root: Path, base: Path) -> tuple[Path, float]:
    out = root / "grpo"
    started = time.perf_counter()
    run(
        "train.py",
        *common(cfg, out, cfg.grpo_iters),
        "--objective=grpo",
        f"--init_from={base}",
        f"--grpo_prompts={root / 'rl.jsonl'}",
        "--grpo_reward=exact",
        "--grpo_max_new_tokens=8",
        f"--grpo_group_size={cfg.group_size}",
        f"--batch_size={cfg.grpo_prompts}",
        f"--learning_rate={cfg.grpo_lr}",
        "--decay_lr=False",
        f"--eval_interval={cfg.grpo_iters}",
        "--log_interval=10",
    )
    return out, time.perf_counter() - started


def dpo(cfg: PosttrainBench, root: Path, base: Path) -> dict:
    data, out = root / "prefs", root / "dpo"
    run(
        "prepare_data/preferences.py",
        f"--input={root / 'pairs.jsonl'}",
        f"--tokenizer={base}",
        f"--out_dir={data}",
        "--overwrite=True",
    )
    run(
        "train.py",
        *common(cfg, out, cfg.dpo_iters),
        "--objective=dpo",
        f"--init_from={base}",
        f"--data_dir={data}",
        "--batch_size=16",
        "--learning_rate=1e-3",
        "--min_lr=1e-4",
        f"--warmup_iters={min(5, cfg.dpo_iters // 10)}",
        "--dpo_beta=0.1",
        f"--eval_interval={cfg.dpo_iters}",
        "--eval_iters=20",
        "--log_interval=10",
    )
    evaluations = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    evaluations = [entry for entry in evaluations if "val/accuracy" in entry]
    return {"start": evaluations[0]["val/accuracy"], "end": evaluations[-1]["val/accuracy"]}


def rollout_throughput(cfg: PosttrainBench, root: Path, base: Path) -> dict:
    """tokens/s of G completions per prompt: every row in one engine batch, and one row at a time (same tokens)."""
    torch.set_num_threads(cfg.threads)
    loaded = load(str(base))
    model, tokenizer = loaded.model, loaded.tokenizer
    prompts = [p.ids for p in load_prompts(root / "held.jsonl", tokenizer)[: cfg.throughput_prompts]]
    settings = {"max_new_tokens": 8, "temperature": 1.0, "stop_tokens": stop_tokens_of(tokenizer)}
    speeds: dict[str, list[float]] = {"batched": [], "one at a time": []}
    outputs = {}
    for _ in range(cfg.repeats):
        for name, slots in (("batched", None), ("one at a time", 1)):
            started = time.perf_counter()
            made = sample_groups(model, prompts, cfg.group_size, 0, slots=slots, **settings)
            speeds[name].append(sum(len(c) for c in made) / (time.perf_counter() - started))
            outputs[name] = made
    if outputs["batched"] != outputs["one at a time"]:
        raise UserError("batched and one-at-a-time rollouts differ: the comparison would not be of the same work")
    medians = {name: statistics.median(values) for name, values in speeds.items()}
    return {**medians, "speedup": medians["batched"] / medians["one at a time"]}


def bench_posttrain(cfg: PosttrainBench) -> list[dict]:
    root = REPO / cfg.work_dir
    root.mkdir(parents=True, exist_ok=True)
    make_task(cfg, root)
    base = sft(cfg, root)
    before = held_out_pass(cfg, root, base)
    tuned, seconds = grpo(cfg, root, base)
    after = held_out_pass(cfg, root, tuned)
    accuracy = dpo(cfg, root, base)
    speed = rollout_throughput(cfg, root, base)
    rows = [
        {"what": "GRPO: held-out greedy pass@1", "before": before, "after": after, "seconds": round(seconds, 1)},
        {"what": "DPO: held-out chosen-over-rejected accuracy", "before": accuracy["start"], "after": accuracy["end"]},
        {
            "what": f"rollouts: tokens/s of G={cfg.group_size} completions of {cfg.throughput_prompts} prompts",
            "before": round(speed["one at a time"], 1),
            "after": round(speed["batched"], 1),
            "speedup": round(speed["speedup"], 2),
        },
    ]
    print_table(rows, ["what", "before", "after", "speedup"])
    print(f"GRPO: {cfg.grpo_iters} steps in {seconds:.0f} s")
    return rows


def main(argv: list[str]) -> int:
    cfg = parse_settings(PosttrainBench, argv, prog="bench_posttrain.py", description=__doc__.splitlines()[0])
    return run_benchmark(cfg, bench_posttrain, "posttrain")


if __name__ == "__main__":
    run_cli(main)
