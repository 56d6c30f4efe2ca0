"""Prepare your own corpus: text files, directories, globs and JSONL (optionally .gz) -> token files + meta.json.

    python prepare_data/corpus.py --input=notes/ --input='books/*.txt' --out_dir=data/mine
    python prepare_data/corpus.py --input=dump.jsonl.gz --text_field=content --tokenizer=char

A plain text file is one document and a JSONL line is one; documents are separated by the end-of-text token and
go wholly to train or val (keyed hash of --seed and the document's position). A single text file on its own is
split by position instead: its first 1 - val_fraction of bytes train, the rest val. The corpus is streamed, so
its size is bounded by the disk, not by memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptkit.errors import UserError, run_cli
from gptkit.prepare import pipeline
from gptkit.settings import parse_settings, setting, setting_list


@dataclass
class CorpusSettings:
    input: list[str] = setting_list([], "input file, directory (recursive) or glob; repeat for more")
    out_dir: str = setting("data/corpus", "output directory for the token files and meta.json")
    tokenizer: str = setting("gpt2", "gpt2, char, or any tiktoken encoding name (e.g. cl100k_base)")
    bpe_dir: str | None = setting(None, "directory with GPT-2's vocab.bpe + encoder.json, to work offline")
    text_field: str = setting("text", "JSONL field holding each document's text")
    val_fraction: float = setting(0.05, "fraction of documents (or of a single document's text) for val")
    seed: int = setting(1337, "seed of the train/val assignment")
    shard_tokens: int | None = setting(None, "tokens per output shard; None writes one train.bin and one val.bin")
    block_size: int = setting(256, "training context length: each split must hold at least block_size + 1 tokens")
    num_workers: int = setting(pipeline.default_num_workers(), "tokenising processes (1 = in the main process)")
    on_decode_error: str = setting("error", "invalid UTF-8: error (stop), replace (U+FFFD), skip (drop the document)")
    chunk_bytes: int = setting(pipeline.DEFAULT_CHUNK_BYTES, "bytes of text per tokenisation task")

    def validate(self) -> None:
        pipeline.check_settings(self)
        if not self.input:
            raise UserError("no input given: pass --input=FILE, a directory or a glob (repeat for more)")


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        CorpusSettings,
        argv,
        prog="prepare_data/corpus.py",
        description="Tokenise your own text/JSONL corpus into token files that train.py streams.",
    )
    files = pipeline.collect_inputs(cfg.input, exclude=cfg.out_dir)
    settings = pipeline.PrepareSettings.from_cli(cfg)
    single_document = len(files) == 1 and files[0].kind == "text"
    source = {
        "inputs": list(cfg.input),
        "files": len(files),
        "tokenizer": cfg.tokenizer,
        "bpe_dir": cfg.bpe_dir,
        "split": "by position in the single document" if single_document else "by document (keyed hash)",
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        "text_field": cfg.text_field,
        "on_decode_error": cfg.on_decode_error,
        "chunk_bytes": cfg.chunk_bytes,
    }
    total_bytes = sum(file.size for file in files)

    def make_tasks():
        return pipeline.corpus_tasks(files, cfg.chunk_bytes, cfg.seed, cfg.val_fraction, cfg.on_decode_error)

    meta, seconds = pipeline.prepare(make_tasks, settings, source, total_bytes, what=", ".join(cfg.input))
    print(pipeline.summary_line(meta, cfg.out_dir, seconds, total_bytes))
    return 0


if __name__ == "__main__":
    run_cli(main)
