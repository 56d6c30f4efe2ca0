"""Prepare your own corpus: text files, directories, globs and JSONL (optionally .gz) -> token files + meta.json.

    python prepare_data/corpus.py --input=notes/ --input='books/*.txt' --out_dir=data/mine
    python prepare_data/corpus.py --input=dump.jsonl.gz --text_field=content --tokenizer=char

A plain text file is one document and a JSONL line is one; documents are separated by the end-of-text token and
go wholly to train or val (keyed hash of --seed and the document's position). A single text file on its own is
split by position instead: its first 1 - val_fraction of bytes train, the rest val. The corpus is streamed, so
its size is bounded by the disk, not by memory. Directories and globs leave out binary files, __pycache__,
version-control and hidden folders, folders of model files (prepared data, training runs, model weights), and
what --include/--exclude say; the summary line and meta.json count them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings
from gptkit.data.prepare import discover, driver, inputs
from gptkit.data.prepare.settings import (
    PrepareSettings,
    decode_error_setting,
    exclude_setting,
    include_setting,
    input_setting,
)


@dataclass(kw_only=True)
class CorpusSettings(PrepareSettings):
    """The shared preparation settings (their defaults are this script's) plus the inputs and the UTF-8 policy."""

    input: list[str] = input_setting()
    include: list[str] = include_setting()
    exclude: list[str] = exclude_setting()
    on_decode_error: str = decode_error_setting()

    def validate(self) -> None:
        super().validate()
        if not self.input:
            raise UserError("no input given: pass --input=FILE, a directory or a glob (repeat for more)")


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        CorpusSettings,
        argv,
        prog="prepare_data/corpus.py",
        description="Tokenise your own text/JSONL corpus into token files that train.py streams.",
    )
    if "/" in cfg.tokenizer and not Path(cfg.tokenizer).exists():  # a hub model's (owner/name), fetched once
        from gptkit.weights.sources import fetched_tokenizer_source  # imports torch: only for a hub name

        cfg.tokenizer = fetched_tokenizer_source(cfg.tokenizer)
    found = discover.find_inputs(cfg.input, out_dir=cfg.out_dir, include=cfg.include, exclude=cfg.exclude)
    files = found.files
    by_position = discover.is_single_document(files)
    split = "by position in the single document" if by_position else "by document (keyed hash)"
    source = discover.source_record(cfg, found, split)
    source.update(on_decode_error=cfg.on_decode_error, chunk_bytes=cfg.chunk_bytes)
    total_bytes = sum(file.size for file in files)
    make_items = partial(inputs.corpus_items, files, cfg)
    meta, seconds = driver.prepare(make_items, cfg, source, total_bytes, what=", ".join(cfg.input))
    print(driver.summary_line(meta, cfg.out_dir, seconds, total_bytes))
    return 0


if __name__ == "__main__":
    run_cli(main)
