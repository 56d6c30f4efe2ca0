"""Benchmark of prepare_data/train_tokenizer.py on Python's own standard library sources: how fast it trains, how
much memory it takes, how well it compresses held-out sources against GPT-2's BPE, and what that buys a model.

    python benchmarks/bench_tokenizer.py                                  # ~4 minutes on 2 cores
    python benchmarks/bench_tokenizer.py --vocab_sizes=8192 --seconds=30 --json_out=bench_results/tokenizer.json

The corpus: every *.py file of the standard library (site-packages left out), in sorted order; every 10th file is
held out (--held_out_every), the others, up to --train_mb, are copied into a training folder (the few test files
that are not UTF-8 on purpose are skipped, --on_decode_error=skip). Then:

1. train_tokenizer.py on the training folder once per --vocab_sizes, as a subprocess: wall time of the whole
   command, input MB/s, CPU time, peak RSS (wait4's ru_maxrss: the largest process, the training child included);
2. bytes per token of the held-out files for each trained tokenizer and GPT-2 (and cl100k_base where tiktoken has
   it offline);
3. what it buys: corpus.py prepares the training folder with GPT-2 and with the --model_vocab tokenizer (the same
   documents in val for both, which the tokenizer never saw); the same small model trains for the same wall time
   on each (--seconds: a short calibration run measures each one's seconds per step, then max_iters is set to fill
   the time, so each keeps a full learning-rate schedule); compared in val bits per byte over the whole val split.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tiktoken

from bench_prepare import run_measured
from gptkit.core.errors import UserError, run_cli
from gptkit.core.fileio import atomic_write_json
from gptkit.core.settings import parse_settings, setting, setting_list
from gptkit.data import tokenizer as tok
from measure import cpu_name, recorded_settings

REPO = Path(__file__).resolve().parent.parent
STDLIB = Path(os.__file__).parent


@dataclass(kw_only=True)
class TokenizerBench:
    stdlib: str = setting(str(STDLIB), "the standard library folder whose *.py files are the corpus")
    train_mb: float = setting(30.0, "at most this many MB of sources to train on (the rest is not used)")
    held_out_every: int = setting(10, "every n-th source file is held out for the compression figures", rule="positive")
    vocab_sizes: list[int] = setting_list([8192, 32768], "tokenizers to train (repeat the flag)")
    model_vocab: int = setting(8192, "the trained tokenizer the model comparison uses (one of --vocab_sizes)")
    val_fraction: float = setting(0.005, "corpus.py's (and the tokenizer's) val fraction", rule="fraction")
    seconds: float = setting(60.0, "training wall time per tokenizer in the model comparison (0: --iters steps)")
    iters: int = setting(0, "with --seconds=0: training steps per tokenizer", rule="non_negative")
    calibration_iters: int = setting(
        20, "steps of the run that measures seconds per step (over its second half)", rule="positive"
    )
    n_layer: int = setting(4, "model comparison: transformer blocks", rule="positive")
    n_head: int = setting(4, "model comparison: attention heads", rule="positive")
    n_embd: int = setting(128, "model comparison: embedding width", rule="positive")
    block_size: int = setting(64, "model comparison: context length in tokens", rule="positive")
    batch_size: int = setting(12, "model comparison: sequences per step", rule="positive")
    cpu_threads: int = setting(
        1,
        "model comparison: torch threads (1: per-step times hold up when other work shares the cores)",
        rule="positive",
    )
    json_out: str | None = setting(None, "write the results as JSON here")
    tmp_dir: str | None = setting(None, "where the corpus copy, tokenizers, data and checkpoints go (then deleted)")

    def validate(self) -> None:
        if self.model_vocab not in self.vocab_sizes:
            raise UserError(f"--model_vocab={self.model_vocab} must be one of --vocab_sizes {self.vocab_sizes}")
        if self.seconds <= 0 and self.iters == 0:
            raise UserError("give the model comparison a time (--seconds) or a number of steps (--iters)")


def build_corpus(cfg: TokenizerBench, work: Path) -> tuple[Path, list[Path], int]:
    """Copy the training sources into work/train (relative paths kept); returns (that folder, the held-out files,
    the training bytes)."""
    root = Path(cfg.stdlib)
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    if not files:
        raise UserError(f"--stdlib {root} holds no *.py files")
    held_out = files[:: cfg.held_out_every]
    chosen = set(held_out)
    train_dir, total = work / "train", 0
    for path in files:
        if path in chosen or total >= cfg.train_mb * 1e6:
            continue
        destination = train_dir / path.relative_to(root)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, destination)
        total += path.stat().st_size
    return train_dir, held_out, total


def tokenizer_dir(work: Path, vocab_size: int) -> Path:
    return work / f"tok_{vocab_size}"


def train_tokenizers(cfg: TokenizerBench, train_dir: Path, work: Path) -> list[dict]:
    """train_tokenizer.py once per vocabulary size: time, throughput and peak memory."""
    rows = []
    for vocab_size in cfg.vocab_sizes:
        out_dir = tokenizer_dir(work, vocab_size)
        command = [
            sys.executable,
            str(REPO / "prepare_data" / "train_tokenizer.py"),
            f"--input={train_dir}",
            f"--vocab_size={vocab_size}",
            f"--out_dir={out_dir}",
            f"--val_fraction={cfg.val_fraction}",
            "--on_decode_error=skip",
        ]
        load_before = os.getloadavg()[0]
        run = run_measured(command, work / "train_tokenizer.log")
        training = json.loads((out_dir / "tokenizer.json").read_text())["training"]
        rows.append(
            {
                "vocab_size": vocab_size,
                "input_mb": round(training["input_bytes"] / 1e6, 2),
                "trained_text_mb": round(training["text_bytes"] / 1e6, 2),
                "wall_s": round(run.seconds, 2),
                "trainer_s": training["seconds"],
                "cpu_s": round(run.cpu_seconds, 2),
                "mb_per_s": round(training["input_bytes"] / 1e6 / run.seconds, 2),
                "peak_rss_mb": round(run.max_rss_bytes / 2**20, 1),
                "tiktoken_check": training["tiktoken_check"],
                "load_avg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            }
        )
    return rows


def compression(held_out: list[Path], tokenizers: dict[str, tok.Tokenizer]) -> list[dict]:
    """Bytes per token of the held-out files (valid UTF-8 ones) for each tokenizer."""
    texts = []
    for path in held_out:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    text_bytes = sum(len(text.encode("utf-8")) for text in texts)
    rows = []
    for name, tokenizer in tokenizers.items():
        tokens = sum(len(tokenizer.encode(text)) for text in texts)
        rows.append(
            {
                "tokenizer": name,
                "vocab_size": tokenizer.vocab_size,
                "held_out_files": len(texts),
                "held_out_mb": round(text_bytes / 1e6, 2),
                "tokens": tokens,
                "bytes_per_token": round(text_bytes / tokens, 3),
            }
        )
    return rows


def reference_tokenizers() -> dict[str, tok.Tokenizer]:
    """GPT-2's BPE, and GPT-4's cl100k_base where tiktoken has it without a download."""
    found: dict[str, tok.Tokenizer] = {"gpt2": tok.TiktokenTokenizer("gpt2")}
    try:
        tiktoken.get_encoding("cl100k_base")
        found["cl100k_base (GPT-4)"] = tok.TiktokenTokenizer("cl100k_base")
    except Exception:  # not in the cache and no network: measured where it is available
        print("cl100k_base is not available offline: not measured")
    return found


def prepare(train_dir: Path, tokenizer: str, data_dir: Path, cfg: TokenizerBench, work: Path) -> dict:
    """corpus.py on the training folder; returns the val split's entry of meta.json."""
    command = [
        sys.executable,
        str(REPO / "prepare_data" / "corpus.py"),
        f"--input={train_dir}",
        f"--tokenizer={tokenizer}",
        f"--out_dir={data_dir}",
        f"--val_fraction={cfg.val_fraction}",
        f"--block_size={cfg.block_size}",
        "--on_decode_error=skip",
        "--overwrite=True",  # a run in the same work directory replaces the last one's data
    ]
    run_measured(command, work / "corpus.log")
    return json.loads((data_dir / "meta.json").read_text())["splits"]["val"]


