"""meta.json: what a token data directory holds (format, tokenizer, vocabulary size, dtype, splits and their files),
checked whenever it is read or written.

    {"format": "gpt-tokens", "version": 1, "tokenizer": {...}, "vocab_size": 50257, "dtype": "uint16",
     "eot_token": 50256, "splits": {"train": {"files": [...], "tokens": ..., "text_bytes": ..., "documents": ...}}}

The "tokenizer" object is gptkit.data.tokenizer's (`tokenizer_from_meta` rebuilds the tokenizer from it); chat data
adds a "chat" entry to it and "mask_files" and "conversations_files" to every split (gptkit.data.conversations).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.core.errors import UserError
from gptkit.core.fileio import atomic_write_json
from gptkit.data import hf_tokenizer
from gptkit.data.tokenizer import chat_special_count, chat_template_of, check_tokenizer_meta

META_FILENAME = "meta.json"
META_FORMAT = "gpt-tokens"
META_VERSION = 1
TOKEN_DTYPES = ("uint16", "uint32")
# Chat data's side streams beside each split's tokens (gptkit.data.conversations reads them), with their dtypes.
SIDE_STREAMS = {"mask": "uint8", "conversations": "uint64"}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def validate_meta(meta: Any, where: str = "meta.json") -> None:
    """Check meta.json's required keys and types; UserError naming `where` and the problem."""
    if not isinstance(meta, dict):
        raise UserError(f"{where}: expected a JSON object")
    if meta.get("format") != META_FORMAT or meta.get("version") != META_VERSION:
        raise UserError(f"{where}: not a token-data description (format {META_FORMAT!r} version {META_VERSION})")
    check_tokenizer_meta(meta.get("tokenizer"), where)
    vocab_size = meta.get("vocab_size")
    if not _is_count(vocab_size) or vocab_size == 0:
        raise UserError(f"{where}: 'vocab_size' must be a positive integer")
    tok = meta["tokenizer"]
    if tok["kind"] == hf_tokenizer.KIND and max(hf_tokenizer.record_ids(tok), default=0) >= vocab_size:
        raise UserError(f"{where}: 'vocab_size' {vocab_size} does not hold the chat template's special tokens")
    if "chat" in tok and tok["kind"] != hf_tokenizer.KIND and max(chat_template_of(tok, where).ids) >= vocab_size:
        raise UserError(f"{where}: 'vocab_size' {vocab_size} does not hold the chat template's special tokens")
    if tok["kind"] == "char" and vocab_size != len(tok["chars"]) + (1 if tok.get("eot") else 0) + chat_special_count(
        tok
    ):
        raise UserError(f"{where}: 'vocab_size' {vocab_size} does not match the character table")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise UserError(f"{where}: 'dtype' must be one of {', '.join(TOKEN_DTYPES)}")
    if meta["dtype"] == "uint16" and vocab_size > 65536:
        raise UserError(f"{where}: vocab_size {vocab_size} does not fit dtype uint16")
    eot = meta.get("eot_token")
    if eot is not None and (not _is_count(eot) or eot >= vocab_size):
        raise UserError(f"{where}: 'eot_token' must be null or an id below vocab_size")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise UserError(f'{where}: \'splits\' must be an object such as {{"train": ..., "val": ...}}')
    for split, info in splits.items():
        if not isinstance(info, dict):
            raise UserError(f"{where}: split {split!r} must be an object")
        files = info.get("files")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
            raise UserError(f"{where}: split {split!r} needs 'files', a non-empty list of file names")
        if any(Path(f).is_absolute() or ".." in Path(f).parts for f in files):
            raise UserError(f"{where}: split {split!r} lists a file outside the data directory")
        for key in ("tokens", "text_bytes", "documents"):
            if not _is_count(info.get(key)):
                raise UserError(f"{where}: split {split!r} needs '{key}', a non-negative integer")
        for key in ("mask_files", "conversations_files") if "chat" in tok else ():
            side = info.get(key)
            if not isinstance(side, list) or not side or not all(isinstance(f, str) and f for f in side):
                raise UserError(f"{where}: split {split!r} of chat data needs '{key}', a list of file names")


# The script that writes each built-in dataset's default directory (data/<name>).
PREPARING = {
    "shakespeare_char": "python prepare_data/shakespeare_char.py",
    "shakespeare": "python prepare_data/shakespeare.py",
    "fineweb_edu": "python prepare_data/fineweb.py",
}


def preparing(directory: Path) -> str:
    """The command that prepares `directory`: its built-in dataset's script, else corpus.py."""
    if directory.name in PREPARING:
        return PREPARING[directory.name]
    return f"python prepare_data/corpus.py --input=YOUR_FILES --out_dir={directory}"


def read_meta(data_dir: str | os.PathLike, check_files: bool = False) -> dict:
    """Read and validate `data_dir`/meta.json; returns the dict.

    With `check_files`, also checks that every listed token file exists and that the split's files hold
    exactly 'tokens' tokens of 'dtype'. Raises UserError for a missing, unreadable or malformed file.
    """
    directory = Path(data_dir)
    path = directory / META_FILENAME
    if not path.is_file():
        hint = " (the directory does not exist)" if not directory.exists() else ""
        raise UserError(f"no {META_FILENAME} in {directory}{hint}: prepare the data first, e.g. {preparing(directory)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise UserError(f"{path} is not valid JSON ({exc}); prepare the data again") from exc
    validate_meta(meta, str(path))
    if check_files:
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split, info in meta["splits"].items():
            total = 0
            for name in info["files"]:
                file_path = directory / name
                if not file_path.is_file():
                    raise UserError(f"{file_path} (split {split!r}) is missing; prepare the data again")
                total += file_path.stat().st_size
            if total != info["tokens"] * itemsize:
                raise UserError(
                    f"{directory}: split {split!r} files hold {total} bytes but meta.json says {info['tokens']} "
                    f"{meta['dtype']} tokens; the data is incomplete or altered, prepare it again"
                )
    return meta


def write_meta(data_dir: str | os.PathLike, meta: dict) -> None:
    """Validate `meta` and write it to `data_dir`/meta.json atomically."""
    validate_meta(meta, "meta to write")
    atomic_write_json(Path(data_dir) / META_FILENAME, meta)


def dtype_for_vocab(vocab_size: int) -> str:
    """'uint16' when every id fits in 16 bits, else 'uint32'."""
    return "uint16" if vocab_size <= 65536 else "uint32"
