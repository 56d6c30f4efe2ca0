"""Input files of a corpus: read them in bounded blocks, cut them into work items.

Finding the files is gptkit.data.prepare.discover's job; this module reads what it found.

Documents: a plain text file is one document and a JSONL line is one. The main process reads each file in blocks
of about `chunk_bytes` and never holds more than a few, so memory does not grow with the corpus.

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
import gzip
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import IO

from gptkit.core.errors import UserError, describe_os_error
from gptkit.data.prepare.discover import InputFile, is_single_document
from gptkit.data.prepare.items import JsonlLines, SkippedDocument, TextPiece, WorkItem, is_val_document
from gptkit.data.prepare.settings import PrepareSettings

_ASCII_SPACE = frozenset(b" \t\n\r\x0b\x0c")
# Whitespace-heavy text (blank lines, indentation) offers many separators, none between two words. Looking at no
# more than this many keeps a cut far cheaper than encoding the block, which matters because cuts are made in the
# main process, which feeds every worker.
_MAX_CUT_CANDIDATES = 10_000


# ------------------------------------------------------------------------------------------- safe cuts


def _last_separator_between_words(buffer: bytes, separator: bytes, floor: int, limit: int) -> int:
    """Index of the last single `separator` byte in [floor, limit) with a non-space character on each side, or -1."""
    position = buffer.rfind(separator, floor, limit)
    for _ in range(_MAX_CUT_CANDIDATES):  # bounded: whitespace-heavy text falls through to the next rule
        if position <= 0:
            return -1
        inside = position + 1 < len(buffer)
        if inside and not _is_space_ending_at(buffer, position) and not _is_space_starting_at(buffer, position + 1):
            return position
        position = buffer.rfind(separator, floor, position)
    return -1


def _is_space_ending_at(buffer: bytes, end: int) -> bool:
    """Whether the character just before buffer[end] is white space: an ASCII one, or one of Unicode's (a no-break
    space before a newline, common in text taken from HTML, is white space to GPT-2's pre-tokeniser too)."""
    if buffer[end - 1] < 0x80:
        return buffer[end - 1] in _ASCII_SPACE
    start = end - 1
    while start > max(0, end - 4) and buffer[start] & 0xC0 == 0x80:  # back to the character's first byte
        start -= 1
    return buffer[start:end].decode("utf-8", errors="replace").isspace()


def _is_space_starting_at(buffer: bytes, start: int) -> bool:
    """Whether the character at buffer[start] is white space (as _is_space_ending_at)."""
    if buffer[start] < 0x80:
        return buffer[start] in _ASCII_SPACE
    end = start + 1
    while end < min(len(buffer), start + 4) and buffer[end] & 0xC0 == 0x80:
        end += 1
    return buffer[start:end].decode("utf-8", errors="replace").isspace()


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


# ------------------------------------------------------------------------------------------- reading


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
        reason = describe_os_error(exc) if isinstance(exc, OSError) else exc  # e.g. EIO: a failing disk
        raise UserError(f"cannot read {file.path}: {reason}") from exc


def _iter_blocks(file: InputFile, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(block, on-disk bytes consumed since the previous block) until the end of the file, which is b""."""
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


# ------------------------------------------------------------------------------------------- work items


def _document_pieces(file: InputFile, chunk_bytes: int, val_from: int | None) -> Iterator[tuple[int, bytes, int, bool]]:
    """(offset, piece, on-disk bytes it accounts for, whether it lies in val) for one document, in order.

    Pieces hold at most `chunk_bytes` and end at safe cuts. With `val_from` (a byte offset) the document is also
    cut at a safe point at or before it, and the pieces from there on lie in val. An empty file (or bytes left
    after the last piece, e.g. a gzip trailer) gives an empty piece, so progress still counts its bytes.
    """
    buffer = b""
    offset = 0  # of buffer[0] in the (uncompressed) document
    pending_input = 0
    boundary: int | None = None  # where val starts, once chosen
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
                yield offset, buffer[:cut], pending_input, boundary is not None and offset >= boundary
                pending_input = 0
                buffer, offset = buffer[cut:], offset + cut
    if pending_input:
        yield offset, b"", pending_input, False


def text_file_items(file: InputFile, chunk_bytes: int, split: str, val_from: int | None = None) -> Iterator[TextPiece]:
    """TextPieces of one plain-text document, each at most `chunk_bytes`, cut at safe boundaries.

    All pieces go to `split`, except with `val_from` (a byte offset): the document is then cut at a safe point
    at or before that offset, the part before it goes to `split` and the rest to val (a single-document corpus).
    """
    counted: set[str] = set()  # splits that already hold a piece of this document
    for offset, data, input_bytes, in_val in _document_pieces(file, chunk_bytes, val_from):
        piece_split = "val" if in_val else split
        yield TextPiece(
            source=str(file.path),
            data=data,
            offset=offset,
            split=piece_split,
            starts_document=offset == 0,
            counts_document=piece_split not in counted,
            input_bytes=input_bytes,
        )
        counted.add(piece_split)


def jsonl_file_items(file: InputFile, chunk_bytes: int) -> Iterator[JsonlLines]:
    """Items of whole JSONL lines, about `chunk_bytes` each (one longer line makes a longer item)."""
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
        yield JsonlLines(
            source=str(file.path),
            file_index=file.index,
            data=data,
            offset=offset,
            first_line=line_number,
            input_bytes=pending_input,
        )
        offset += cut
        line_number += data.count(b"\n")
        pending_input = 0


def corpus_items(files: Sequence[InputFile], settings: PrepareSettings) -> Iterator[WorkItem]:
    """All work items of a list of inputs, in input order.

    One plain-text file alone is a single document, split by position (first 1 - val_fraction of its bytes
    train); otherwise every document goes wholly to train or val by `is_val_document`.
    """
    chunk_bytes = settings.chunk_bytes
    for file in files:
        if file.kind == "jsonl":
            yield from jsonl_file_items(file, chunk_bytes)
            continue
        if settings.on_decode_error == "skip" and not _is_valid_utf8(file, chunk_bytes):
            # Checked up front because a text file is one document: skipping must drop all of it.
            yield SkippedDocument(input_bytes=file.size)
            continue
        if is_single_document(files):
            val_from = int(_uncompressed_size(file, chunk_bytes) * (1.0 - settings.val_fraction))
            yield from text_file_items(file, chunk_bytes, "train", val_from=val_from)
        else:
            split = "val" if is_val_document(settings.seed, settings.val_fraction, file.index, 0) else "train"
            yield from text_file_items(file, chunk_bytes, split)
