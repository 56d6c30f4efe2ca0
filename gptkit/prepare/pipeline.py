"""Text -> token files: streaming input, parallel tokenisation, atomic sharded output and meta.json.

How a corpus flows through here:

1. `collect_inputs` expands --input paths, directories and globs into a sorted list of files.
2. The main process reads each file in blocks of about `chunk_bytes`, cuts them at safe boundaries and turns them
   into `Task`s (plain text pieces, blocks of whole JSONL lines, or lists of parquet rows). It never holds more
   than a few blocks, so memory does not grow with the corpus.
3. A pool of worker processes (or the main process for --num_workers=1) decodes, splits into documents, assigns
   each document to train or val and tokenises. Results come back in task order, so the output is the same for
   any number of workers.
4. `DatasetWriter` appends the tokens to `<split>.bin` (or `<split>_000000.bin`, ... shards) written as `*.tmp`,
   renames them into place only when everything succeeded, and writes meta.json last.

Documents: a plain text file is one document, a JSONL line is one, a parquet row is one. The end-of-text token
goes *before* each document, so every document in the stream starts after a separator.

Why cuts are safe: a long document is tokenised in pieces of at most `chunk_bytes`. A piece ends after a single
newline that sits between two non-space characters whenever the text has one in the second half of the block;
GPT-2's pre-tokeniser always separates text at such a point, so the tokens equal those of encoding the whole
document at once. Failing that, a piece ends before a single space between two non-space characters (also a
split point for GPT-2). Text with neither in half a block (long runs of whitespace, or e.g. Chinese without
spaces) is cut after any newline or at a character boundary, and its token count can then differ very slightly
from whole-document encoding.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import gzip
import hashlib
import json
import multiprocessing
import os
import signal
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import numpy as np

from gptkit import tokenizer as tok
from gptkit.download import byte_progress_bar
from gptkit.errors import UserError

SPLITS = ("train", "val")
DECODE_POLICIES = ("error", "replace", "skip")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 256
_ASCII_SPACE = frozenset(b" \t\n\r\x0b\x0c")
_MAX_CUT_CANDIDATES = 10_000


# ----------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputFile:
    """One input file: its path, position in the input list, format ("text"/"jsonl") and gzip flag."""

    path: Path
    index: int
    kind: str
    compressed: bool

    @property
    def size(self) -> int:
        """Bytes on disk (compressed size for .gz)."""
        return self.path.stat().st_size


def _describe_input(path: Path, index: int) -> InputFile:
    name = path.name.lower()
    compressed = name.endswith(".gz")
    if compressed:
        name = name[: -len(".gz")]
    kind = "jsonl" if name.endswith(JSONL_SUFFIXES) else "text"
    return InputFile(path=path, index=index, kind=kind, compressed=compressed)


def _files_under(directory: Path) -> list[Path]:
    # Hidden files and folders (.git, .DS_Store, editor swap files) are never corpus text.
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(root) / f for f in sorted(files) if not f.startswith("."))
    return found


def collect_inputs(patterns: Sequence[str], exclude: str | os.PathLike | None = None) -> list[InputFile]:
    """Expand files, directories (recursive) and globs into a de-duplicated list of InputFile, in order.

    Directories and glob matches are sorted so the order (and so the split and the output) is reproducible.
    Files under `exclude` (the output directory, which may sit inside an input directory) are left out.
    Raises UserError for a path that does not exist, a glob that matches nothing, or no files at all.
    """
    if not patterns:
        raise UserError("no input given: pass --input=FILE, a directory or a glob (repeat for more)")
    paths: list[Path] = []
    for pattern in patterns:
        candidate = Path(pattern).expanduser()
        if candidate.is_dir():
            paths.extend(_files_under(candidate))
        elif candidate.is_file():
            paths.append(candidate)
        elif glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(str(candidate), recursive=True))
            files = [p for m in matches for p in (_files_under(m) if m.is_dir() else [m]) if p.is_file()]
            if not files:
                raise UserError(f"--input={pattern} matches no files; check the pattern")
            paths.extend(files)
        else:
            raise UserError(f"input {pattern} does not exist; check the path")
    excluded = Path(exclude).resolve() if exclude is not None else None
    unique: dict[Path, Path] = {}
    for path in paths:
        resolved = path.resolve()
        if excluded is None or not resolved.is_relative_to(excluded):
            unique.setdefault(resolved, path)
    if not unique:
        raise UserError(f"no input files found in {', '.join(patterns)}")
    return [_describe_input(path, index) for index, path in enumerate(unique.values())]


def is_val_document(seed: int, val_fraction: float, *key: int) -> bool:
    """Whether the document identified by `key` (e.g. file index, line number) belongs to the val split.

    A keyed hash rather than a random stream: the answer depends only on the seed and the document's key, so it
    is the same whatever the chunking, worker count or order of processing.
    """
    digest = hashlib.blake2b(repr((seed, *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2.0**64


# --------------------------------------------------------------------------------------------- tasks


@dataclass
class Task:
    """A bounded unit of work for a tokenising worker.

    kind "text": `data` is a piece (bytes) of one plain-text document; the main process decided its split.
    kind "jsonl": `data` is whole JSONL lines (bytes), `first_key` the 1-based number of the first line.
    kind "docs": `data` is a list of document strings (parquet rows), `first_key` the first row's number.
    kind "skip": no data; one document was left out by the main process (--on_decode_error=skip).
    """

    kind: str
    source: str
    file_index: int
    data: Any = None
    offset: int = 0
    first_key: int = 0
    split: str | None = None
    starts_document: bool = False
    counts_document: bool = False
    input_bytes: int = 0


@dataclass
class TaskResult:
    """What a worker hands back: tokens and statistics per split, or the characters seen (vocabulary pass)."""

    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    text_bytes: dict[str, int] = field(default_factory=dict)
    documents: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    chars: set[str] | None = None
    input_bytes: int = 0


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker needs, small and picklable (workers rebuild the tokenizer from its meta)."""

    mode: str  # "encode" or "chars"
    tokenizer_meta: dict | None
    bpe_dir: str | None
    dtype: str
    seed: int
    val_fraction: float
    on_decode_error: str
    text_field: str


