"""The settings every streaming preparation script shares (corpus.py, fineweb.py): declared and checked here only.

A script's settings class derives from `PrepareSettings` and adds its own settings. It re-declares a shared one
only where its default or help text differs; a re-declared field keeps its place in --help. The defaults here are
those of a corpus of your own (prepare_data/corpus.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptkit.core.errors import UserError
from gptkit.core.settings import setting, setting_list

DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 256
DECODE_POLICIES = ("error", "replace", "skip")


def input_setting() -> Any:
    """--input, as corpus.py and train_tokenizer.py both take it."""
    return setting_list([], "input file, directory (recursive) or glob; repeat for more")


def include_setting() -> Any:
    """--include, as corpus.py and train_tokenizer.py both take it."""
    return setting_list(
        [], "in directories and globs, read only files matching this glob (relative path or name); repeatable"
    )


def exclude_setting() -> Any:
    """--exclude, as corpus.py and train_tokenizer.py both take it."""
    return setting_list([], "in directories and globs, leave out files and folders matching this glob; repeatable")


def bpe_dir_setting() -> Any:
    """--bpe_dir, as every script that may build GPT-2's BPE takes it."""
    return setting(None, "directory with GPT-2's vocab.bpe + encoder.json, to work offline")


def decode_error_setting() -> Any:
    """--on_decode_error, for the scripts that read bytes (parquet text arrives decoded)."""
    return setting(
        "error", "invalid UTF-8: error (stop), replace (U+FFFD), skip (drop the document)", choices=DECODE_POLICIES
    )


def default_num_workers() -> int:
    """The CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


@dataclass(kw_only=True)
class PrepareSettings:
    """How a corpus is split, tokenised and written; `validate` refuses impossible values with one line."""

    out_dir: str = setting("data/corpus", "output directory for the token files and meta.json")
    tokenizer: str = setting(
        "gpt2",
        "gpt2, char, any tiktoken encoding name (e.g. cl100k_base), a prepare_data/train_tokenizer.py dir, a "
        "Hugging Face model dir (its tokenizer.json) or hub name (owner/name), or a .gguf file (or owner/name:TAG)",
    )
    bpe_dir: str | None = bpe_dir_setting()
    text_field: str = setting("text", "JSONL field holding each document's text")
    val_fraction: float = setting(0.05, "fraction of documents (or of a single document's text) for val")
    seed: int = setting(1337, "seed of the train/val assignment")
    shard_tokens: int | None = setting(None, "tokens per output shard; None writes one train.bin and one val.bin")
    block_size: int = setting(256, "training context length: each split must hold at least block_size + 1 tokens")
    num_workers: int = setting(default_num_workers(), "tokenising processes (1 = in the main process)")
    chunk_bytes: int = setting(DEFAULT_CHUNK_BYTES, "bytes of text per tokenisation task")
    overwrite: bool = setting(False, "replace the data already in out_dir (its meta.json and token files)")

    # Only input read as bytes can be invalid UTF-8, so only corpus.py declares --on_decode_error (as a field that
    # replaces this plain class attribute); parquet text arrives decoded and fineweb.py has no such flag.
    on_decode_error = "error"

    def validate(self) -> None:
        """UserError for impossible values of the shared settings."""
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"--val_fraction must be between 0 and 1 (exclusive), got {self.val_fraction}")
        if self.shard_tokens is not None and self.shard_tokens < 1:
            raise UserError("--shard_tokens must be a positive number of tokens, or None for one file per split")
        if self.block_size < 1:
            raise UserError("--block_size must be at least 1")
        if self.on_decode_error not in DECODE_POLICIES:
            raise UserError(f"--on_decode_error must be one of {', '.join(DECODE_POLICIES)}")
        if self.chunk_bytes < MIN_CHUNK_BYTES:
            raise UserError(f"--chunk_bytes must be at least {MIN_CHUNK_BYTES}")
        if self.num_workers < 0:
            raise UserError("--num_workers must be 0 or more (0 or 1 = tokenise in the main process)")
        check_out_dir(Path(self.out_dir), self.overwrite)


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """UserError unless out_dir is new, empty, or holds prepared data that --overwrite=True may replace: data a user
    prepared earlier is never replaced silently, and a training run's directory or one of other files never."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise UserError(f"--out_dir={out_dir} is a file, not a directory; choose another --out_dir")
    names = {path.name for path in out_dir.iterdir() if path.suffix != ".tmp"}  # .tmp: an interrupted run's
    if names & {"ckpt.pt", "log.jsonl"}:
        raise UserError(f"--out_dir={out_dir} is a training run's directory; choose another --out_dir for the data")
    if any(name != "meta.json" and not name.endswith(".bin") for name in names):
        raise UserError(f"--out_dir={out_dir} holds other files than prepared data; choose a new or empty --out_dir")
    if "meta.json" in names and not overwrite:  # token files alone: a run stopped before its end, replaced
        raise UserError(
            f"--out_dir={out_dir} already holds prepared data (meta.json); pass --overwrite=True to replace it, or "
            "choose another --out_dir"
        )
