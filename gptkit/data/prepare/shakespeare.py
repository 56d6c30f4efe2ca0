"""Tiny Shakespeare: fetch the text (cached, checksummed) and write nanoGPT's 90/10 split with any tokenizer.

prepare_data/shakespeare_char.py (characters) and prepare_data/shakespeare.py (GPT-2 BPE) are built on this.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from gptkit.core import download
from gptkit.core.download import DownloadSettings
from gptkit.core.errors import UserError
from gptkit.core.fileio import sha256_file
from gptkit.core.settings import setting
from gptkit.data.meta import META_FILENAME
from gptkit.data.prepare.driver import summary_line
from gptkit.data.prepare.settings import check_out_dir
from gptkit.data.prepare.writer import write_dataset
from gptkit.data.tokenizer import Tokenizer

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SOURCE_ENV = "TINYSHAKESPEARE"
TRAIN_FRACTION = 0.9


@dataclass(kw_only=True)
class ShakespeareSettings(DownloadSettings):
    source: str | None = setting(None, f"URL or local path of the text; default ${SOURCE_ENV}, else the char-rnn URL")
    out_dir: str = setting("data/shakespeare_char", "output directory for train.bin, val.bin and meta.json")
    sha256: str | None = setting(TINY_SHAKESPEARE_SHA256, "expected sha256 of the text; None accepts any text")
    overwrite: bool = setting(False, "replace other prepared data in out_dir (this same preparation is always redone)")

    def validate(self) -> None:
        self.download_policy()  # refuses impossible values before any work
        # Before the download: a training run's directory or one of other files is refused whatever it would hold.
        check_out_dir(Path(self.out_dir), overwrite=True)


def read_tiny_shakespeare(cfg: ShakespeareSettings) -> tuple[str, dict]:
    """The corpus text (from --source, $TINYSHAKESPEARE or the canonical URL) and its provenance for meta.json."""
    source = cfg.source or os.environ.get(SOURCE_ENV) or TINY_SHAKESPEARE_URL
    path = download.resolve_source(source, sha256=cfg.sha256, cache_dir=cfg.cache_dir, policy=cfg.download_policy())
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{source} is not valid UTF-8 at byte offset {exc.start}; check the source") from None
    if not text:
        raise UserError(f"{source} is empty; check the source")
    provenance = {"source": source, "sha256": sha256_file(path), "split": "first 90% of characters train"}
    return text, provenance


def split_text(text: str) -> tuple[str, str]:
    """nanoGPT's split: the first 90% of the characters, then the rest."""
    cut = int(len(text) * TRAIN_FRACTION)
    return text[:cut], text[cut:]


def write_split_text(cfg: ShakespeareSettings, tokenizer: Tokenizer, text: str, provenance: dict) -> None:
    """Tokenise nanoGPT's train/val split of `text` (one document each) into cfg.out_dir, write the data set and print
    a summary. Data prepared there earlier is replaced only with --overwrite=True, or when it is this same
    preparation (the same text and tokenizer: the same files again, as `make demo` asks every time)."""
    out_dir = Path(cfg.out_dir)
    check_out_dir(out_dir, cfg.overwrite or is_same_preparation(out_dir, tokenizer, provenance))
    splits = {
        name: (tokenizer.encode_array(part), len(part.encode("utf-8")), 1)
        for name, part in zip(("train", "val"), split_text(text))
    }
    meta = write_dataset(out_dir, tokenizer, splits, provenance)
    print(summary_line(meta, out_dir, 0.0, 0))


def is_same_preparation(out_dir: Path, tokenizer: Tokenizer, provenance: dict) -> bool:
    """Whether out_dir's meta.json records the text of `provenance` (its sha256) in `tokenizer`."""
    try:
        meta = json.loads((out_dir / META_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    source = meta.get("source") if isinstance(meta, dict) else None
    return (
        isinstance(source, dict)
        and source.get("sha256") == provenance["sha256"]
        and meta.get("tokenizer") == tokenizer.to_meta()
    )