_built_tokenizers: dict[str, tok.Tokenizer] = {}


def _tokenizer_key(tokenizer_meta: dict, bpe_dir: str | None) -> str:
    return json.dumps([tokenizer_meta, bpe_dir], sort_keys=True)


class _Worker:
    """Per-process state: the tokenizer built once, then `run(task)` for each task."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.tokenizer = None
        if settings.mode == "encode":
            assert settings.tokenizer_meta is not None
            # A forked worker inherits the parent's tokenizer; building GPT-2's again costs ~0.2 s per process.
            key = _tokenizer_key(settings.tokenizer_meta, settings.bpe_dir)
            self.tokenizer = _built_tokenizers.get(key) or tok.tokenizer_from_meta(
                settings.tokenizer_meta, bpe_dir=settings.bpe_dir
            )
        self.dtype = np.dtype(settings.dtype)

    def run(self, task: Task) -> TaskResult:
        result = TaskResult(input_bytes=task.input_bytes)
        if task.kind == "skip":
            result.skipped = 1
            return result
        if self.settings.mode == "chars":
            result.chars = set()
            for _, text, _, _, _ in self._documents(task, result):
                result.chars.update(text)
            return result
        pieces: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
        for split, text, text_bytes, starts, counts in self._documents(task, result):
            pieces[split].append(self._encode(text, starts))
            result.text_bytes[split] = result.text_bytes.get(split, 0) + text_bytes
            result.documents[split] = result.documents.get(split, 0) + (1 if counts else 0)
        for split, arrays in pieces.items():
            if arrays:
                result.tokens[split] = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
        return result

    def _encode(self, text: str, starts_document: bool) -> np.ndarray:
        tokenizer = self.tokenizer
        ids = tokenizer.encode_array(text)
        separator = 1 if starts_document and tokenizer.eot_token is not None else 0
        out = np.empty(len(ids) + separator, dtype=self.dtype)
        if separator:
            out[0] = tokenizer.eot_token
        out[separator:] = ids
        return out

    def _split_of(self, task: Task, key: int) -> str:
        settings = self.settings
        return "val" if is_val_document(settings.seed, settings.val_fraction, task.file_index, key) else "train"

    def _documents(self, task: Task, result: TaskResult) -> Iterator[tuple[str, str, int, bool, bool]]:
        """(split, text, UTF-8 bytes of text, starts a document, counts as a document) for each text in the task."""
        if task.kind == "text":
            text, text_bytes = self._decode_piece(task)
            if text:
                yield task.split or "train", text, text_bytes, task.starts_document, task.counts_document
        elif task.kind == "jsonl":
            for line_number, text, text_bytes in self._jsonl_records(task, result):
                yield self._split_of(task, line_number), text, text_bytes, True, True
        elif task.kind == "docs":
            for row, text in enumerate(task.data, start=task.first_key):
                if text:
                    yield self._split_of(task, row), text, len(text.encode("utf-8")), True, True
        else:  # pragma: no cover - a programming error
            raise ValueError(f"unknown task kind {task.kind!r}")

    def _decode_piece(self, task: Task) -> tuple[str, int]:
        data: bytes = task.data
        try:
            return data.decode("utf-8"), len(data)
        except UnicodeDecodeError as exc:
            if self.settings.on_decode_error != "replace":
                # "skip" files were checked by the main process; failing here means the file changed meanwhile.
                raise UserError(_not_utf8(task, _at_offset(task, task.offset + exc.start))) from None
            text = data.decode("utf-8", errors="replace")
            return text, len(text.encode("utf-8"))

    def _jsonl_records(self, task: Task, result: TaskResult) -> Iterator[tuple[int, str, int]]:
        policy = self.settings.on_decode_error
        field_name = self.settings.text_field
        offset = task.offset
        for line_number, raw in enumerate(task.data.split(b"\n"), start=task.first_key):
            line_offset, offset = offset, offset + len(raw) + 1
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if policy == "error":
                    where = f"{_at_offset(task, line_offset + exc.start)} (line {line_number})"
                    raise UserError(_not_utf8(task, where)) from None
                if policy == "skip":
                    result.skipped += 1
                    continue
                line = raw.decode("utf-8", errors="replace")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"{task.source}:{line_number}: not valid JSON ({exc.msg}); fix or remove the line"
                ) from None
            text = record.get(field_name) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(
                    f"{task.source}:{line_number}: no string field {field_name!r}; name the text field "
                    "with --text_field"
                )
            try:
                text_bytes = len(text.encode("utf-8"))
            except UnicodeEncodeError:  # JSON can spell unpaired surrogates (\ud800), which are not text
                if policy == "error":
                    raise UserError(_not_utf8(task, f"at line {line_number} (an unpaired surrogate)")) from None
                if policy == "skip":
                    result.skipped += 1
                    continue
                text = text.encode("utf-8", errors="replace").decode("utf-8")
                text_bytes = len(text.encode("utf-8"))
            if text:
                yield line_number, text, text_bytes


def _not_utf8(task: Task, detail: str) -> str:
    return (
        f"{task.source} is not valid UTF-8 {detail}; fix the file or pass --on_decode_error=replace "
        "(or --on_decode_error=skip to leave the document out)"
    )


def _at_offset(task: Task, offset: int) -> str:
    # A .gz file is read decompressed, so the offset counts decompressed bytes.
    return f"at {'uncompressed ' if task.source.endswith('.gz') else ''}byte offset {offset}"


_worker: _Worker | None = None


def _init_worker(settings: WorkerSettings) -> None:
    global _worker
    # Ctrl-C goes to the whole process group; the main process handles it and shuts the pool down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker = _Worker(settings)


def _run_task(task: Task) -> TaskResult:
    assert _worker is not None, "worker not initialised"
    return _worker.run(task)


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and shares the loaded modules; elsewhere the platform default.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else methods[0])


def run_tasks(tasks: Iterable[Task], settings: WorkerSettings, num_workers: int) -> Iterator[TaskResult]:
    """Run tasks on `num_workers` processes (in this process when <= 1); yield results in task order.

    At most 2 x num_workers tasks are in flight, so memory stays bounded however long `tasks` is.
    """
    if num_workers <= 1:
        worker = _Worker(settings)
        for task in tasks:
            yield worker.run(task)
        return
    pool = ProcessPoolExecutor(num_workers, mp_context=_pool_context(), initializer=_init_worker, initargs=(settings,))
    pending: deque = deque()
    try:
        for task in tasks:
            pending.append(pool.submit(_run_task, task))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise UserError(
            "a tokenising worker process died (out of memory?); try fewer --num_workers or a smaller --chunk_bytes"
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------------------------- reading inputs


def _last_separator_between_words(buffer: bytes, separator: bytes, floor: int, limit: int) -> int:
    """Index of the last single `separator` byte in [floor, limit) with a non-space byte on each side, or -1."""
    position = buffer.rfind(separator, floor, limit)
    for _ in range(_MAX_CUT_CANDIDATES):  # bounded: whitespace-heavy text falls through to the next rule
        if position <= 0:
            return -1
        inside = position + 1 < len(buffer)
        if inside and buffer[position - 1] not in _ASCII_SPACE and buffer[position + 1] not in _ASCII_SPACE:
            return position
        position = buffer.rfind(separator, floor, position)
    return -1


def find_cut(buffer: bytes, limit: int) -> int:
    """A position in (0, limit] where `buffer` can be cut without changing its tokenisation (see module doc).

    Prefers just after a single newline between two non-space bytes, then just before a single space between
    two non-space bytes (GPT-2's pre-tokeniser splits text at both), then after any newline, then any UTF-8
    character boundary. Only the second half of the window is searched, so pieces stay large.
    """
    limit = min(limit, len(buffer))
    floor = limit // 2
    newline = _last_separator_between_words(buffer, b"\n", floor, limit)
    if newline >= 0:
        return newline + 1
    space = _last_separator_between_words(buffer, b" ", floor + 1, limit)
    if space > 0:
        return space
    newline = buffer.rfind(b"\n", floor, limit)
    if newline >= 0:
        return newline + 1
    cut = limit
    while cut > 1 and cut < len(buffer) and buffer[cut] & 0xC0 == 0x80:  # never inside a multi-byte character
        cut -= 1
    return cut


@contextlib.contextmanager
def _open_input(file: InputFile) -> Iterator[tuple[IO[bytes], Callable[[], int]]]:
    """The file's (decompressed) byte stream and a function giving the bytes consumed on disk so far."""
    with open(file.path, "rb") as raw:
        if not file.compressed:
            yield raw, raw.tell
            return
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            yield stream, raw.tell


def _read_block(stream: IO[bytes], size: int, file: InputFile) -> bytes:
    try:
        return stream.read(size)
    except (OSError, EOFError, zlib.error) as exc:
        if file.compressed:
            raise UserError(f"{file.path} is not a valid gzip file ({exc}); re-create or re-download it") from exc
        raise


def _iter_blocks(file: InputFile, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(block, on-disk bytes consumed since the previous block) until the end of the file."""
    with _open_input(file) as (stream, disk_position):
        consumed = 0
        while True:
            block = _read_block(stream, chunk_bytes, file)
            now = disk_position()
            yield block, now - consumed
            consumed = now
            if not block:
                return


def _is_valid_utf8(file: InputFile, chunk_bytes: int) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for block, _ in _iter_blocks(file, chunk_bytes):
            decoder.decode(block, final=not block)
    except UnicodeDecodeError:
        return False
    return True


def _uncompressed_size(file: InputFile, chunk_bytes: int) -> int:
    if not file.compressed:
        return file.size
    return sum(len(block) for block, _ in _iter_blocks(file, chunk_bytes))


def text_file_tasks(file: InputFile, chunk_bytes: int, split: str, val_from: int | None = None) -> Iterator[Task]:
    """Tasks for one plain-text document, in pieces of at most `chunk_bytes` cut at safe boundaries.

    All pieces go to `split`, except with `val_from` (a byte offset): the document is then cut at a safe point
    at or before that offset, the part before it goes to train and the rest to val (a single-document corpus).
    """
    source = str(file.path)
    buffer = b""
    offset = 0  # offset of buffer[0] in the (uncompressed) document
    pending_input = 0
    boundary: int | None = None  # where val starts, once chosen
    first_in = {name: True for name in SPLITS}

    def piece(data: bytes, at: int) -> Task:
        nonlocal pending_input
        piece_split = split if val_from is None else ("val" if boundary is not None and at >= boundary else "train")
        task = Task(
            kind="text",
            source=source,
            file_index=file.index,
            data=data,
            offset=at,
            split=piece_split,
            starts_document=at == 0,
            counts_document=first_in[piece_split],
            input_bytes=pending_input,
        )
        first_in[piece_split] = False
        pending_input = 0
        return task

    for block, disk_bytes in _iter_blocks(file, chunk_bytes):
        pending_input += disk_bytes
        buffer += block
        at_end = not block
        while buffer and (at_end or len(buffer) >= chunk_bytes):
            if val_from is not None and boundary is None and offset + len(buffer) > val_from:
                cut = find_cut(buffer, val_from - offset) if val_from > offset else 0
                boundary = offset + cut
            elif at_end and len(buffer) <= chunk_bytes:
                cut = len(buffer)
            else:
                cut = find_cut(buffer, chunk_bytes)
            if cut:
                yield piece(buffer[:cut], offset)
                buffer, offset = buffer[cut:], offset + cut
    if pending_input:  # empty file: still report its bytes so progress reaches 100%
        yield Task(kind="text", source=source, file_index=file.index, data=b"", input_bytes=pending_input)


def jsonl_file_tasks(file: InputFile, chunk_bytes: int) -> Iterator[Task]:
    """Tasks of whole JSONL lines, about `chunk_bytes` each (one longer line makes a longer task)."""
    buffer = b""
    offset = 0
    line_number = 1
    pending_input = 0
    for block, disk_bytes in _iter_blocks(file, chunk_bytes):
        pending_input += disk_bytes
        buffer += block
        at_end = not block
        if not at_end and len(buffer) < chunk_bytes:
            continue
        cut = len(buffer) if at_end else buffer.rfind(b"\n") + 1
        if cut == 0 and not at_end:
            continue  # a single line longer than a block: keep reading until it ends
        data, buffer = buffer[:cut], buffer[cut:]
        yield Task(
            kind="jsonl",
            source=str(file.path),
            file_index=file.index,
            data=data,
            offset=offset,
            first_key=line_number,
            input_bytes=pending_input,
        )
        offset += cut
        line_number += data.count(b"\n")
        pending_input = 0


def corpus_tasks(
    files: Sequence[InputFile], chunk_bytes: int, seed: int, val_fraction: float, on_decode_error: str
) -> Iterator[Task]:
    """All tasks for a list of inputs, in input order.

    One plain-text file alone is a single document, split by position (first 1 - val_fraction of its bytes
    train); otherwise every document goes wholly to train or val by `is_val_document`.
    """
    single_document = len(files) == 1 and files[0].kind == "text"
    for file in files:
        if file.kind == "jsonl":
            yield from jsonl_file_tasks(file, chunk_bytes)
            continue
        if on_decode_error == "skip" and not _is_valid_utf8(file, chunk_bytes):
            # Checked up front because a text file is one document: skipping must drop all of it.
            yield Task(kind="skip", source=str(file.path), file_index=file.index, input_bytes=file.size)
            continue
        if single_document:
            val_from = int(_uncompressed_size(file, chunk_bytes) * (1.0 - val_fraction))
            yield from text_file_tasks(file, chunk_bytes, "train", val_from=val_from)
        else:
            split = "val" if is_val_document(seed, val_fraction, file.index, 0) else "train"
            yield from text_file_tasks(file, chunk_bytes, split)


# ------------------------------------------------------------------------------------------- writing


def _token_file_name(split: str, shard: int | None) -> str:
    return f"{split}.bin" if shard is None else f"{split}_{shard:06d}.bin"


def _is_token_file_name(name: str) -> bool:
    stem, _, extension = name.partition(".")
    if extension != "bin":
        return False
    split, _, number = stem.partition("_")
    return split in SPLITS and (number == "" or (len(number) == 6 and number.isdigit()))


class TokenFileWriter:
    """Appends one split's tokens to `<split>.bin.tmp`, or to shards of exactly `shard_tokens` tokens
    (`<split>_000000.bin.tmp`, ...; the last one shorter). `names` lists the final file names in order.
    """

    def __init__(self, out_dir: Path, split: str, dtype: str, shard_tokens: int | None) -> None:
        self.out_dir = out_dir
        self.split = split
        self.dtype = np.dtype(dtype).newbyteorder("<")  # the file format is little-endian on every machine
        self.shard_tokens = shard_tokens
        self.names: list[str] = []
        self.tokens = 0
        self._handle: IO[bytes] | None = None
        self._in_file = 0

    def temp_path(self, name: str) -> Path:
        """The temporary path a final file name is written under."""
        return self.out_dir / (name + ".tmp")

    def _open_next(self) -> None:
        self._close_current()
        name = _token_file_name(self.split, None if self.shard_tokens is None else len(self.names))
        self.names.append(name)
        self._handle = open(self.temp_path(name), "wb")  # noqa: SIM115 - kept open across write() calls
        self._in_file = 0

    def _close_current(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None

    def write(self, ids: np.ndarray) -> None:
        """Append token ids (already of this writer's dtype) to the split's stream."""
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        while ids.size:
            if self._handle is None or (self.shard_tokens is not None and self._in_file >= self.shard_tokens):
                self._open_next()
            room = ids.size if self.shard_tokens is None else min(ids.size, self.shard_tokens - self._in_file)
            assert self._handle is not None
            self._handle.write(memoryview(ids[:room]).cast("B"))
            self._in_file += room
            self.tokens += room
            ids = ids[room:]

    def close(self) -> None:
        """Flush, fsync and close; an empty split still gets one (empty) file."""
        if not self.names:
            self._open_next()
        self._close_current()

    def discard(self) -> None:
        """Close and delete this writer's temporary files."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        for name in self.names:
            self.temp_path(name).unlink(missing_ok=True)


@dataclass
class SplitStats:
    """Per-split counters kept next to the token files."""

    text_bytes: int = 0
    documents: int = 0


class DatasetWriter:
    """Writes one data directory for one run; nothing in it looks complete until `commit` has finished.

    On creation stale `*.tmp` files of an interrupted run are removed. Token files are written as `*.tmp`;
    `commit` removes the old meta.json, renames the new files into place, removes token files of an earlier
    run that the new one does not list, and writes meta.json last. Used as a context manager, an exception
    discards this run's temporaries and leaves the directory as it was before the run.
    """

    def __init__(self, out_dir: str | os.PathLike, dtype: str, shard_tokens: int | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.created_out_dir = not self.out_dir.exists()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.out_dir.glob("*.tmp"):
            stale.unlink()
        self.dtype = dtype
        self.writers = {split: TokenFileWriter(self.out_dir, split, dtype, shard_tokens) for split in SPLITS}
        self.stats = {split: SplitStats() for split in SPLITS}
        self.skipped_documents = 0
        self.committed = False

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if not self.committed:
            self.discard()

    def add(self, result: TaskResult) -> None:
        """Append a worker's result (in task order)."""
        for split, ids in result.tokens.items():
            self.writers[split].write(ids)
        for split, count in result.text_bytes.items():
            self.stats[split].text_bytes += count
        for split, count in result.documents.items():
            self.stats[split].documents += count
        self.skipped_documents += result.skipped

    def write(self, split: str, ids: np.ndarray, text_bytes: int, documents: int) -> None:
        """Append tokens held in memory (the small fixed corpora) with their statistics."""
        self.writers[split].write(ids)
        self.stats[split].text_bytes += text_bytes
        self.stats[split].documents += documents

    def tokens(self, split: str) -> int:
        """Tokens written to `split` so far."""
        return self.writers[split].tokens

    def check_sizes(self, block_size: int, what: str) -> None:
        """UserError when the corpus is empty or a split cannot fill one training block (block_size + 1)."""
        if all(self.tokens(split) == 0 for split in SPLITS):
            skipped = f" ({self.skipped_documents} document(s) skipped)" if self.skipped_documents else ""
            raise UserError(f"the corpus is empty: no text found in {what}{skipped}")
        for split in SPLITS:
            count = self.tokens(split)
            if count < block_size + 1:
                raise UserError(
                    f"the {split} split has {count} tokens, fewer than one training block "
                    f"(block_size {block_size} + 1): add text, change --val_fraction or --seed, or lower --block_size"
                )

    def commit(self, tokenizer: tok.Tokenizer, source: dict[str, Any]) -> dict[str, Any]:
        """Rename the token files into place and write meta.json last; returns the meta dict."""
        for writer in self.writers.values():
            writer.close()
        meta = {
            "format": tok.META_FORMAT,
            "version": tok.META_VERSION,
            "tokenizer": tokenizer.to_meta(),
            "vocab_size": tokenizer.vocab_size,
            "dtype": self.dtype,
            "eot_token": tokenizer.eot_token,
            "splits": {
                split: {
                    "files": writer.names,
                    "tokens": writer.tokens,
                    "text_bytes": self.stats[split].text_bytes,
                    "documents": self.stats[split].documents,
                }
                for split, writer in self.writers.items()
            },
            "source": source,
        }
        tok.validate_meta(meta, "meta to write")
        # From here until meta.json is written the directory has no meta.json, so nobody takes it as complete.
        (self.out_dir / tok.META_FILENAME).unlink(missing_ok=True)
        new_names = {name for writer in self.writers.values() for name in writer.names}
        for writer in self.writers.values():
            for name in writer.names:
                os.replace(writer.temp_path(name), self.out_dir / name)
        for old in self.out_dir.iterdir():
            if _is_token_file_name(old.name) and old.name not in new_names:
                old.unlink()  # e.g. shards beyond the new count, or train.bin after switching to shards
        tok.write_meta(self.out_dir, meta)
        self.committed = True
        return meta

    def discard(self) -> None:
        """Delete this run's temporary files (and the output directory if this run created it)."""
        for writer in self.writers.values():
            writer.discard()
        if self.created_out_dir:
            with contextlib.suppress(OSError):  # not empty: someone else put files there meanwhile
                self.out_dir.rmdir()


# ---------------------------------------------------------------------------------------- progress


class Progress:
    """A tqdm bar on stderr (only when stderr is a terminal) showing input MB/s and tokens/s."""

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


# ------------------------------------------------------------------------------------------- driving


@dataclass
class PrepareSettings:
    """The knobs of a streaming preparation run (corpus.py and fineweb.py)."""

    out_dir: str
    tokenizer: str = "gpt2"
    bpe_dir: str | None = None
    val_fraction: float = 0.05
    seed: int = 1337
    shard_tokens: int | None = None
    block_size: int = 256
    num_workers: int = 1
    on_decode_error: str = "error"
    text_field: str = "text"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    @classmethod
    def from_cli(cls, cfg: Any) -> PrepareSettings:
        """The preparation settings a script's CLI settings name (fields it lacks keep their defaults)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)})


def check_settings(settings: Any) -> None:
    """UserError for impossible values of the shared preparation settings."""
    if not 0.0 < settings.val_fraction < 1.0:
        raise UserError(f"--val_fraction must be between 0 and 1 (exclusive), got {settings.val_fraction}")
    if settings.shard_tokens is not None and settings.shard_tokens < 1:
        raise UserError("--shard_tokens must be a positive number of tokens, or None for one file per split")
    if settings.block_size < 1:
        raise UserError("--block_size must be at least 1")
    if getattr(settings, "on_decode_error", "error") not in DECODE_POLICIES:
        raise UserError(f"--on_decode_error must be one of {', '.join(DECODE_POLICIES)}")
    if settings.chunk_bytes < MIN_CHUNK_BYTES:
        raise UserError(f"--chunk_bytes must be at least {MIN_CHUNK_BYTES}")
    if settings.num_workers < 0:
        raise UserError("--num_workers must be 0 or more (0 or 1 = tokenise in the main process)")


def default_num_workers() -> int:
    """The CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def _worker_settings(
    settings: PrepareSettings, mode: str, tokenizer: tok.Tokenizer | None, dtype: str
) -> WorkerSettings:
    return WorkerSettings(
        mode=mode,
        tokenizer_meta=None if tokenizer is None else tokenizer.to_meta(),
        bpe_dir=settings.bpe_dir,
        dtype=dtype,
        seed=settings.seed,
        val_fraction=settings.val_fraction,
        on_decode_error=settings.on_decode_error,
        text_field=settings.text_field,
    )


def build_char_vocabulary(
    make_tasks: Callable[[], Iterable[Task]], settings: PrepareSettings, total_bytes: int | None
) -> tok.CharTokenizer:
    """First streaming pass for --tokenizer=char: the sorted characters of every document, plus end-of-text."""
    chars: set[str] = set()
    progress = Progress(total_bytes, "characters")
    try:
        worker_settings = _worker_settings(settings, "chars", None, "uint32")
        with contextlib.closing(run_tasks(make_tasks(), worker_settings, settings.num_workers)) as results:
            for result in results:
                chars |= result.chars or set()
                progress.update(result.input_bytes, 0)
    finally:
        progress.close()
    if not chars:
        raise UserError("the corpus is empty: no text found in the inputs")
    return tok.CharTokenizer(sorted(chars), eot=True)


def make_tokenizer(settings: PrepareSettings, make_tasks: Callable[[], Iterable[Task]], total_bytes: int | None):
    """The tokenizer named by settings.tokenizer ('char' scans the corpus for its characters first)."""
    if settings.tokenizer == "char":
        if settings.bpe_dir is not None:
            raise UserError("--bpe_dir is for GPT-2 BPE; it makes no sense with --tokenizer=char")
        return build_char_vocabulary(make_tasks, settings, total_bytes)
    return tok.TiktokenTokenizer(settings.tokenizer, bpe_dir=settings.bpe_dir)


def prepare(
    make_tasks: Callable[[], Iterable[Task]],
    settings: PrepareSettings,
    source: dict[str, Any],
    total_bytes: int | None,
    what: str,
) -> tuple[dict[str, Any], float]:
    """Tokenise every task's text into settings.out_dir; returns (meta, seconds).

    `make_tasks` is called once more for the character pass of --tokenizer=char. `what` names the input in
    error messages. On any failure the output directory is left as it was (no file of this run remains).
    """
    check_settings(settings)
    tokenizer = make_tokenizer(settings, make_tasks, total_bytes)
    dtype = tok.dtype_for_vocab(tokenizer.vocab_size)
    worker_settings = _worker_settings(settings, "encode", tokenizer, dtype)
    _built_tokenizers[_tokenizer_key(tokenizer.to_meta(), settings.bpe_dir)] = tokenizer
    progress = Progress(total_bytes, "tokenising")
    with DatasetWriter(settings.out_dir, dtype, settings.shard_tokens) as writer:
        try:
            # closing(): on any failure the worker pool is shut down here, not whenever the generator is collected.
            with contextlib.closing(run_tasks(make_tasks(), worker_settings, settings.num_workers)) as results:
                for result in results:
                    writer.add(result)
                    progress.update(result.input_bytes, sum(ids.size for ids in result.tokens.values()))
        finally:
            seconds = progress.close()
        writer.check_sizes(settings.block_size, what)
        source = {**source, "skipped_documents": writer.skipped_documents}
        meta = writer.commit(tokenizer, source)
    return meta, seconds


def write_dataset(
    out_dir: str | os.PathLike,
    tokenizer: tok.Tokenizer,
    splits: dict[str, tuple[np.ndarray, int, int]],
    source: dict[str, Any],
) -> dict[str, Any]:
    """Write token arrays held in memory: splits maps name -> (ids, text_bytes, documents). Returns the meta."""
    dtype = tok.dtype_for_vocab(tokenizer.vocab_size)
    with DatasetWriter(out_dir, dtype) as writer:
        for split, (ids, text_bytes, documents) in splits.items():
            writer.write(split, np.asarray(ids).astype(dtype), text_bytes, documents)
        return writer.commit(tokenizer, source)


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def summary_line(meta: dict[str, Any], out_dir: str | os.PathLike, seconds: float, input_bytes: int) -> str:
    """One line: documents, tokens and files per split, and the throughput."""
    parts = []
    files = 0
    for split, info in meta["splits"].items():
        files += len(info["files"])
        parts.append(
            f"{split} {_count(info['tokens'], 'token')} / {_count(info['documents'], 'document')} / "
            f"{_count(len(info['files']), 'file')}"
        )
    tokens = sum(info["tokens"] for info in meta["splits"].values())
    skipped = meta.get("source", {}).get("skipped_documents", 0)
    rate = f"{input_bytes / 1e6 / seconds:.1f} MB/s, {tokens / 1e6 / seconds:.2f}M tokens/s" if seconds > 0 else ""
    return (
        f"wrote {files + 1} files to {out_dir} ({meta['dtype']}, vocab {meta['vocab_size']:,}): {'; '.join(parts)}"
        + (f"; {_count(skipped, 'document')} skipped" if skipped else "")
        + (f"; {input_bytes / 1e6:.1f} MB in {seconds:.1f} s ({rate})" if rate else "")
    )
