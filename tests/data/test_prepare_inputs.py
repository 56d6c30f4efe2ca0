"""gptkit.data.prepare.inputs: safe cuts, and the work items each kind of file becomes."""

from __future__ import annotations

import gzip
from pathlib import Path

from gptkit.data.prepare import inputs
from gptkit.data.prepare.discover import find_inputs
from gptkit.data.prepare.items import JsonlLines, SkippedDocument, TextPiece
from gptkit.data.prepare.settings import PrepareSettings
from helpers import SHAKESPEARE


def test_find_cut_prefers_single_newline_between_words() -> None:
    buffer = b"alpha beta\n\ngamma\ndelta epsilon\nzeta"
    cut = inputs.find_cut(buffer, 30)
    assert buffer[:cut] == b"alpha beta\n\ngamma\n"  # not inside "\n\n", not after "epsilon" (too far)
    assert inputs.find_cut(b"aaaa bbbb cccc", 12) == 9  # no newline: before a space between words
    assert inputs.find_cut(b"aaaa  bbbb\r\ncccc", 14) == 12  # only a CRLF and a double space: after the newline
    text = "é" * 10  # two bytes each, no space: never inside a character
    cut = inputs.find_cut(text.encode(), 7)
    assert cut == 6 and text.encode()[:cut].decode() == "ééé"


def test_a_unicode_space_beside_a_newline_is_white_space_as_gpt2_s_pre_tokeniser_reads_it() -> None:
    # The newline follows a (no-break) space, so it is no newline between words: the cut falls before a space.
    for space in ("\u00a0", "\u3000"):
        buffer = f"ab cd gamma{space}\ndelta epsilon".encode()
        assert buffer[: inputs.find_cut(buffer, len(buffer))] == f"ab cd gamma{space}\ndelta".encode()
    buffer = "ab cd gamma\n\u2003delta epsilon".encode()  # and one that follows it
    assert buffer[: inputs.find_cut(buffer, len(buffer))] == "ab cd gamma\n\u2003delta".encode()


def test_find_cut_in_whitespace_heavy_text_still_cuts_after_a_newline() -> None:
    # More rejected candidates than the search looks at: the cut falls through to "after any newline".
    buffer = b"ab\n\n" * 100_000
    cut = inputs.find_cut(buffer, len(buffer) - 1)
    assert len(buffer) // 2 <= cut < len(buffer) and buffer[cut - 1 : cut] == b"\n"


def test_text_items_are_bounded_and_cover_the_file() -> None:
    file = find_inputs([str(SHAKESPEARE)]).files[0]
    items = list(inputs.text_file_items(file, 5000, "train"))
    assert all(isinstance(item, TextPiece) for item in items)
    assert max(len(item.data) for item in items) <= 5000
    assert b"".join(item.data for item in items) == SHAKESPEARE.read_bytes()
    assert sum(item.input_bytes for item in items) == SHAKESPEARE.stat().st_size
    assert [item.offset for item in items[:2]] == [0, len(items[0].data)]
    assert [(item.starts_document, item.counts_document) for item in items[:2]] == [(True, True), (False, False)]
    assert {item.split for item in items} == {"train"}


def test_a_single_document_splits_at_a_safe_cut_before_val_from() -> None:
    file = find_inputs([str(SHAKESPEARE)]).files[0]
    val_from = 150_000
    items = list(inputs.text_file_items(file, 20_000, "train", val_from=val_from))
    splits = [item.split for item in items]
    first_val = splits.index("val")
    assert set(splits[:first_val]) == {"train"} and set(splits[first_val:]) == {"val"}
    boundary = items[first_val].offset
    assert val_from - 20_000 < boundary <= val_from and SHAKESPEARE.read_bytes()[boundary - 1 : boundary] == b"\n"
    assert items[first_val].counts_document and not items[first_val].starts_document  # one document, two splits


def test_jsonl_items_hold_whole_lines_and_number_them(tmp_path: Path) -> None:
    lines = [f'{{"text": "line {i} {"x" * (i % 50)}"}}\n' for i in range(400)]
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(gzip.compress("".join(lines).encode()))
    items = list(inputs.jsonl_file_items(find_inputs([str(path)]).files[0], 1000))
    assert all(isinstance(item, JsonlLines) and item.data.endswith(b"\n") for item in items if item.data)
    assert b"".join(item.data for item in items) == "".join(lines).encode()
    starts = [item.first_line for item in items if item.data]
    assert starts[0] == 1 and starts[1] == 1 + items[0].data.count(b"\n")
    assert sum(item.input_bytes for item in items) == path.stat().st_size


def test_corpus_items_skip_a_bad_text_file_whole(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"fine\n\xff broken\n")
    (tmp_path / "good.txt").write_text("fine text\n")
    files = find_inputs([str(tmp_path)]).files
    skipping = list(inputs.corpus_items(files, PrepareSettings()))  # the default policy leaves it to the worker
    assert [type(item) for item in skipping] == [TextPiece, TextPiece]
    settings = PrepareSettings()
    settings.on_decode_error = "skip"
    items = list(inputs.corpus_items(files, settings))
    assert items[0] == SkippedDocument(input_bytes=files[0].size) and isinstance(items[1], TextPiece)
