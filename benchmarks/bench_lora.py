"""LoRA against full fine-tuning: trainable parameters, peak memory and step time of a GPT-2 124M-shaped model.

    python benchmarks/bench_lora.py [--batch_size=2 --block_size=256 --steps=4 --json_out=bench_results/lora.json]
    python benchmarks/bench_lora.py --quality=True   # held-out exact match of LoRA against full fine-tuning

Each mode runs in a process of its own (so its peak resident memory is its own): a GPT-2 124M-shaped model with
random weights, AdamW over what trains, `steps` training steps on random tokens after one warm-up step. Memory is
given twice: the bytes of weights, gradients and optimizer state, counted tensor by tensor; and the process's peak
resident set (ru_maxrss), which also holds the runtime and the float32 model every mode is built from first.

With --quality, it fine-tunes a small base (2 layers, 64 wide, trained on plain text of the task's characters) on
conversations that ask to reverse a four-letter word, once fully and once with adapters, through prepare_data/chat.py
and train.py, and counts the exact greedy replies on words neither run saw.
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkit.core.errors import run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.model import GPT, GPTConfig
from gptkit.train.optim import configure_optimizers
from gptkit.weights.lora import LoraConfig, add_lora
from measure import print_table, run_benchmark

MODES = {
    "full fine-tuning": None,
    "LoRA attention": ("attention", "float32"),
    "LoRA all": ("all", "float32"),
    "LoRA all, bfloat16 base": ("all", "bfloat16"),
    "LoRA all, int8 base": ("all", "int8"),
}


@dataclass
class LoraBench:
    batch_size: int = setting(2, "sequences per step", rule="positive")
    block_size: int = setting(256, "tokens per sequence", rule="positive")
    steps: int = setting(4, "timed steps per mode (after one warm-up step)", rule="positive")
    rank: int = setting(8, "the adapters' rank", rule="positive")
    n_layer: int = setting(12, "model shape: layers (GPT-2 124M: 12)", rule="positive")
    n_embd: int = setting(768, "model shape: width (768; 64 per head)", rule="positive")
    mode: str = setting("", "internal: run this one mode and print its figures as JSON")
    quality: bool = setting(False, "measure held-out exact match on a small task instead (full against LoRA)")
    work_dir: str = setting("bench_results/lora_quality", "--quality: where its data and runs go")
    json_out: str = setting("bench_results/lora.json", "where to write the JSON results ('' = nowhere)")


def one_mode(cfg: LoraBench) -> dict:
    """Train `cfg.mode` for a few steps in this process; its figures."""
    torch.manual_seed(0)
    shape = {"n_layer": cfg.n_layer, "n_head": max(1, cfg.n_embd // 64), "n_embd": cfg.n_embd}
    model = GPT(GPTConfig(block_size=1024, vocab_size=50304, dropout=0.0, **shape))
    total = sum(p.numel() for p in model.parameters())
    if MODES[cfg.mode] is not None:
        targets, base_weights = MODES[cfg.mode]
        add_lora(model, LoraConfig(rank=cfg.rank, alpha=2.0 * cfg.rank, targets=targets), base_weights)
    optimizer = configure_optimizers(model, 0.1, 1e-4, (0.9, 0.95), "cpu")
    x = torch.randint(0, 50257, (cfg.batch_size, cfg.block_size))
    seconds = []
    for step in range(cfg.steps + 1):
        start = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        if step == 0:
            held = state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if step:
            seconds.append(time.perf_counter() - start)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "mode": cfg.mode,
        "rank": None if MODES[cfg.mode] is None else cfg.rank,
        "trainable_params": trainable,
        "trainable_share": round(trainable / total, 5),
        "weights_grads_optimizer_mb": round(held / 2**20, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "step_ms_median": round(1000 * statistics.median(seconds), 1),
    }


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the weights (parameters and buffers), their gradients and the optimizer's state, counted tensor by
    tensor (a tied matrix once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    tensors.update({id(p.grad): p.grad for p in model.parameters() if p.grad is not None})
    for state in optimizer.state.values():
        tensors.update({id(v): v for v in state.values() if isinstance(v, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def bench_lora(cfg: LoraBench) -> list[dict]:
    """Every mode in a fresh process, one after the other."""
    rows = []
    for mode in MODES:
        args = [f"--mode={mode}", f"--batch_size={cfg.batch_size}", f"--block_size={cfg.block_size}"]
        args += [f"--steps={cfg.steps}", f"--rank={cfg.rank}", f"--n_layer={cfg.n_layer}", f"--n_embd={cfg.n_embd}"]
        args.append("--json_out=")
        result = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True, check=True
        )
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    full = rows[0]
    for row in rows:
        row["x_full_step_time"] = round(row["step_ms_median"] / full["step_ms_median"], 3)
        row["x_full_peak_rss"] = round(row["peak_rss_mb"] / full["peak_rss_mb"], 3)
    columns = ["mode", "trainable_params", "weights_grads_optimizer_mb", "peak_rss_mb", "step_ms_median"]
    print_table(rows, [*columns, "x_full_step_time"])
    return rows


# ----------------------------------------------------------------------------- --quality: a held-out task

LETTERS = "abcdefgh"
TASK_RUN = ["--device=cpu", "--compile=False", "--gradient_accumulation_steps=1", "--eval_iters=2", "--curves=False"]


def script(*args: object) -> None:
    repo = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, *map(str, args)], cwd=repo, check=True, capture_output=True, text=True)


def task_words() -> tuple[list[str], list[str]]:
    """(held out, trained): distinct four-letter words in a seeded order."""
    rng = random.Random(0)
    words = sorted({"".join(rng.choice(LETTERS) for _ in range(4)) for _ in range(4000)})
    rng.shuffle(words)
    return words[:200], words[200:]


def exact_match(out_dir: Path, held_out: list[str]) -> float:
    from gptkit.infer import generate
    from gptkit.weights.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("resume", str(out_dir))
    right = 0
    for word in held_out:
        prompt = tokenizer.chat.render_prompt([{"role": "user", "content": f"reverse {word}"}], tokenizer)
        out = generate(model, torch.tensor([prompt]), 5, temperature=0.0, stop_tokens=tokenizer.chat.reply_stops)
        reply = out[0, len(prompt) :].tolist()
        right += tokenizer.decode(reply[:4]) == word[::-1] and reply[4:5] == [tokenizer.chat.end_of_turn]
    return right / len(held_out)


def bench_quality(cfg: LoraBench) -> list[dict]:
    root = Path(cfg.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    held_out, trained = task_words()
    text = "\n".join(f"reverse {random.Random(i).choice(trained)}" for i in range(3000))
    (root / "base.txt").write_text(text + "\n", encoding="utf-8")
    with (root / "chat.jsonl").open("w", encoding="utf-8") as handle:
        for word in trained:
            messages = [{"role": "user", "content": f"reverse {word}"}, {"role": "assistant", "content": word[::-1]}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    script(
        "prepare_data/corpus.py",
        f"--input={root / 'base.txt'}",
        "--tokenizer=char",
        f"--out_dir={root / 'text'}",
        "--block_size=32",
    )
    shape = ["--n_layer=2", "--n_head=4", "--n_embd=64", "--block_size=32", "--bias=False"]
    script(
        "train.py",
        *TASK_RUN,
        *shape,
        f"--data_dir={root / 'text'}",
        f"--out_dir={root / 'base'}",
        "--overwrite=True",
        "--max_iters=60",
        "--eval_interval=60",
        "--batch_size=16",
        "--learning_rate=3e-3",
        "--warmup_iters=5",
    )
    script(
        "prepare_data/chat.py",
        f"--input={root / 'chat.jsonl'}",
        f"--tokenizer={root / 'base'}",
        f"--out_dir={root / 'chat'}",
        "--block_size=32",
    )
    schedule = [
        "--max_iters=500",
        "--eval_interval=500",
        "--batch_size=32",
        "--warmup_iters=10",
        "--lr_decay_iters=500",
    ]
    runs = {
        "full fine-tuning": ["--learning_rate=3e-3", "--min_lr=3e-4"],
        f"LoRA r{cfg.rank} all": [
            f"--lora_rank={cfg.rank}",
            "--lora_targets=all",
            "--learning_rate=1e-2",
            "--min_lr=1e-3",
        ],
    }
    rows = []
    for name, extra in runs.items():
        out = root / name.replace(" ", "_")
        script(
            "train.py",
            *TASK_RUN,
            *schedule,
            *extra,
            f"--init_from={root / 'base'}",
            f"--data_dir={root / 'chat'}",
            f"--out_dir={out}",
            "--overwrite=True",
        )
        rows.append({"mode": name, "held_out_exact_match": exact_match(out, held_out), "held_out": len(held_out)})
    print_table(rows, ["mode", "held_out_exact_match", "held_out"])
    return rows


def main(argv: list[str]) -> int:
    cfg = parse_settings(LoraBench, argv, prog="bench_lora.py", description=bench_lora.__doc__ or "")
    if cfg.mode:
        print(json.dumps(one_mode(cfg)))
        return 0
    return run_benchmark(cfg, bench_quality if cfg.quality else bench_lora, "lora")


if __name__ == "__main__":
    run_cli(main)
