"""meta.json: written and read back, its files checked, every malformed description refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gptkit.core.errors import UserError
from gptkit.data.meta import dtype_for_vocab, read_meta, write_meta
from helpers import assert_one_line_message


def make_meta(**changes: object) -> dict:
    meta = {
        "format": "gpt-tokens",
        "version": 1,
        "tokenizer": {"kind": "char", "chars": ["a", "b", "c"], "eot": False},
        "vocab_size": 3,
        "dtype": "uint16",
        "eot_token": None,
        "splits": {
            "train": {"files": ["train.bin"], "tokens": 4, "text_bytes": 4, "documents": 1},
            "val": {"files": ["val.bin"], "tokens": 2, "text_bytes": 2, "documents": 1},
        },
        "source": {"note": "test"},
    }
    meta.update(changes)
    return meta


def test_write_then_read_meta(tmp_path: Path) -> None:
    meta = make_meta()
    write_meta(tmp_path, meta)
    assert json.loads((tmp_path / "meta.json").read_text()) == meta
    assert read_meta(tmp_path) == meta
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]  # no temporary file left


def test_read_meta_checks_files(tmp_path: Path) -> None:
    write_meta(tmp_path, make_meta())
    with pytest.raises(UserError, match=r"train.bin .*missing"):
        read_meta(tmp_path, check_files=True)
    np.array([0, 1, 2, 0], dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.array([1], dtype=np.uint16).tofile(tmp_path / "val.bin")  # one token short
    with pytest.raises(UserError, match="split 'val' files hold 2 bytes"):
        read_meta(tmp_path, check_files=True)
    np.array([1, 2], dtype=np.uint16).tofile(tmp_path / "val.bin")
    assert read_meta(tmp_path, check_files=True)["vocab_size"] == 3


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format": "other"}, "not a token-data description"),
        ({"vocab_size": 4}, "does not match the character table"),
        ({"dtype": "int8"}, "'dtype' must be one of"),
        ({"eot_token": 7}, "eot_token"),
        ({"splits": {"train": {"files": [], "tokens": 1, "text_bytes": 1, "documents": 1}}}, "non-empty list"),
        ({"splits": {"train": {"files": ["../x.bin"], "tokens": 1, "text_bytes": 1, "documents": 1}}}, "outside"),
        ({"splits": {"train": {"files": ["t.bin"], "tokens": -1, "text_bytes": 1, "documents": 1}}}, "'tokens'"),
        ({"tokenizer": {"kind": "tiktoken"}}, "needs 'encoding'"),
        (
            {"tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"}, "vocab_size": 100277, "dtype": "uint16"},
            "does not fit",
        ),
    ],
)
def test_malformed_meta_rejected(tmp_path: Path, changes: dict, message: str) -> None:
    (tmp_path / "meta.json").write_text(json.dumps(make_meta(**changes)))
    with pytest.raises(UserError, match=message):
        read_meta(tmp_path)
    with pytest.raises(UserError, match=message):
        write_meta(tmp_path / "out", make_meta(**changes))
    assert not (tmp_path / "out").exists()


def test_read_meta_missing_or_not_json(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        read_meta(tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"no meta.json"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_meta(tmp_path)


def test_dtype_for_vocab() -> None:
    assert dtype_for_vocab(65) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"
    assert dtype_for_vocab(100277) == "uint32"


@pytest.mark.parametrize(
    "name, command",
    [
        ("fineweb_edu", "python prepare_data/fineweb.py"),
        ("shakespeare_char", "python prepare_data/shakespeare_char.py"),
        ("mine", "python prepare_data/corpus.py --input=YOUR_FILES --out_dir="),
    ],
)
def test_a_missing_data_directory_names_the_script_that_prepares_it(tmp_path: Path, name: str, command: str) -> None:
    with pytest.raises(UserError) as error:
        read_meta(tmp_path / "data" / name)
    assert_one_line_message(
        error.value, f"no meta.json in {tmp_path / 'data' / name} (the directory does not exist)", command
    )
