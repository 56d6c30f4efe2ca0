"""Trained byte-level BPE tokenizers: the directory prepare_data/train_tokenizer.py writes, and the record embedded
in meta.json and checkpoints.

A tokenizer directory (TOKDIR) holds two files, written atomically, the metadata last:

- `tokenizer.tiktoken`: the mergeable ranks in tiktoken's own format, one `base64(token bytes) rank` line per
  token in rank order (`tiktoken.load.load_tiktoken_bpe` reads it);
- `tokenizer.json`: metadata: format and version, name, pre-tokenisation pattern, special tokens, vocab_size,
  the sha256 of the ranks file, and how the tokenizer was trained.

The record (the "tokenizer" object of meta.json, and so of every checkpoint trained on that data) embeds the ranks
file's text and its sha256, so a checkpoint alone rebuilds the tokenizer; the hash is checked whenever a record is
turned back into ranks. Nothing here is pickled, and nothing here needs tiktoken: gptkit.data.tokenizer builds the
encoding from the ranks.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from gptkit.core.errors import UserError
from gptkit.core.fileio import atomic_open

FORMAT = "gptkit-bpe"
VERSION = 1
RANKS_FILENAME = "tokenizer.tiktoken"
META_FILENAME = "tokenizer.json"
KIND = "bpe"
RECORD_KEYS = ("kind", "name", "pattern", "special_tokens", "ranks_sha256", "ranks")

# GPT-4's (cl100k) pre-tokenisation split, written so that Oniguruma (Hugging Face tokenizers, which trains) and
# fancy-regex (tiktoken, which encodes) read it the same way: no `{1,3}+` (possessive in one, "one or more" in the
# other) and no `$` (end of line in one, end of text in the other). Letters take one leading non-letter
# (" word", "_name"), numbers go in groups of up to 3 digits, punctuation runs keep their newlines, whitespace
# runs leave their last space to the next word.
GPT4_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

# What decode() shows for an id no token has (a model's padded vocabulary can sample one).
UNKNOWN_ID_BYTES = "\ufffd".encode()

RETRAIN = "train it again with python prepare_data/train_tokenizer.py"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def sha256_text(text: str) -> str:
    """Hex sha256 of `text`'s UTF-8 bytes (the ranks file's bytes for a ranks text)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def ranks_to_text(ranks: dict[bytes, int]) -> str:
    """tiktoken's ranks file format: `base64(token) rank` lines in rank order."""
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    return "".join(f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in ordered)


def parse_ranks(text: str, where: str) -> dict[bytes, int]:
    """The ranks of a ranks text; UserError naming `where` and the line unless the ranks are 0, 1, 2, ... in order,
    the tokens distinct, and every single byte a token (so any text can be encoded and decoded)."""
    ranks: dict[bytes, int] = {}
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for number, line in enumerate(lines, start=1):
        fields = line.split(" ")
        try:
            if len(fields) != 2:
                raise ValueError("expected 'base64 rank'")
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (ValueError, binascii.Error) as exc:
            raise UserError(
                f"{where}: line {number} is not 'base64 rank' ({exc}); the ranks are damaged, {RETRAIN}"
            ) from None
        if rank != number - 1 or not token or token in ranks:
            problem = "an empty token" if not token else "a duplicate token" if token in ranks else f"rank {rank}"
            raise UserError(
                f"{where}: line {number} holds {problem} (ranks must be 0, 1, 2, ... one distinct token per line); "
                f"the ranks are damaged, {RETRAIN}"
            )
        ranks[token] = rank
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise UserError(
            f"{where}: {len(missing)} of the 256 single bytes have no token (e.g. byte {missing[0]}), so not every "
            f"text could be encoded; the ranks are incomplete, {RETRAIN}"
        )
    return ranks


def make_record(name: str, pattern: str, special_tokens: dict[str, int], ranks_text: str) -> dict[str, Any]:
    """The "tokenizer" object meta.json (and a checkpoint) stores: everything needed to rebuild the encoding."""
    return {
        "kind": KIND,
        "name": name,
        "pattern": pattern,
        "special_tokens": dict(special_tokens),
        "ranks_sha256": sha256_text(ranks_text),
        "ranks": ranks_text,
    }


