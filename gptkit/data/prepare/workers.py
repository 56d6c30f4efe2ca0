"""Tokenising workers: decode a work item, split it into documents, assign each to train or val, tokenise.

`run_items` runs items on a pool of processes (or in this process for --num_workers=1) and yields the results in
item order, so the output is the same for any number of workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from gptkit.core.errors import UserError
from gptkit.data.hf_tokenizer import HFTokenizer
from gptkit.data.prepare.items import (
    SPLITS,
    Documents,
    JsonlLines,
    SkippedDocument,
    TextPiece,
    WorkItem,
    is_val_document,
    without_byte_order_mark,
)
from gptkit.data.tokenizer import Tokenizer


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every worker of a run does with its items.

    `tokenizer` None means only collecting the characters (the first pass of --tokenizer=char). Workers get the
    tokenizer already built: forked workers inherit it, where each would otherwise rebuild GPT-2's BPE from --bpe_dir.
    """

    tokenizer: Tokenizer | None
    dtype: str
    seed: int
    val_fraction: float
    on_decode_error: str
    text_field: str


@dataclass(kw_only=True)
class SplitPart:
    """An item's tokens for one split, with the text bytes and documents they come from."""

    ids: np.ndarray
    text_bytes: int
    documents: int


@dataclass(kw_only=True)
class ItemResult:
    """What a worker hands back for one item: tokens per split, or the characters seen (character pass)."""

    input_bytes: int
    parts: dict[str, SplitPart] = field(default_factory=dict)
    skipped: int = 0
    chars: set[str] | None = None

    @property
    def tokens(self) -> int:
        """Tokens in all splits."""
        return sum(part.ids.size for part in self.parts.values())


class _Text(NamedTuple):
    split: str
    text: str
    text_bytes: int  # UTF-8 bytes of text
    starts_document: bool
    counts_document: bool


def _not_utf8(source: str, detail: str) -> str:
    # skip first: a stray file in another encoding is better left out than read as U+FFFD noise.
    return (
        f"{source} is not valid UTF-8 {detail}; convert it to UTF-8, pass --on_decode_error=skip to leave such "
        "documents out (e.g. stray files in another encoding), or --on_decode_error=replace to keep them with U+FFFD"
    )


def _at_offset(source: str, offset: int) -> str:
    # A .gz file is read decompressed, so the offset counts decompressed bytes.
    return f"at {'uncompressed ' if source.endswith('.gz') else ''}byte offset {offset}"


def _json_kind(value: object) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def _no_text_field(where: str, record: object, field: str) -> str:
    """Why a JSONL line gives no text: not an object, no such field, or a field that is no string."""
    if not isinstance(record, dict):
        return f"{where}: {_json_kind(record)}, not an object with a string field {field!r}; fix or remove the line"
    if field not in record:
        fields = ", ".join(repr(name) for name in list(record)[:10])
        return f"{where}: no string field {field!r} (fields: {fields or 'none'}); name the text field with --text_field"
    return (
        f"{where}: field {field!r} is {_json_kind(record[field])}, not a string; fix the line or name the text "
        "field with --text_field"
    )


