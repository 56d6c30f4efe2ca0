"""Train your own tokenizer: a byte-level BPE on your corpus, written for tiktoken to encode with.

    python prepare_data/train_tokenizer.py --input=src/ --vocab_size=32768 --out_dir=data/tok_src
    python prepare_data/train_tokenizer.py --input=dump.jsonl.gz --text_field=content --max_chars=500_000_000 \\
        --out_dir=data/tok_web
    python prepare_data/corpus.py --input=src/ --tokenizer=data/tok_src --out_dir=data/src

Inputs are read as corpus.py reads them (files, directories, globs, JSONL, .gz; binary files, __pycache__,
version-control and hidden folders, and folders of model files left out). The split is GPT-4's; every byte is a token, so any text
round-trips; the end-of-text token comes after the trained ones. The documents corpus.py puts in val with the same
--val_fraction and --seed are left out of training. The output directory holds tokenizer.tiktoken (tiktoken's
ranks format) and tokenizer.json (pattern, special tokens, sha256 of the ranks, how it was trained); corpus.py
embeds the whole tokenizer in meta.json, and training copies it into every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data import bpe
from gptkit.data import tokenizer as tok
from gptkit.data.hf_tokenizer import is_hf_tokenizer_dir
from gptkit.data.prepare import discover
from gptkit.data.prepare.settings import (
    PrepareSettings,
    decode_error_setting,
    exclude_setting,
    include_setting,
    input_setting,
)
from gptkit.data.prepare.tokenizer_training import (
    MAX_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    TrainingJob,
    TrainingResult,
    train_in_child,
)

DEFAULT_CHUNK_BYTES = 1 << 16  # pieces the trainer counts in parallel; it buffers 256 of them


@dataclass(kw_only=True)
class TokenizerSettings:
    """Inputs as corpus.py takes them, the vocabulary, and where the tokenizer goes."""

    input: list[str] = input_setting()
    include: list[str] = include_setting()
    exclude: list[str] = exclude_setting()
    text_field: str = setting("text", "JSONL field holding each document's text")
    on_decode_error: str = decode_error_setting()
    out_dir: str = setting("data/tokenizer", "directory to write the tokenizer to (pass it as corpus.py --tokenizer)")
    vocab_size: int = setting(32768, f"tokens in all, end-of-text included ({MIN_VOCAB_SIZE} to {MAX_VOCAB_SIZE:,})")
    min_frequency: int = setting(2, "merge only pairs seen at least this many times", rule="non_negative")
    max_chars: int | None = setting(
        None, "train on the first this many characters only (None: all); memory grows with the distinct words seen"
    )
    val_fraction: float = setting(
        0.05,
        "leave out the documents corpus.py puts in val with this --val_fraction (0: train on all)",
        rule="fraction",
    )
    seed: int = setting(1337, "the --seed of that corpus.py split")
    chunk_bytes: int = setting(DEFAULT_CHUNK_BYTES, "bytes of text per piece handed to the trainer")
    name: str | None = setting(None, "the encoding's name (None: the name of out_dir)")
    overwrite: bool = setting(False, "replace the tokenizer already in out_dir")

    def validate(self) -> None:
        if not self.input:
            raise UserError("no input given: pass --input=FILE, a directory or a glob (repeat for more)")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise UserError(f"--vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + end-of-text)")
        if self.vocab_size > MAX_VOCAB_SIZE:
            raise UserError(
                f"--vocab_size must be at most {MAX_VOCAB_SIZE:,} (the largest tokenizers in use hold a few hundred "
                "thousand tokens)"
            )
        if self.max_chars is not None and self.max_chars < 1:
            raise UserError("--max_chars must be a positive number of characters, or None for the whole corpus")
        if self.chunk_bytes < 256:
            raise UserError("--chunk_bytes must be at least 256")


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """UserError unless out_dir is new, empty, or holds a tokenizer that --overwrite=True may replace."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise UserError(f"--out_dir {out_dir} is a file, not a directory; choose another --out_dir")
    if is_hf_tokenizer_dir(out_dir):
        raise UserError(f"{out_dir} holds a Hugging Face model's tokenizer.json; choose a new or empty --out_dir")
    own, holds_one = {bpe.META_FILENAME, bpe.RANKS_FILENAME}, bpe.holds_tokenizer(out_dir)
    if any(p.name not in own and not (p.name.startswith(".") and p.name.endswith(".tmp")) for p in out_dir.iterdir()):
        what = "other files than a tokenizer" if holds_one else "files and no tokenizer"
        raise UserError(f"{out_dir} holds {what}; choose a new or empty --out_dir")
    if holds_one and not overwrite:
        raise UserError(f"{out_dir} already holds a tokenizer; pass --overwrite=True to replace it")


