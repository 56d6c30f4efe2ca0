"""Work items: bounded pieces of input for a tokenising worker, one type per kind of input, and the split rule.

Readers make them (gptkit.data.prepare.inputs for files, prepare_data/fineweb.py for parquet rows); a worker
dispatches on the type (gptkit.data.prepare.workers). Each item records `input_bytes`, the on-disk bytes it accounts
for, so progress reaches 100% exactly.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from dataclasses import dataclass
from typing import Any

SPLITS = ("train", "val")


@dataclass(frozen=True, kw_only=True)
class TextPiece:
    """A piece of one plain-text document, in the split the reader chose (a text file is one document)."""

    source: str
    data: bytes
    offset: int  # of data[0] in the (uncompressed) document: error messages name the byte
    split: str
    starts_document: bool  # the document's first piece: the end-of-text token goes before it
    counts_document: bool  # the document's first piece in its split: counted as a document there
    input_bytes: int


@dataclass(frozen=True, kw_only=True)
class JsonlLines:
    """Whole JSONL lines of one file; each non-blank line is a document keyed by its 1-based line number."""

    source: str
    file_index: int
    data: bytes
    offset: int  # of data[0] in the (uncompressed) file
    first_line: int
    input_bytes: int


@dataclass(frozen=True, kw_only=True)
class Documents:
    """Decoded documents (parquet rows) keyed by their row number from `first_row`; empty ones are left out."""

    file_index: int
    texts: list[str]
    first_row: int
    input_bytes: int


@dataclass(frozen=True, kw_only=True)
class SkippedDocument:
    """A document the reader left out whole (invalid UTF-8 with --on_decode_error=skip)."""

    input_bytes: int


WorkItem = TextPiece | JsonlLines | Documents | SkippedDocument


def is_val_document(seed: int, val_fraction: float, *key: int) -> bool:
    """Whether the document identified by `key` (e.g. file index, line number) belongs to the val split.

    A keyed hash rather than a random stream: the answer depends only on the seed and the document's key, so it
    is the same whatever the chunking, worker count or order of processing.
    """
    digest = hashlib.blake2b(repr((seed, *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2.0**64


def conversation_key(messages: list[dict[str, Any]]) -> int:
    """A conversation's key for is_val_document: a hash of its turns' roles and texts. Why its content, not its
    place in the files: a conversation given twice (datasets repeat records) goes to one split, never to train and
    val at once, whatever files and lines hold it."""
    turns = json.dumps([[message.get("role"), message.get("content")] for message in messages], ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(turns.encode("utf-8"), digest_size=8).digest(), "little")


def without_byte_order_mark(data: bytes, at_file_start: bool) -> bytes:
    """`data` less the UTF-8 byte-order mark that opens it where it opens a file: the file's mark, not its text."""
    return data.removeprefix(codecs.BOM_UTF8) if at_file_start else data