class Worker:
    """Turns work items into results; one per worker process (or one in the main process)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.dtype = np.dtype(job.dtype)

    def run(self, item: WorkItem) -> ItemResult:
        """The tokens (or characters) of one item."""
        result = ItemResult(input_bytes=item.input_bytes)
        texts = self._texts(item, result)
        if self.job.tokenizer is None:
            result.chars = set()
            for text in texts:
                result.chars.update(text.text)
            return result
        ids: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
        text_bytes = dict.fromkeys(SPLITS, 0)
        documents = dict.fromkeys(SPLITS, 0)
        for text in texts:
            ids[text.split].append(self._encode(text.text, text.starts_document))
            text_bytes[text.split] += text.text_bytes
            documents[text.split] += 1 if text.counts_document else 0
        for split, arrays in ids.items():
            if arrays:
                joined = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
                result.parts[split] = SplitPart(ids=joined, text_bytes=text_bytes[split], documents=documents[split])
        return result

    def texts(self, item: WorkItem) -> Iterator[tuple[str, str]]:
        """(split, text) of each document, or piece of one, in `item`: decoded and checked as for tokenising
        (prepare_data/train_tokenizer.py reads its inputs so); documents the decode policy leaves out give none."""
        for text in self._texts(item, ItemResult(input_bytes=item.input_bytes)):
            yield text.split, text.text

    def _encode(self, text: str, starts_document: bool) -> np.ndarray:
        tokenizer = self.job.tokenizer
        assert tokenizer is not None
        # A piece after a cut continues its document: no prefix space where a SentencePiece-style tokenizer adds one.
        continues = not starts_document and isinstance(tokenizer, HFTokenizer)
        ids = tokenizer.encode_continuation_array(text) if continues else tokenizer.encode_array(text)
        separator = 1 if starts_document and tokenizer.eot_token is not None else 0
        out = np.empty(len(ids) + separator, dtype=self.dtype)
        if separator:
            out[0] = tokenizer.eot_token
        out[separator:] = ids
        return out

    def _split_of(self, file_index: int, key: int) -> str:
        job = self.job
        return "val" if is_val_document(job.seed, job.val_fraction, file_index, key) else "train"

    def _texts(self, item: WorkItem, result: ItemResult) -> Iterator[_Text]:
        """The item's texts; documents left out are counted in `result.skipped`."""
        match item:
            case TextPiece():
                text, text_bytes = self._decode_piece(item)
                if text:
                    yield _Text(item.split, text, text_bytes, item.starts_document, item.counts_document)
            case JsonlLines():
                yield from self._jsonl_texts(item, result)
            case Documents():
                for row, text in enumerate(item.texts, start=item.first_row):
                    if text:
                        yield _Text(self._split_of(item.file_index, row), text, len(text.encode("utf-8")), True, True)
            case SkippedDocument():
                result.skipped += 1
            case _:  # pragma: no cover - a programming error
                raise TypeError(f"not a work item: {item!r}")

    def _decode_piece(self, item: TextPiece) -> tuple[str, int]:
        data = without_byte_order_mark(item.data, at_file_start=item.offset == 0)
        skipped = len(item.data) - len(data)
        try:
            return data.decode("utf-8"), len(data)
        except UnicodeDecodeError as exc:
            if self.job.on_decode_error != "replace":
                # "skip" files were checked by the reader; failing here means the file changed meanwhile.
                where = _at_offset(item.source, item.offset + skipped + exc.start)
                raise UserError(_not_utf8(item.source, where)) from None
            text = data.decode("utf-8", errors="replace")
            return text, len(text.encode("utf-8"))

    def _jsonl_texts(self, item: JsonlLines, result: ItemResult) -> Iterator[_Text]:
        offset = item.offset
        for line_number, raw in enumerate(item.data.split(b"\n"), start=item.first_line):
            line_offset, offset = offset, offset + len(raw) + 1
            if not raw.strip():
                continue
            text = self._jsonl_text(item, raw, line_number, line_offset)
            if text is None:
                result.skipped += 1
            elif text:
                yield _Text(self._split_of(item.file_index, line_number), text, len(text.encode("utf-8")), True, True)

    def _jsonl_text(self, item: JsonlLines, raw: bytes, line_number: int, line_offset: int) -> str | None:
        """The text field of one JSONL line; None when --on_decode_error=skip leaves the line out."""
        policy, source = self.job.on_decode_error, item.source
        stripped = without_byte_order_mark(raw, at_file_start=line_offset == 0)
        raw, line_offset = stripped, line_offset + len(raw) - len(stripped)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if policy == "error":
                where = f"{_at_offset(source, line_offset + exc.start)} (line {line_number})"
                raise UserError(_not_utf8(source, where)) from None
            if policy == "skip":
                return None
            line = raw.decode("utf-8", errors="replace")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{source}:{line_number}: not valid JSON ({exc.msg}); fix or remove the line") from None
        except RecursionError:
            raise UserError(
                f"{source}:{line_number}: not valid JSON (nested too deeply); fix or remove the line"
            ) from None
        text = record.get(self.job.text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(_no_text_field(f"{source}:{line_number}", record, self.job.text_field))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # JSON can spell unpaired surrogates (\ud800), which are not text
            if policy == "error":
                raise UserError(_not_utf8(source, f"at line {line_number} (an unpaired surrogate)")) from None
            if policy == "skip":
                return None
            text = text.encode("utf-8", errors="replace").decode("utf-8")
        return text


# ------------------------------------------------------------------------------------------- the pool

_worker: Any = None  # the worker of this pool process (a Worker unless run_items was given another), set once


# Ctrl-C goes to the whole process group, and so does SIGTERM from `timeout` or a batch scheduler: the main
# process handles both (gptkit.core.errors.run_cli) and shuts the pool down; workers ignore them and finish their item.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def end_with_parent(parent_pid: int | None) -> None:
    """Linux: the kernel kills this worker when the main process (`parent_pid`, which forked it) dies, even by
    kill -9, which runs no cleanup; otherwise a worker waits for work forever. Elsewhere workers notice only a
    clean shutdown."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the main process died before the request was made
        os._exit(1)


def _init_worker(job: Any, parent_pid: int | None, make_worker: Callable[[Any], Any]) -> None:
    global _worker
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked while the main process forked us (`_submit`): discarded now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    end_with_parent(parent_pid)
    _worker = make_worker(job)


def _run_item(item: Any) -> Any:
    assert _worker is not None, "worker not initialised"
    return _worker.run(item)


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and shares the loaded modules and the built tokenizer; elsewhere the
    # platform default (which pickles the Job once per worker).
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else methods[0])


def _submit(pool: ProcessPoolExecutor, item: WorkItem, first: bool) -> Future:
    """pool.submit; the first call forks the workers, with Ctrl-C and SIGTERM blocked meanwhile.

    A forked worker runs the main process's handlers until `_init_worker` replaces them; a stop signal in that
    moment would raise in the worker and print a traceback. Blocked, it waits: the worker discards it and the
    main process receives its own copy on unblocking. The pool's helper threads, started here too, keep the
    mask, so stop signals reach only the main thread, which handles them.
    """
    if not first:
        return pool.submit(_run_item, item)
    with stop_signals_held():
        return pool.submit(_run_item, item)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait (blocked in this thread) until the block ends, then arrive."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def run_items(
    items: Iterable[Any], job: Any, num_workers: int, make_worker: Callable[[Any], Any] = Worker
) -> Iterator[Any]:
    """Run items on `num_workers` processes (in this process when <= 1); yield results in item order.

    Each process runs `make_worker(job).run(item)`: a Worker (tokenising text) unless another kind is given (chat
    data renders conversations). At most 2 x num_workers items are in flight, so memory stays bounded however
    long `items` is.
    """
    if num_workers <= 1:
        worker = make_worker(job)
        for item in items:
            yield worker.run(item)
        return
    context = _pool_context()
    parent_pid = os.getpid() if context.get_start_method() == "fork" else None  # else a worker's parent may differ
    pool = ProcessPoolExecutor(
        num_workers, mp_context=context, initializer=_init_worker, initargs=(job, parent_pid, make_worker)
    )
    pending: deque = deque()
    started = False
    try:
        for item in items:
            pending.append(_submit(pool, item, first=not started))
            started = True
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise UserError(
            "a tokenising worker process died (out of memory?); try fewer --num_workers or a smaller --chunk_bytes"
        ) from None
    finally:
        # A second Ctrl-C waits until the workers have left: cut short, the shutdown leaves them waiting for work
        # that never comes, and the interpreter's exit waits on them forever.
        with stop_signals_held():
            pool.shutdown(wait=True, cancel_futures=True)
