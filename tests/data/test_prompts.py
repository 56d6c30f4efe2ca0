"""Tests for gptkit/data/prompts.py: prompt files for GRPO and eval.py --prompts, and their mistakes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptkit.core.errors import UserError
from gptkit.data.prompts import load_prompts
from gptkit.data.tokenizer import CharTokenizer


def write_prompts(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def test_plain_prompts_are_encoded_with_their_records(tmp_path: Path) -> None:
    tokenizer = CharTokenizer.from_text("abc ")
    path = write_prompts(tmp_path / "p.jsonl", [{"prompt": "ab c", "answer": "1"}, {"prompt": "ca", "answer": "2"}])
    prompts = load_prompts(path, tokenizer)
    # CharTokenizer's ids are the ranks of the sorted characters: ' ' 0, 'a' 1, 'b' 2, 'c' 3
    assert [p.ids for p in prompts] == [[1, 2, 0, 3], [3, 1]]
    assert [p.sample["answer"] for p in prompts] == ["1", "2"]
    assert [p.where for p in prompts] == [f"{path}:1", f"{path}:2"]


def test_a_prompt_the_tokenizer_cannot_encode_names_its_file_and_line(tmp_path: Path) -> None:
    """A character model's eval.py --prompts on a file with other characters: the line says which record."""
    tokenizer = CharTokenizer.from_text("abc ")
    path = write_prompts(tmp_path / "p.jsonl", [{"prompt": "ab", "answer": "1"}, {"prompt": "a+b", "answer": "2"}])
    with pytest.raises(UserError) as raised:
        load_prompts(path, tokenizer)
    message = str(raised.value)
    assert message.startswith(f"{path}:2: ") and "'+'" in message and "\n" not in message


def test_a_prompt_file_as_editors_write_it_reads_as_its_records(tmp_path: Path) -> None:
    """A byte-order mark, CRLF line ends and a U+2028 inside a string (JSON needs no escape for it): the records."""
    tokenizer = CharTokenizer.from_text("ab\u2028")
    records = [{"prompt": "a\u2028b", "answer": "1"}, {"prompt": "ba", "answer": "2"}]
    text = "\r\n".join(json.dumps(record, ensure_ascii=False) for record in records) + "\r\n"
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    prompts = load_prompts(path, tokenizer)
    assert [p.sample for p in prompts] == records
    assert [p.ids for p in prompts] == [tokenizer.encode("a\u2028b"), tokenizer.encode("ba")]


def test_bytes_that_are_no_utf8_name_their_line(tmp_path: Path) -> None:
    """Line 3 holds a Latin-1 é (0xe9); with a byte-order mark before line 1, the line counted is still 3."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "ab"}\n\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError) as raised:
        load_prompts(path, CharTokenizer.from_text("abcf"))
    assert str(raised.value) == f"{path}:3: not UTF-8 text (byte 0xe9); save the file as UTF-8"