def _check_fields(obj: dict[str, Any], where: str, fix: str) -> None:
    for key in ("name", "pattern", "ranks_sha256"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise UserError(f"{where}: {key!r} must be a non-empty string; {fix}")
    if not _SHA256.fullmatch(obj["ranks_sha256"]):
        raise UserError(f"{where}: 'ranks_sha256' is not a sha256 (64 hex digits); {fix}")
    specials = obj.get("special_tokens")
    if not isinstance(specials, dict) or not all(
        isinstance(k, str) and k and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in specials.items()
    ):
        raise UserError(f"{where}: 'special_tokens' must map token strings to ids; {fix}")


def check_record(record: Any, where: str) -> None:
    """The record's structure (cheap: neither the hash nor the ranks are checked here); UserError naming `where`."""
    if not isinstance(record, dict) or record.get("kind") != KIND:
        raise UserError(f"{where}: not a BPE tokenizer record")
    fix = "the tokenizer record is damaged; prepare the data again with --tokenizer=TOKDIR"
    _check_fields(record, where, fix)
    if not isinstance(record.get("ranks"), str):
        raise UserError(f"{where}: 'ranks' must be the text of the ranks file; {fix}")


def ranks_of_record(record: dict[str, Any], where: str) -> dict[bytes, int]:
    """The ranks a checked record embeds, after verifying their sha256; UserError when altered or damaged."""
    check_record(record, where)
    actual = sha256_text(record["ranks"])
    if actual != record["ranks_sha256"]:
        raise UserError(
            f"{where}: the embedded BPE ranks have sha256 {actual[:16]}... but the record says "
            f"{record['ranks_sha256'][:16]}...: the tokenizer record was altered or damaged; prepare the data again"
        )
    ranks = parse_ranks(record["ranks"], f"{where}: embedded ranks")
    taken = [token for token, token_id in record["special_tokens"].items() if token_id < len(ranks)]
    if taken or len(set(record["special_tokens"].values())) != len(record["special_tokens"]):
        raise UserError(f"{where}: special token ids collide with each other or with the {len(ranks)} BPE ranks")
    return ranks


# ----------------------------------------------------------------------------- the tokenizer directory


def holds_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds either file of a tokenizer directory (a complete one or the rest of one)."""
    return any((Path(directory) / name).exists() for name in (META_FILENAME, RANKS_FILENAME))


def write_tokenizer_dir(
    directory: str | os.PathLike,
    ranks: dict[bytes, int],
    pattern: str,
    special_tokens: dict[str, int],
    name: str,
    training: dict[str, Any],
) -> dict[str, Any]:
    """Write the ranks file and tokenizer.json (each atomically); returns the metadata written."""
    directory = Path(directory)
    ranks_text = ranks_to_text(ranks)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        "pattern": pattern,
        "special_tokens": dict(special_tokens),
        "vocab_size": len(ranks) + len(special_tokens),
        "ranks_file": RANKS_FILENAME,
        "ranks_sha256": sha256_text(ranks_text),
        "training": training,
    }
    # Both files are written out whole (and synced) before either replaces an earlier one, so a failure while
    # writing (a full disk, a signal) leaves an earlier tokenizer as it was. Only a crash between the two renames
    # leaves a mix, which the ranks' sha256 in tokenizer.json tells apart.
    with atomic_open(directory / META_FILENAME, "w") as meta_file:
        json.dump(meta, meta_file, indent=2, ensure_ascii=False)
        meta_file.write("\n")
        meta_file.flush()
        os.fsync(meta_file.fileno())
        with atomic_open(directory / RANKS_FILENAME, "wb") as ranks_file:
            ranks_file.write(ranks_text.encode("ascii"))
    return meta


def _read_metadata(directory: Path) -> dict[str, Any]:
    path = directory / META_FILENAME
    if not directory.is_dir():
        state = "is not a directory" if directory.exists() else "does not exist"
        raise UserError(f"tokenizer directory {directory} {state}; {RETRAIN} --out_dir={directory}")
    if not path.is_file():
        raise UserError(
            f"{directory} has no {META_FILENAME}: it is not a tokenizer directory, or its training did not finish; "
            f"{RETRAIN}"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); the file is damaged, {RETRAIN}") from None
    if isinstance(meta, dict) and "model" in meta and ("pre_tokenizer" in meta or "added_tokens" in meta):
        raise UserError(f"{path} is a Hugging Face tokenizers file, not one written by train_tokenizer.py; {RETRAIN}")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise UserError(
            f"{path} is not a BPE tokenizer description (format {FORMAT!r} version {VERSION}); "
            f"point at a directory written by train_tokenizer.py, or {RETRAIN}"
        )
    _check_fields(meta, str(path), f"the file is damaged, {RETRAIN}")
    return meta


def read_tokenizer_dir(directory: str | os.PathLike) -> dict[str, Any]:
    """The record of the tokenizer in `directory`, its ranks file checked against tokenizer.json's sha256.

    UserError (one line: what is wrong, how to fix it) for a missing or foreign directory, damaged or altered
    files; the ranks themselves are checked when the record is turned into an encoding (`ranks_of_record`).
    """
    directory = Path(directory)
    meta = _read_metadata(directory)
    ranks_path = directory / RANKS_FILENAME
    if not ranks_path.is_file():
        raise UserError(f"{ranks_path} is missing; the tokenizer directory is incomplete, {RETRAIN}")
    data = ranks_path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != meta["ranks_sha256"]:
        raise UserError(
            f"{ranks_path} has sha256 {actual[:16]}... but {META_FILENAME} says {meta['ranks_sha256'][:16]}...: "
            f"the file is truncated, damaged or from another tokenizer; {RETRAIN}"
        )
    try:
        ranks_text = data.decode("ascii")
    except UnicodeDecodeError:
        raise UserError(f"{ranks_path} is not a tiktoken ranks file (not ASCII); {RETRAIN}") from None
    record = make_record(meta["name"], meta["pattern"], meta["special_tokens"], ranks_text)
    vocab_size = meta.get("vocab_size")
    if vocab_size != ranks_text.count("\n") + len(meta["special_tokens"]):
        raise UserError(f"{directory / META_FILENAME}: 'vocab_size' {vocab_size!r} does not match the ranks; {RETRAIN}")
    return record


def gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character mapping used in vocab.bpe and encoder.json.

    Printable Latin-1 bytes stand for themselves; the other bytes, in increasing order, are shifted to the
    characters from U+0100 upwards.
    """
    printable = [b for b in range(256) if chr(b).isprintable() and b != ord(" ")]
    mapping = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping.values():
            mapping[chr(256 + shifted)] = b
            shifted += 1
    return mapping
