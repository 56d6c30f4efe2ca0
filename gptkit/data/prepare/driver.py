"""One preparation run: choose the tokenizer, stream the work items through the workers into the writer, report.

`prepare` takes a function making a fresh stream of work items (called twice for --tokenizer=char: once to
collect the characters, once to encode) and the run's settings; `summary_line` is the one line a script prints.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from gptkit.core.errors import UserError
from gptkit.core.progress import byte_progress_bar
from gptkit.data import tokenizer as tok
from gptkit.data.meta import dtype_for_vocab
from gptkit.data.prepare.discover import describe_skipped
from gptkit.data.prepare.items import WorkItem
from gptkit.data.prepare.settings import PrepareSettings
from gptkit.data.prepare.workers import ItemResult, Job, run_items
from gptkit.data.prepare.writer import DatasetWriter

MakeItems = Callable[[], Iterable[WorkItem]]


class Progress:
    """A bar on stderr (only when stderr is a terminal) showing input MB/s and tokens/s; times the run."""

    def __init__(self, total_bytes: int | None, description: str) -> None:
        self.started = time.perf_counter()
        self.tokens = 0
        self.input_bytes = 0
        self._bar = byte_progress_bar(description, total_bytes or None, smoothing=0.1)

    def update(self, input_bytes: int, tokens: int) -> None:
        """Count bytes of input consumed and tokens produced."""
        self.tokens += tokens
        self.input_bytes += input_bytes
        if self._bar is not None:
            self._bar.update(input_bytes)
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            self._bar.set_postfix_str(f"{rate / 1e6:.2f}M tok/s", refresh=False)

    def close(self) -> float:
        """Close the bar; returns the seconds elapsed."""
        if self._bar is not None:
            self._bar.close()
        return time.perf_counter() - self.started


def _job(settings: PrepareSettings, tokenizer: tok.Tokenizer | None, dtype: str) -> Job:
    return Job(
        tokenizer=tokenizer,
        dtype=dtype,
        seed=settings.seed,
        val_fraction=settings.val_fraction,
        on_decode_error=settings.on_decode_error,
        text_field=settings.text_field,
    )


def build_char_vocabulary(
    make_items: MakeItems, settings: PrepareSettings, total_bytes: int | None
) -> tok.CharTokenizer:
    """First streaming pass for --tokenizer=char: the sorted characters of every document, plus end-of-text."""
    chars: set[str] = set()
    progress = Progress(total_bytes, "characters")
    try:
        job = _job(settings, None, "uint32")
        with contextlib.closing(run_items(make_items(), job, settings.num_workers)) as results:
            for result in results:
                chars |= result.chars or set()
                progress.update(result.input_bytes, 0)
    finally:
        progress.close()
    if not chars:
        raise UserError("the corpus is empty: no text found in the inputs")
    return tok.CharTokenizer(sorted(chars), eot=True)


def make_tokenizer(settings: PrepareSettings, make_items: MakeItems, total_bytes: int | None) -> tok.Tokenizer:
    """The tokenizer settings.tokenizer names ('char' scans the corpus for its characters first) or the trained
    tokenizer in the directory it names."""
    if settings.tokenizer == "char":
        if settings.bpe_dir is not None:
            raise UserError("--bpe_dir is for GPT-2 BPE; it makes no sense with --tokenizer=char")
        return build_char_vocabulary(make_items, settings, total_bytes)
    tokenizer = tok.make_tokenizer(settings.tokenizer, bpe_dir=settings.bpe_dir)  # a name, or a tokenizer directory
    # Plain text: a Hugging Face model's chat template stays out of the record ("chat" there marks chat data).
    return tokenizer.without_chat() if isinstance(tokenizer, tok.HFTokenizer) else tokenizer


def _write_result(writer: DatasetWriter, result: ItemResult) -> None:
    for split, part in result.parts.items():
        writer.write(split, part.ids, part.text_bytes, part.documents)
    writer.skipped_documents += result.skipped


def prepare(
    make_items: MakeItems,
    settings: PrepareSettings,
    source: dict[str, Any],
    total_bytes: int | None,
    what: str,
) -> tuple[dict[str, Any], float]:
    """Tokenise every item's text into settings.out_dir; returns (meta, seconds).

    `source` is the provenance recorded in meta.json; `what` names the input in error messages. On any failure
    the output directory is left as it was (no file of this run remains).
    """
    settings.validate()
    tokenizer = make_tokenizer(settings, make_items, total_bytes)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    job = _job(settings, tokenizer, dtype)
    progress = Progress(total_bytes, "tokenising")
    with DatasetWriter(settings.out_dir, dtype, settings.shard_tokens) as writer:
        try:
            # closing(): on any failure the worker pool is shut down here, not whenever the generator is collected.
            with contextlib.closing(run_items(make_items(), job, settings.num_workers)) as results:
                for result in results:
                    _write_result(writer, result)
                    progress.update(result.input_bytes, result.tokens)
        finally:
            seconds = progress.close()
        writer.check_sizes(settings.block_size, what)
        meta = writer.commit(tokenizer, {**source, "skipped_documents": writer.skipped_documents})
    return meta, seconds


def count_of(number: int, noun: str) -> str:
    """'1 document', '2,000 documents'."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def summary_line(meta: dict[str, Any], out_dir: str | os.PathLike, seconds: float, input_bytes: int) -> str:
    """One line: documents, tokens and files per split, what was skipped and why, and the throughput."""
    parts = []
    files = 0
    for split, info in meta["splits"].items():
        files += len(info["files"])
        parts.append(
            f"{split} {count_of(info['tokens'], 'token')} / {count_of(info['documents'], 'document')} / "
            f"{count_of(len(info['files']), 'file')}"
        )
    tokens = sum(info["tokens"] for info in meta["splits"].values())
    skipped = meta.get("source", {}).get("skipped_documents", 0)
    skipped_files = meta.get("source", {}).get("skipped_files", {})
    rate = f"{input_bytes / 1e6 / seconds:.1f} MB/s, {tokens / 1e6 / seconds:.2f}M tokens/s" if seconds > 0 else ""
    return (
        f"wrote {files + 1} files to {out_dir} ({meta['dtype']}, vocab {meta['vocab_size']:,}): {'; '.join(parts)}"
        + (f"; {count_of(skipped, 'document')} skipped" if skipped else "")
        + (
            f"; {count_of(sum(skipped_files.values()), 'file')} left out ({describe_skipped(skipped_files)})"
            if any(skipped_files.values())
            else ""
        )
        + (f"; {input_bytes / 1e6:.1f} MB in {seconds:.1f} s ({rate})" if rate else "")
    )
