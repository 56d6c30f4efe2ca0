"""Chat fine-tuning against plain training of the same model on the same tokens: what masking and packing cost.

    python benchmarks/bench_chat.py [--conversations=2000 --repeats=3 --json_out=bench_results/chat.json]

It makes synthetic conversations (GPT-2 BPE ids, one to four exchanges of lengths drawn from a log-normal, as real
chat data varies) and writes them twice: as chat data (prepared with the template: packed rows, loss on assistant
tokens) and as plain token data of the very same ids. train.py then trains the same model on each for `iters`
steps, the two alternating for `repeats` rounds; tokens/s is train.py's own figure (positions processed per second
of training; the plain data writes the template's markers as end-of-text). It also reports the share of padding in the packed rows and of trained (assistant) tokens.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data.conversations import open_conversations
from gptkit.data.packing import PackedBatches
from gptkit.data.prepare.writer import DatasetWriter, write_dataset
from gptkit.data.tokenizer import ChatTokenizer, make_tokenizer
from measure import print_table, run_benchmark

REPO = Path(__file__).resolve().parent.parent


@dataclass(kw_only=True)
class ChatBench:
    conversations: int = setting(2000, "synthetic conversations in the train split", rule="positive")
    iters: int = setting(12, "training steps per run", rule="positive")
    repeats: int = setting(3, "rounds of both runs, alternating", rule="positive")
    n_layer: int = setting(4, "model shape: layers", rule="positive")
    n_head: int = setting(4, "model shape: heads", rule="positive")
    n_embd: int = setting(256, "model shape: width", rule="positive")
    block_size: int = setting(256, "context (rows of packed conversations)", rule="positive")
    batch_size: int = setting(8, "rows per step", rule="positive")
    work_dir: str = setting("bench_results/chat_data", "where the data and the runs go")
    json_out: str = setting("bench_results/chat.json", "where to write the JSON results ('' = nowhere)")


def synthetic_conversations(count: int, seed: int) -> list[list[dict[str, str]]]:
    """Conversations of words from a fixed list, turns of log-normally distributed lengths."""
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "as",
        "with",
        "was",
        "on",
        "be",
        "by",
        "at",
        "this",
        "from",
        "which",
        "or",
        "have",
        "an",
        "are",
        "not",
    ]
    conversations = []
    for _ in range(count):
        messages = []
        for _ in range(int(rng.integers(1, 5))):
            for role in ("user", "assistant"):
                length = int(np.clip(rng.lognormal(mean=3.0, sigma=0.8), 1, 120))
                messages.append({"role": role, "content": " ".join(rng.choice(words, size=length))})
        conversations.append(messages)
    return conversations


def write_both(cfg: ChatBench, root: Path) -> dict:
    """Chat data and plain data of the same ids; returns the packing figures."""
    tokenizer = ChatTokenizer.extending(make_tokenizer("gpt2"))
    rendered = {
        split: [tokenizer.chat.render(m, tokenizer) for m in synthetic_conversations(count, seed)]
        for split, count, seed in (("train", cfg.conversations, 0), ("val", max(50, cfg.conversations // 20), 1))
    }
    with DatasetWriter(root / "chat", "uint16", side_streams=True) as writer:
        for split, items in rendered.items():
            for ids, mask in items:
                if len(ids) <= cfg.block_size + 1:  # as prepare_data/chat.py --too_long=drop
                    writer.write_conversation(split, ids, mask, len(ids))
        writer.commit(tokenizer, {"synthetic": True})
    plain = {}
    for split in rendered:
        ids = open_conversations(root / "chat", split).tokens.read_windows([0], _tokens(root, split))[0]
        ids = np.where(ids >= tokenizer.base.vocab_size, tokenizer.eot_token, ids)  # plain text has no markers
        plain[split] = (ids.astype(np.uint16), len(ids), 1)
    write_dataset(root / "plain", tokenizer.base, plain, {"synthetic": True})
    packed = PackedBatches(open_conversations(root / "chat", "train"), cfg.batch_size, cfg.block_size, seed=0)
    trained = packed.trained.sum() / (packed.rows_per_epoch() * (cfg.block_size + 1))
    return {"padding_share": packed.padding_share(), "trained_share": float(trained)}


def _tokens(root: Path, split: str) -> int:
    return json.loads((root / "chat" / "meta.json").read_text())["splits"][split]["tokens"]


def train_once(cfg: ChatBench, data: Path, out: Path) -> float:
    """train.py for cfg.iters steps; its tokens/s."""
    args = [
        f"--data_dir={data}",
        f"--out_dir={out}",
        "--overwrite=True",
        "--device=cpu",
        "--compile=False",
        f"--n_layer={cfg.n_layer}",
        f"--n_head={cfg.n_head}",
        f"--n_embd={cfg.n_embd}",
        f"--block_size={cfg.block_size}",
        f"--batch_size={cfg.batch_size}",
        "--gradient_accumulation_steps=1",
        f"--max_iters={cfg.iters}",
        f"--eval_interval={cfg.iters}",
        "--eval_iters=1",
        f"--log_interval={cfg.iters}",
        "--curves=False",
        "--always_save_checkpoint=False",
    ]
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise UserError(f"train.py failed: {result.stderr.strip().splitlines()[-1]}")
    return json.loads((out / "summary.json").read_text())["tokens_per_s"]


def bench_chat(cfg: ChatBench) -> list[dict]:
    """Chat fine-tuning tokens/s against plain training of the same tokens, and the packing figures."""
    root = Path(cfg.work_dir)
    packing = write_both(cfg, root)
    speeds: dict[str, list[float]] = {"plain": [], "chat": []}
    for _ in range(cfg.repeats):
        for kind in speeds:
            speeds[kind].append(train_once(cfg, root / kind, root / f"run_{kind}"))
    plain = statistics.median(speeds["plain"])
    rows = [
        {
            "mode": kind,
            "tokens_per_s_median": round(statistics.median(values), 1),
            "runs": [round(v, 1) for v in values],
            "x_plain": round(statistics.median(values) / plain, 3),
            **(packing if kind == "chat" else {}),
        }
        for kind, values in speeds.items()
    ]
    print_table(rows, ["mode", "tokens_per_s_median", "x_plain", "padding_share", "trained_share"])
    return rows


def main(argv: list[str]) -> int:
    cfg = parse_settings(ChatBench, argv, prog="bench_chat.py", description=bench_chat.__doc__ or "")
    return run_benchmark(cfg, bench_chat, "chat")


if __name__ == "__main__":
    run_cli(main)
