"""Tiny Shakespeare at the character level: train.bin / val.bin (uint16) and meta.json.

    python prepare_data/shakespeare_char.py                       # downloads (once) into the cache
    TINYSHAKESPEARE=../shared/data/tinyshakespeare.txt python prepare_data/shakespeare_char.py

The split matches nanoGPT's so figures compare: the first 90% of the characters train (1,003,854 tokens), the
rest val (111,540); the vocabulary is the 65 sorted distinct characters, id = rank.
"""

from __future__ import annotations

from gptkit.core.errors import run_cli
from gptkit.core.settings import parse_settings
from gptkit.data.prepare.shakespeare import ShakespeareSettings, read_tiny_shakespeare, write_split_text
from gptkit.data.tokenizer import CharTokenizer


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        ShakespeareSettings,
        argv,
        prog="prepare_data/shakespeare_char.py",
        description="Tiny Shakespeare, character level, split 90/10 as nanoGPT does.",
    )
    text, provenance = read_tiny_shakespeare(cfg)
    write_split_text(cfg, CharTokenizer.from_text(text), text, provenance)
    return 0


if __name__ == "__main__":
    run_cli(main)