def train_model(
    cfg: TokenizerBench, data_dir: Path, out_dir: Path, iters: int, full_split: bool, log_every: int
) -> dict:
    """train.py, the CPU recipe's optimizer and positions at the benchmark's size; returns summary.json."""
    settings = {
        "data_dir": data_dir,
        "out_dir": out_dir,
        "overwrite": True,
        "device": "cpu",
        "dtype": "float32",
        "compile": False,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_embd": cfg.n_embd,
        "block_size": cfg.block_size,
        "batch_size": cfg.batch_size,
        "gradient_accumulation_steps": 1,
        "max_iters": iters,
        "lr_decay_iters": iters,
        "warmup_iters": min(30, iters // 10),
        "eval_interval": iters,
        "eval_iters": 1,
        "log_interval": log_every,
        "eval_full_split": full_split,
        "optimizer": "muon",
        "pos_encoding": "rope",
        "qk_norm": True,
        "learning_rate": 3e-3,
        "min_lr": 3e-4,
        "beta2": 0.99,
        "always_save_checkpoint": False,
        "cpu_threads": cfg.cpu_threads,
        "curves": False,  # timed: no pictures
    }
    command = [sys.executable, str(REPO / "train.py"), *(f"--{key}={value}" for key, value in settings.items())]
    run_measured(command, out_dir.parent / f"{out_dir.name}.log")
    return json.loads((out_dir / "summary.json").read_text())


def what_it_buys(cfg: TokenizerBench, train_dir: Path, trained_dir: str, work: Path) -> list[dict]:
    """The same model for the same wall time with GPT-2 and with the trained tokenizer: val bits per byte."""
    rows = []
    for name, tokenizer in (("gpt2", "gpt2"), (f"trained {cfg.model_vocab}", trained_dir)):
        data_dir, out_dir = work / f"data_{len(rows)}", work / f"out_{len(rows)}"
        val = prepare(train_dir, tokenizer, data_dir, cfg, work)
        iters = cfg.iters
        if cfg.seconds > 0:
            half = max(1, cfg.calibration_iters // 2)  # the first steps are slower (allocations, caches)
            train_model(cfg, data_dir, out_dir, 2 * half, full_split=False, log_every=half)
            log = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
            tokens_per_s = [entry["tokens_per_s"] for entry in log if "tokens_per_s" in entry][-1]
            iters = max(1, int(cfg.seconds * tokens_per_s / (cfg.batch_size * cfg.block_size)))
        summary = train_model(cfg, data_dir, out_dir, iters, full_split=True, log_every=iters)
        bpb = summary["val_loss_full"] / math.log(2) * val["tokens"] / val["text_bytes"]
        if cfg.seconds > 0 and abs(summary["train_seconds"] / cfg.seconds - 1) > 0.25:
            print(f"warning: {name} trained {summary['train_seconds']:.0f} s, not {cfg.seconds:.0f} (other load?)")
        rows.append(
            {
                "tokenizer": name,
                "iters": iters,
                "train_s": summary["train_seconds"],
                "tokens_per_s": summary["tokens_per_s"],
                "val_tokens": val["tokens"],
                "val_mb": round(val["text_bytes"] / 1e6, 3),
                "val_loss_per_token": round(summary["val_loss_full"], 4),
                "val_bits_per_byte": round(bpb, 4),
                "bytes_seen": round(iters * cfg.batch_size * cfg.block_size * val["text_bytes"] / val["tokens"]),
            }
        )
    return rows


def print_tables(result: dict) -> None:
    print(
        f"{'vocab':>7} {'input MB':>9} {'wall s':>7} {'MB/s':>6} {'CPU s':>6} {'peak RSS MB':>12}  tiktoken == trainer"
    )
    for row in result["training"]:
        check = row["tiktoken_check"]
        same = "yes" if check["texts_encoded_differently"] == 0 else f"NO ({check['texts_encoded_differently']})"
        print(
            f"{row['vocab_size']:>7} {row['input_mb']:>9.1f} {row['wall_s']:>7.1f} {row['mb_per_s']:>6.2f} "
            f"{row['cpu_s']:>6.1f} {row['peak_rss_mb']:>12.1f}  {same} on {check['chars']:,} chars"
        )
    print(f"\n{'tokenizer':<22} {'vocab':>7} {'bytes/token':>12}  (held-out stdlib sources)")
    for row in result["compression"]:
        print(f"{row['tokenizer']:<22} {row['vocab_size']:>7} {row['bytes_per_token']:>12.3f}")
    print(f"\n{'tokenizer':<22} {'steps':>6} {'train s':>8} {'val loss/token':>15} {'val bits/byte':>14}")
    for row in result["model"]:
        print(
            f"{row['tokenizer']:<22} {row['iters']:>6} {row['train_s']:>8.1f} {row['val_loss_per_token']:>15.4f} "
            f"{row['val_bits_per_byte']:>14.4f}"
        )


def main(argv: list[str]) -> int:
    cfg = parse_settings(TokenizerBench, argv, prog="bench_tokenizer.py", description=__doc__.splitlines()[0])
    result: dict = {
        "benchmark": "prepare_data/train_tokenizer.py on standard library sources",
        "machine": {
            "cpu": cpu_name(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "settings": recorded_settings(cfg),
    }
    with tempfile.TemporaryDirectory(prefix="bench_tokenizer_", dir=cfg.tmp_dir) as tmp:
        work = Path(tmp)
        train_dir, held_out, train_bytes = build_corpus(cfg, work)
        result["corpus"] = {"train_mb": round(train_bytes / 1e6, 2), "held_out_files": len(held_out)}
        result["training"] = train_tokenizers(cfg, train_dir, work)
        trained = {
            f"trained {row['vocab_size']}": tok.make_tokenizer(str(tokenizer_dir(work, row["vocab_size"])))
            for row in result["training"]
        }
        result["compression"] = compression(held_out, {**reference_tokenizers(), **trained})
        result["model"] = what_it_buys(cfg, train_dir, str(tokenizer_dir(work, cfg.model_vocab)), work)
    print_tables(result)
    if cfg.json_out:
        atomic_write_json(cfg.json_out, result)
        print(f"wrote {cfg.json_out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
