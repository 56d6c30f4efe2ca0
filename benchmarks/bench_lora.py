"""LoRA against full fine-tuning: trainable parameters, memory and step time of a GPT-2 124M-shaped model; and LoRA
over a bfloat16, int8 and int4 (QLoRA) base on a larger shape.

    python benchmarks/bench_lora.py [--batch_size=2 --block_size=256 --steps=4 --json_out=bench_results/lora.json]
    python benchmarks/bench_lora.py --bases=True --shape=smollm2-1.7b --batch_size=1 --steps=3
    python benchmarks/bench_lora.py --quality=True   # held-out exact match of LoRA against full fine-tuning

Each mode runs in a process of its own (so its peak resident memory is its own): a model with random weights (GPT-2
124M-shaped, or a shape of measure.MODEL_SHAPES), AdamW over what trains, `steps` training steps on random tokens
after one warm-up step. Memory is given as the bytes of weights, gradients and optimizer state, counted tensor by
tensor, and of the frozen weights alone; and as the process's resident set (/proc/self/status): its peak while the
model is made and adapted (the float32 model every mode is built from, as train.py builds it), its peak over the
training steps, and what stays resident after them. --bases runs only LoRA on every block's Linear layers over the
three compact bases, for shapes whose full fine-tuning would not fit in memory.

With --quality, the usual LoRA job: a small base (2 layers, 64 wide) learns to reverse four-letter words from plain
text ("reverse abcd = dcba"), then is taught to do it in the chat format from a few hundred conversations, once fully
and once with adapters, through prepare_data/chat.py and train.py. Each model, the base included, is scored by exact
greedy replies on words no run saw, asked in a conversation and in the text form.
"""

from __future__ import annotations

import contextlib
import itertools
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
from gptkit.weights.lora import LoraConfig, LoraLinear, add_lora
from measure import MODEL_SHAPES, print_table, run_benchmark

MODES = {
    "full fine-tuning": None,
    "LoRA attention": ("attention", "float32"),
    "LoRA all": ("all", "float32"),
    "LoRA all, bfloat16 base": ("all", "bfloat16"),
    "LoRA all, int8 base": ("all", "int8"),
    "LoRA all, int4 base (QLoRA)": ("all", "int4"),
}
BASE_MODES = ["LoRA all, bfloat16 base", "LoRA all, int8 base", "LoRA all, int4 base (QLoRA)"]


@dataclass(kw_only=True)
class LoraBench:
    batch_size: int = setting(2, "sequences per step", rule="positive")
    block_size: int = setting(256, "tokens per sequence", rule="positive")
    steps: int = setting(4, "timed steps per mode (after one warm-up step)", rule="positive")
    rank: int = setting(8, "the adapters' rank", rule="positive")
    n_layer: int = setting(12, "model shape: layers (GPT-2 124M: 12)", rule="positive")
    n_embd: int = setting(768, "model shape: width (768; 64 per head)", rule="positive")
    shape: str = setting(
        "",
        "a shape of measure.MODEL_SHAPES instead (smollm2-1.7b, ...); '' = n_layer and n_embd",
        choices=("", *MODEL_SHAPES),
    )
    bases: bool = setting(False, "only LoRA on all layers over a bfloat16, int8 and int4 base (no full fine-tuning)")
    mode: str = setting("", "internal: run this one mode and print its figures as JSON")
    quality: bool = setting(False, "measure held-out exact match on a chat-format task instead (full against LoRA)")
    work_dir: str = setting("bench_results/lora_quality", "--quality: where its data and runs go")
    json_out: str = setting("bench_results/lora.json", "where to write the JSON results ('' = nowhere)")