def training_record(cfg: TokenizerSettings, found: discover.FoundInputs, result: TrainingResult) -> dict:
    """tokenizer.json's "training" object: the inputs, the settings and what the training saw."""
    import tokenizers

    return {
        **discover.inputs_record(cfg, found),
        "text_field": cfg.text_field,
        "on_decode_error": cfg.on_decode_error,
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        "max_chars": cfg.max_chars,
        "vocab_size_asked": cfg.vocab_size,
        "min_frequency": cfg.min_frequency,
        "chars": result.chars,
        "text_bytes": result.text_bytes,
        "input_bytes": result.input_bytes,
        "val_chars_left_out": result.val_chars_left_out,
        "seconds": round(result.seconds, 2),
        "trainer": f"tokenizers {tokenizers.__version__}",
        "tiktoken_check": {
            "chars": result.check_chars,
            "text": result.check_source,
            "texts_encoded_differently": result.check_mismatches,
        },
    }


def summary_line(out_dir: Path, meta: dict, result: TrainingResult, found: discover.FoundInputs) -> str:
    """One line: the vocabulary, what it was trained on and how fast, what was left out, the tiktoken check."""
    asked = meta["training"]["vocab_size_asked"]
    short = f" (asked for {asked:,}: no more pairs occur --min_frequency times)" if meta["vocab_size"] < asked else ""
    rate = result.text_bytes / 1e6 / result.seconds if result.seconds else 0.0
    left_out = sum(found.skipped.values())
    skipped = f"; {left_out:,} files left out ({discover.describe_skipped(found.skipped)})" if left_out else ""
    check = (
        f"tiktoken encodes {result.check_chars:,} {result.check_source} characters exactly as the trainer"
        if not result.check_mismatches
        else f"warning: tiktoken and the trainer differ on {result.check_mismatches} {result.check_source} texts"
    )
    return (
        f"wrote {out_dir}: vocab {meta['vocab_size']:,}{short}, trained on {result.text_bytes / 1e6:.1f} MB of text "
        f"from {len(found.files):,} files in {result.seconds:.1f} s ({rate:.1f} MB/s)" + f"{skipped}; {check}"
    )


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        TokenizerSettings,
        argv,
        prog="prepare_data/train_tokenizer.py",
        description="Train a byte-level BPE tokenizer on your corpus, for corpus.py --tokenizer=OUT_DIR.",
    )
    out_dir = Path(cfg.out_dir)
    check_out_dir(out_dir, cfg.overwrite)  # before the training, not after it
    found = discover.find_inputs(cfg.input, out_dir=out_dir, include=cfg.include, exclude=cfg.exclude)
    read = PrepareSettings(
        text_field=cfg.text_field, val_fraction=cfg.val_fraction, seed=cfg.seed, chunk_bytes=cfg.chunk_bytes
    )
    read.on_decode_error = cfg.on_decode_error
    job = TrainingJob(
        files=found.files,
        read=read,
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        max_chars=cfg.max_chars,
    )
    result = train_in_child(job)
    check_out_dir(out_dir, cfg.overwrite)  # nobody wrote a tokenizer there meanwhile
    out_dir.mkdir(parents=True, exist_ok=True)
    special_tokens = {tok.END_OF_TEXT: len(result.ranks)}
    name = cfg.name or out_dir.resolve().name
    meta = bpe.write_tokenizer_dir(
        out_dir, result.ranks, job.pattern, special_tokens, name, training_record(cfg, found, result)
    )
    print(summary_line(out_dir, meta, result, found))
    return 0


if __name__ == "__main__":
    run_cli(main)
