"""Conversations in input files: JSONL (optionally .gz) and parquet, read in bounded work items.

A record is one JSONL line or one parquet row, in one of these forms:

- `{"messages": [{"role": ..., "content": ...}, ...]}` (OpenAI's format, TRL's conversational one; the field's
  name is --text_field);
- `{"prompt": "...", "completion": "..."}`: a user turn and the assistant's reply;
- `{"prompt": [messages], "completion": [messages]}` (TRL's conversational prompt/completion): only the
  completion is trained on, as TRL does.

Readers cut the files into items (whole JSONL lines, as corpus.py does; groups of parquet rows read a batch at a
time); `records` turns an item back into (where, record) pairs, and `conversation_of` a record into
messages. Problems are ChatErrors whose `reason` counts them when --on_bad=skip leaves them out.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gptkit.core.errors import UserError
from gptkit.data.chat import ChatError
from gptkit.data.prepare.discover import JSONL_SUFFIXES, InputFile
from gptkit.data.prepare.inputs import jsonl_file_items
from gptkit.data.prepare.items import JsonlLines, without_byte_order_mark
from gptkit.data.prepare.parquet import covered_bytes, import_parquet

PARQUET_SUFFIX = ".parquet"
PARQUET_BATCH_ROWS = 64  # rows read at once; an item gathers batches up to --chunk_bytes


@dataclass(frozen=True, kw_only=True)
class ParquetRows:
    """Rows of one parquet file as Python objects, keyed by their row number from `first_row`."""

    source: str
    file_index: int
    rows: list[dict[str, Any]]
    first_row: int
    input_bytes: int


ChatItem = JsonlLines | ParquetRows
ColumnChoice = Callable[[list[str], str, str], list[str]]  # (a file's columns, the field, its name) -> columns to read


@dataclass(frozen=True, kw_only=True)
class Record:
    """One conversation's record: `where` names it in messages (file:line)."""

    where: str
    value: Any  # the parsed record, or a ChatError when the line could not be read


def file_format(file: InputFile) -> str:
    """ "jsonl" or "parquet"; UserError for any other file."""
    name = file.path.name.lower()
    if name.endswith(PARQUET_SUFFIX):
        return "parquet"
    if file.kind == "jsonl":
        return "jsonl"
    raise UserError(
        f"{file.path}: chat data is read from {', '.join(JSONL_SUFFIXES)} files (optionally .gz) or {PARQUET_SUFFIX} "
        "files; leave others out with --exclude or --include"
    )


def chat_items(
    files: Sequence[InputFile], chunk_bytes: int, field: str, columns: ColumnChoice | None = None
) -> Iterator[ChatItem]:
    """Every file's work items, in input order; `columns` picks a parquet file's columns (default: the messages
    field, else prompt and completion)."""
    pq = None
    for file in files:
        if file_format(file) == "jsonl":
            yield from jsonl_file_items(file, chunk_bytes)
        else:
            pq = pq or import_parquet()
            yield from parquet_items(file, chunk_bytes, field, pq, columns or _parquet_columns)


def _parquet_columns(names: list[str], field: str, source: str) -> list[str]:
    if field in names:
        return [field]
    if "prompt" in names and "completion" in names:
        return ["prompt", "completion"]
    raise UserError(
        f"{source} has no column {field!r} nor 'prompt' and 'completion' (columns: {', '.join(names)}); "
        "name the messages column with --text_field"
    )


def parquet_items(
    file: InputFile, chunk_bytes: int, field: str, pq: Any, columns_of: ColumnChoice | None = None
) -> Iterator[ParquetRows]:
    """Items of about `chunk_bytes` of rows (in Arrow's memory), reading the file a batch of rows at a time."""
    source = str(file.path)
    try:
        parquet = pq.ParquetFile(file.path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError variants for a damaged or foreign file
        raise UserError(f"{source} is not a readable parquet file ({exc})") from None
    with parquet:
        columns = (columns_of or _parquet_columns)(parquet.schema_arrow.names, field, source)
        rows_total = max(parquet.metadata.num_rows, 1)
        disk_bytes = file.size
        rows: list[dict[str, Any]] = []
        size = first_row = row = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            rows += batch.to_pylist()
            size += batch.nbytes
            row += batch.num_rows
            if size >= chunk_bytes:
                yield _rows_item(file, rows, first_row, row, rows_total, disk_bytes)
                rows, size, first_row = [], 0, row
        if rows or first_row == 0:  # an empty file still counts its bytes
            yield _rows_item(file, rows, first_row, row, rows_total, disk_bytes)


def _rows_item(
    file: InputFile, rows: list[dict[str, Any]], first_row: int, end_row: int, rows_total: int, disk_bytes: int
) -> ParquetRows:
    covered = covered_bytes(disk_bytes, first_row, end_row, rows_total)
    return ParquetRows(
        source=str(file.path), file_index=file.index, rows=rows, first_row=first_row, input_bytes=covered
    )


def records(item: ChatItem) -> Iterator[Record]:
    """The item's records in order: JSONL lines (blank ones left out) parsed, parquet rows as they are."""
    if isinstance(item, ParquetRows):
        for row, value in enumerate(item.rows, start=item.first_row + 1):  # 1-based, as lines are
            yield Record(where=f"{item.source} row {row}", value=value)
        return
    for line_number, raw in enumerate(item.data.split(b"\n"), start=item.first_line):
        raw = without_byte_order_mark(raw, at_file_start=line_number == 1)
        if raw.strip():
            yield Record(where=f"{item.source}:{line_number}", value=_parse_line(raw))


def _parse_line(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return ChatError(f"not valid UTF-8 (at byte {exc.start} of the line)", reason="invalid UTF-8")
    except json.JSONDecodeError as exc:
        return ChatError(f"not valid JSON ({exc.msg})", reason="malformed JSON")
    except RecursionError:  # absurdly deep nesting
        return ChatError("not valid JSON (nested too deeply)", reason="malformed JSON")


def _as_messages(value: Any) -> Any:
    """A message list with only role and content (parquet structs carry every field any row has), else as is."""
    if not isinstance(value, list):
        return value
    return [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in value]


def conversation_of(record: Any, field: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, prompt): the record's conversation and, for a conversational prompt/completion, its prompt
    (whose turns are not trained on; [] otherwise). ChatError when the record holds no conversation."""
    if isinstance(record, ChatError):
        raise record
    if not isinstance(record, dict):
        raise ChatError(f"{_kind(record)}, not an object with {field!r} or 'prompt' and 'completion'", "not a record")
    if record.get(field) is not None:
        return _as_messages(record[field]), []
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], []
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt, completion = _as_messages(prompt), _as_messages(completion)
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in completion):
            raise ChatError("the completion has no assistant turn", reason="no assistant turn")
        return prompt + completion, prompt
    if prompt is not None or completion is not None:
        raise ChatError("'prompt' and 'completion' must both be text or both be message lists", "not a record")
    fields = ", ".join(repr(name) for name in list(record)[:10]) or "none"
    raise ChatError(
        f"no {field!r} field nor 'prompt' and 'completion' (fields: {fields}); name the messages field with "
        "--text_field",
        reason="not a record",
    )


def _kind(value: Any) -> str:
    kinds = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")
