"""Tiny token data directories for the data, checkpoint and training tests (built on the fly, never downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenizer import CharTokenizer, write_meta

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def sample_text(chars: int = 60_000) -> str:
    """The first `chars` characters of tiny Shakespeare (or a synthetic text where that file is absent)."""
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text(encoding="utf-8")[:chars]
    words = ["the", "king", "and", "queen", "speak", "of", "love", "war", "night", "day"]
    rng = np.random.default_rng(0)
    return " ".join(words[i] for i in rng.integers(0, len(words), size=chars // 4))[:chars]


def write_split_files(directory: Path, split: str, ids: np.ndarray, shards: int, dtype: str) -> list[str]:
    """Write `ids` as `shards` raw token files of the split; returns their names in order."""
    if shards == 1:
        names = [f"{split}.bin"]
        pieces = [ids]
    else:
        names = [f"{split}_{i:06d}.bin" for i in range(shards)]
        pieces = np.array_split(ids, shards)
    for name, piece in zip(names, pieces):
        piece.astype(dtype).tofile(directory / name)
    return names


def make_char_data(directory: Path, text: str | None = None, shards: int = 1, dtype: str = "uint16") -> dict:
    """A char-level data directory (train 90% / val 10% of `text`); returns its meta dict."""
    text = sample_text() if text is None else text
    directory.mkdir(parents=True, exist_ok=True)
    tok = CharTokenizer.from_text(text)
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    cut = int(len(ids) * 0.9)
    splits = {}
    for split, part, part_text in (("train", ids[:cut], text[:cut]), ("val", ids[cut:], text[cut:])):
        files = write_split_files(directory, split, part, shards, dtype)
        splits[split] = {
            "files": files,
            "tokens": len(part),
            "text_bytes": len(part_text.encode("utf-8")),
            "documents": 1,
        }
    meta = {
        "format": "gpt-tokens",
        "version": 1,
        "tokenizer": tok.to_meta(),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "eot_token": None,
        "splits": splits,
        "source": {"test": "tests/datadirs.py"},
    }
    write_meta(directory, meta)
    return meta
