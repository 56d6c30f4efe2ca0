"""Tiny Shakespeare with GPT-2 BPE (tiktoken "gpt2"): train.bin / val.bin (uint16) and meta.json.

    python prepare_data/shakespeare.py
    python prepare_data/shakespeare.py --bpe_dir=DIR   # GPT-2's vocab.bpe + encoder.json, no network needed

Same 90/10 character split as shakespeare_char.py, then each part encoded on its own: 301,966 train and
36,059 val tokens, no end-of-text token (the corpus is one document).
"""

from __future__ import annotations

from dataclasses import dataclass

from gptkit.core.errors import run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data.prepare.settings import bpe_dir_setting
from gptkit.data.prepare.shakespeare import ShakespeareSettings, read_tiny_shakespeare, write_split_text
from gptkit.data.tokenizer import TiktokenTokenizer


@dataclass(kw_only=True)
class ShakespeareBpeSettings(ShakespeareSettings):
    out_dir: str = setting("data/shakespeare", "output directory for train.bin, val.bin and meta.json")
    bpe_dir: str | None = bpe_dir_setting()


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        ShakespeareBpeSettings,
        argv,
        prog="prepare_data/shakespeare.py",
        description="Tiny Shakespeare with GPT-2 BPE, split 90/10 by characters as nanoGPT does.",
    )
    text, provenance = read_tiny_shakespeare(cfg)
    tokenizer = TiktokenTokenizer("gpt2", bpe_dir=cfg.bpe_dir)
    write_split_text(cfg, tokenizer, text, {**provenance, "bpe_dir": cfg.bpe_dir})
    return 0


if __name__ == "__main__":
    run_cli(main)