def model_config(cfg: LoraBench) -> GPTConfig:
    """The benchmark's model: cfg.shape's, else GPT-2 124M's with cfg's layers and width."""
    if cfg.shape:
        return GPTConfig(**{**MODEL_SHAPES[cfg.shape], "dropout": 0.0})
    shape = {"n_layer": cfg.n_layer, "n_head": max(1, cfg.n_embd // 64), "n_embd": cfg.n_embd}
    return GPTConfig(block_size=1024, vocab_size=50304, dropout=0.0, **shape)


def one_mode(cfg: LoraBench) -> dict:
    """Train `cfg.mode` for a few steps in this process; its figures."""
    torch.manual_seed(0)
    config = model_config(cfg)
    model = GPT(config)  # float32, as train.py makes or loads the model it adapts
    total = sum(p.numel() for p in model.parameters())
    if MODES[cfg.mode] is not None:
        targets, base_weights = MODES[cfg.mode]
        add_lora(model, LoraConfig(rank=cfg.rank, alpha=2.0 * cfg.rank, targets=targets), base_weights)
    optimizer = configure_optimizers(model, 0.1, 1e-4, (0.9, 0.95), "cpu")
    x = torch.randint(0, config.vocab_size, (cfg.batch_size, cfg.block_size))
    setup_peak = resident_mb("VmHWM")
    steps_peak_apart = reset_peak()
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
        "shape": cfg.shape or f"{cfg.n_layer} layers, {cfg.n_embd} wide",
        "rank": None if MODES[cfg.mode] is None else cfg.rank,
        "trainable_params": trainable,
        "trainable_share": round(trainable / total, 5),
        "weights_grads_optimizer_mb": round(held / 2**20, 1),
        "frozen_weights_mb": round(frozen_bytes(model) / 2**20, 1),
        "adapted_base_bytes": None if MODES[cfg.mode] is None else adapted_base_bytes(model),
        "setup_peak_rss_mb": setup_peak,
        "steps_peak_rss_mb": resident_mb("VmHWM") if steps_peak_apart else None,
        "steady_rss_mb": resident_mb("VmRSS"),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "step_ms_median": round(1000 * statistics.median(seconds), 1),
    }


def resident_mb(field: str) -> float | None:
    """The process's resident set (VmRSS) or its peak (VmHWM) in MiB, from /proc/self/status (None elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


def reset_peak() -> bool:
    """Set the process's peak resident set back to what is resident now (Linux), so that the training steps' peak
    is read apart from the set-up's; whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the weights (parameters and buffers), their gradients and the optimizer's state, counted tensor by
    tensor (a tied matrix once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    tensors.update({id(p.grad): p.grad for p in model.parameters() if p.grad is not None})
    for state in optimizer.state.values():
        tensors.update({id(v): v for v in state.values() if isinstance(v, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def frozen_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights that do not train: frozen parameters and the buffers (stored bases, rotary tables)."""
    tensors = {id(p): p for p in model.parameters() if not p.requires_grad}
    tensors.update({id(b): b for b in model.buffers()})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def adapted_base_bytes(model: torch.nn.Module) -> int:
    """Bytes of the adapted layers' frozen weights as they are held (bfloat16, int8 and row scales, int4 blocks)."""
    layers = [module for module in model.modules() if isinstance(module, LoraLinear)]
    return sum(t.numel() * t.element_size() for layer in layers for t in layer.stored_base())


def mode_arguments(cfg: LoraBench, mode: str) -> list[str]:
    """The command-line settings that run `mode` alone with cfg's shape and sizes."""
    sizes = ["batch_size", "block_size", "steps", "rank", "n_layer", "n_embd", "shape"]
    return [f"--mode={mode}", *(f"--{name}={getattr(cfg, name)}" for name in sizes), "--json_out="]


def bench_lora(cfg: LoraBench) -> list[dict]:
    """Every mode (--bases: the three compact bases) in a fresh process, one after the other."""
    rows = []
    for mode in BASE_MODES if cfg.bases else MODES:
        result = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *mode_arguments(cfg, mode)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print_table(rows[-1:], ["mode", "steps_peak_rss_mb", "step_ms_median"])  # progress on a long run
    first = rows[0]  # full fine-tuning, or the bfloat16 base
    for row in rows:
        row["x_first_step_time"] = round(row["step_ms_median"] / first["step_ms_median"], 3)
        row["x_first_peak_rss"] = round(row["peak_rss_mb"] / first["peak_rss_mb"], 3)
    columns = ["mode", "trainable_params", "weights_grads_optimizer_mb", "frozen_weights_mb", "setup_peak_rss_mb"]
    print_table(rows, [*columns, "steps_peak_rss_mb", "steady_rss_mb", "step_ms_median", "x_first_step_time"])
    return rows


# ----------------------------------------------------------------------------- --quality: a held-out task

LETTERS = "abcdefgh"
HELD_OUT = 200  # words no run sees, the score's
CHAT_WORDS = 400  # words of the fine-tune's conversations (the base saw them too, in text form)
TASK_RUN = ["--device=cpu", "--compile=False", "--gradient_accumulation_steps=1", "--eval_iters=2", "--curves=False"]
BASE_SHAPE = ["--n_layer=2", "--n_head=4", "--n_embd=64", "--bias=False"]
BASE_RUN = ["--block_size=64", "--batch_size=32", "--max_iters=1500", "--warmup_iters=50", "--lr_decay_iters=1500"]
BASE_LR = ["--learning_rate=3e-3", "--min_lr=3e-4", "--eval_interval=500"]
FINE_TUNE = ["--block_size=32", "--batch_size=32", "--max_iters=200", "--warmup_iters=10", "--lr_decay_iters=200"]
# Each at the rate that taught the format while keeping the text form best; LoRA's update starts at zero and
# moves only through rank-8 products, so it takes a larger rate.
FULL_LR = ["--learning_rate=3e-4", "--min_lr=3e-5"]
LORA_LR = ["--learning_rate=3e-3", "--min_lr=3e-4"]


def script(*args: object) -> None:
    repo = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, *map(str, args)], cwd=repo, check=True, capture_output=True, text=True)


def task_words() -> tuple[list[str], list[str]]:
    """(held out, trained): all four-letter words over LETTERS in a seeded order."""
    words = ["".join(letters) for letters in itertools.product(LETTERS, repeat=4)]
    random.Random(0).shuffle(words)
    return words[:HELD_OUT], words[HELD_OUT:]


def text_line(word: str) -> str:
    """The skill in plain text, as the base learns it."""
    return f"reverse {word} = {word[::-1]}"


def conversation(word: str) -> list[dict]:
    """The same skill as a chat exchange: the format the fine-tune teaches."""
    return [{"role": "user", "content": f"reverse {word}"}, {"role": "assistant", "content": word[::-1]}]


def greedy_is(model: torch.nn.Module, prompt: list[int], expected: list[int]) -> bool:
    """Whether greedy decoding after `prompt` gives exactly the tokens `expected`."""
    from gptkit.infer import generate

    out = generate(model, torch.tensor([prompt]), len(expected), temperature=0.0)
    return out[0, len(prompt) :].tolist() == expected


def exact_match(model: torch.nn.Module, tokenizer, held_out: list[str]) -> dict:
    """The share of held-out words reversed exactly: asked in a conversation (the reply, then the end of the turn)
    and in the base's text form (the word after "="), greedy."""
    chat = text = 0
    for word in held_out:
        prompt = tokenizer.chat.render_prompt(conversation(word)[:1], tokenizer)
        chat += greedy_is(model, prompt, [*tokenizer.encode(word[::-1]), tokenizer.chat.end_of_turn])
        line = text_line(word)
        text += greedy_is(model, tokenizer.encode("\n" + line[:-4]), tokenizer.encode(line[-4:]))
    return {"held_out_chat_exact_match": chat / len(held_out), "held_out_text_exact_match": text / len(held_out)}


def write_task_data(root: Path, held_out: list[str], trained: list[str]) -> None:
    """The base's text (every trained word, many times, shuffled) and the fine-tune's conversations."""
    rng = random.Random(1)
    lines = [text_line(word) for word in trained for _ in range(8)]
    rng.shuffle(lines)
    (root / "base.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with (root / "chat.jsonl").open("w", encoding="utf-8") as handle:
        for word in trained[:CHAT_WORDS]:
            handle.write(json.dumps({"messages": conversation(word)}) + "\n")


def bench_quality(cfg: LoraBench) -> list[dict]:
    """A base that reverses words in plain text is taught to answer in the chat format, fully and with adapters;
    each model is scored on held-out words, in both forms."""
    from gptkit.data.meta import read_meta
    from gptkit.data.tokenizer import tokenizer_from_meta
    from gptkit.weights import load

    root = Path(cfg.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    held_out, trained = task_words()
    write_task_data(root, held_out, trained)
    text = [
        "--tokenizer=char",
        f"--input={root / 'base.txt'}",
        f"--out_dir={root / 'text'}",
        "--block_size=64",
        "--overwrite=True",  # a run in the same work directory replaces the last one's data
    ]
    script("prepare_data/corpus.py", *text)
    base = [f"--data_dir={root / 'text'}", f"--out_dir={root / 'base'}", "--overwrite=True"]
    script("train.py", *TASK_RUN, *BASE_SHAPE, *BASE_RUN, *BASE_LR, *base)
    chat = ["prepare_data/chat.py", f"--input={root / 'chat.jsonl'}", f"--tokenizer={root / 'base'}"]
    script(*chat, f"--out_dir={root / 'chat'}", "--block_size=32", "--overwrite=True")
    # The base as both fine-tunes start: the chat markers' new rows added, as train.py adds them.
    model = load(str(root / "base")).model
    tokenizer = tokenizer_from_meta(read_meta(root / "chat")["tokenizer"])
    model.grow_vocabulary(tokenizer.vocab_size)
    rows = [{"mode": "base (no fine-tuning)", "trained_params": 0, **exact_match(model, tokenizer, held_out)}]
    lora = [f"--lora_rank={cfg.rank}", f"--lora_alpha={2 * cfg.rank}", "--lora_targets=all"]
    for name, extra in {"full fine-tuning": FULL_LR, f"LoRA r{cfg.rank} all": [*lora, *LORA_LR]}.items():
        out = root / name.replace(" ", "_")
        tune = [f"--init_from={root / 'base'}", f"--data_dir={root / 'chat'}", f"--out_dir={out}", "--overwrite=True"]
        script("train.py", *TASK_RUN, *FINE_TUNE, *extra, *tune, "--eval_interval=1000")  # one evaluation, at the end
        loaded = load(str(out))
        model, tokenizer = loaded.model, loaded.tokenizer
        rows.append({"mode": name, "trained_params": stored_params(out), **exact_match(model, tokenizer, held_out)})
    for row in rows:
        row["held_out"] = len(held_out)
    print_table(rows, ["mode", "trained_params", "held_out_chat_exact_match", "held_out_text_exact_match"])
    return rows


def stored_params(out_dir: Path) -> int:
    """The numbers a run trained, as its checkpoint stores them (every weight, or the adapters and new token rows);
    a tied matrix, stored under two names, counts once."""
    from gptkit.weights.checkpoint import load_checkpoint

    tensors = load_checkpoint(out_dir / "ckpt.pt")["model"].values()
    return sum({t.untyped_storage().data_ptr(): t.numel() for t in tensors}.values())


def main(argv: list[str]) -> int:
    cfg = parse_settings(LoraBench, argv, prog="bench_lora.py", description=bench_lora.__doc__ or "")
    if cfg.mode:
        print(json.dumps(one_mode(cfg)))
        return 0
    return run_benchmark(cfg, bench_quality if cfg.quality else bench_lora, "lora")


if __name__ == "__main__":
    run_cli(main)
