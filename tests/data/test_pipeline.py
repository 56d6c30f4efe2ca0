"""The data pipeline in-process, end to end through gptkit.data.prepare.driver.prepare: exact tokens whatever the cuts,
shards and workers, the keyed split, atomic output, size checks. The parts alone: tests/data/test_prepare_*.py."""

from __future__ import annotations

import errno
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from gptkit.core.errors import UserError
from gptkit.data import tokenizer as tok
from gptkit.data.meta import read_meta
from gptkit.data.prepare import discover, driver, inputs, writer
from gptkit.data.prepare.items import is_val_document
from gptkit.data.prepare.settings import PrepareSettings
from helpers import SHAKESPEARE


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return SHAKESPEARE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def gpt2() -> tok.TiktokenTokenizer:
    return tok.TiktokenTokenizer("gpt2")


def run_corpus(paths: list[Path], out_dir: Path, **changes: object) -> dict:
    """What prepare_data/corpus.py does with these inputs and settings, in this process; returns the meta."""
    values = {"out_dir": str(out_dir), "block_size": 8, "num_workers": 1, "val_fraction": 0.1, **changes}
    settings = PrepareSettings(**values)
    files = discover.find_inputs([str(p) for p in paths]).files
    meta, _ = driver.prepare(partial(inputs.corpus_items, files, settings), settings, {"test": True}, None, "test")
    return meta


def read_split(out_dir: Path, meta: dict, split: str) -> np.ndarray:
    parts = [np.fromfile(out_dir / name, dtype=meta["dtype"]) for name in meta["splits"][split]["files"]]
    return np.concatenate(parts)


@pytest.mark.gpt2_bpe
def test_pieces_tokenise_like_the_whole_document(tmp_path: Path, shakespeare: str, gpt2) -> None:
    # Many small pieces, cut at single newlines between words: the same tokens as encoding the whole text.
    meta = run_corpus([SHAKESPEARE], tmp_path / "out", chunk_bytes=4096)
    stream = np.concatenate([read_split(tmp_path / "out", meta, "train"), read_split(tmp_path / "out", meta, "val")])
    assert stream[0] == gpt2.eot_token
    assert stream[1:].tolist() == gpt2.encode(shakespeare)
    # Position split of a single document: the first ~90% of bytes train, val starts at a line boundary.
    train_bytes = meta["splits"]["train"]["text_bytes"]
    assert train_bytes + meta["splits"]["val"]["text_bytes"] == len(shakespeare.encode())
    assert 0.89 * len(shakespeare) < train_bytes <= 0.9 * len(shakespeare)
    assert shakespeare[train_bytes - 1] == "\n"
    assert meta["splits"]["train"]["documents"] == meta["splits"]["val"]["documents"] == 1


@pytest.mark.gpt2_bpe
def test_one_giant_line_still_tokenises_exactly(tmp_path: Path, shakespeare: str, gpt2) -> None:
    # No newline at all: pieces end before a space between words, which GPT-2 also splits at.
    line = " ".join(shakespeare.split())
    (tmp_path / "line.txt").write_text(line)
    meta = run_corpus([tmp_path / "line.txt"], tmp_path / "out", chunk_bytes=3000)
    stream = np.concatenate([read_split(tmp_path / "out", meta, "train"), read_split(tmp_path / "out", meta, "val")])
    assert stream[1:].tolist() == gpt2.encode(line)


def test_is_val_document_is_keyed_and_near_the_fraction() -> None:
    keys = range(20000)
    picks = [is_val_document(7, 0.1, 0, k) for k in keys]
    assert picks == [is_val_document(7, 0.1, 0, k) for k in keys]
    assert 0.09 < sum(picks) / len(picks) < 0.11
    assert picks != [is_val_document(8, 0.1, 0, k) for k in keys]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.mark.gpt2_bpe
def test_jsonl_split_follows_the_keyed_hash(tmp_path: Path, gpt2, shakespeare: str) -> None:
    texts = [p for p in shakespeare.split("\n\n")[:300] if p]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    meta = run_corpus([corpus], tmp_path / "out", seed=5, chunk_bytes=2000)
    expected: dict[str, list[int]] = {"train": [], "val": []}
    for line, text in enumerate(texts, start=1):
        split = "val" if is_val_document(5, 0.1, 0, line) else "train"
        expected[split] += [gpt2.eot_token, *gpt2.encode(text)]
    for split in ("train", "val"):
        assert read_split(tmp_path / "out", meta, split).tolist() == expected[split]
        assert meta["splits"][split]["documents"] == expected[split].count(gpt2.eot_token)


@pytest.mark.gpt2_bpe
def test_shards_concatenate_to_the_unsharded_stream(tmp_path: Path) -> None:
    single = run_corpus([SHAKESPEARE], tmp_path / "single", chunk_bytes=20000)
    sharded = run_corpus([SHAKESPEARE], tmp_path / "sharded", chunk_bytes=20000, shard_tokens=7000)
    for split in ("train", "val"):
        names = sharded["splits"][split]["files"]
        assert names == [f"{split}_{i:06d}.bin" for i in range(len(names))]
        sizes = [(tmp_path / "sharded" / n).stat().st_size for n in names]
        assert all(size == 7000 * 2 for size in sizes[:-1]) and 0 < sizes[-1] <= 7000 * 2
        assert np.array_equal(
            read_split(tmp_path / "sharded", sharded, split), read_split(tmp_path / "single", single, split)
        )
    assert (
        read_meta(tmp_path / "sharded", check_files=True)["splits"]["train"]["tokens"]
        == single["splits"]["train"]["tokens"]
    )


@pytest.mark.gpt2_bpe
def test_more_workers_same_bytes(tmp_path: Path, shakespeare: str) -> None:
    texts = [p for p in shakespeare.split("\n\n")[:400] if p]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    one = run_corpus([corpus, SHAKESPEARE], tmp_path / "one", chunk_bytes=3000)
    two = run_corpus([corpus, SHAKESPEARE], tmp_path / "two", chunk_bytes=3000, num_workers=2)
    assert one["splits"] == two["splits"]
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_char_tokenizer_beyond_uint16_uses_uint32(tmp_path: Path) -> None:
    # 70,302 distinct CJK characters: with the end-of-text id the vocabulary needs 32-bit ids.
    codepoints = [*range(0x3400, 0x4DBF), *range(0x4E00, 0x9FFF), *range(0x20000, 0x2A6DF)]
    rng = np.random.default_rng(0)
    chars = [chr(c) for c in rng.permutation(codepoints)]
    text = "\n".join("".join(chars[i : i + 60]) for i in range(0, len(chars), 60)) + "\n"
    (tmp_path / "cjk.txt").write_text(text, encoding="utf-8")
    meta = run_corpus([tmp_path / "cjk.txt"], tmp_path / "out", tokenizer="char", chunk_bytes=50_000)
    assert meta["dtype"] == "uint32"
    assert meta["vocab_size"] == len(codepoints) + 2  # + newline + end-of-text
    assert meta["eot_token"] == meta["vocab_size"] - 1
    train = read_split(tmp_path / "out", meta, "train")
    assert (tmp_path / "out" / "train.bin").stat().st_size == 4 * meta["splits"]["train"]["tokens"]
    assert train.max() > 65535
    decoder = tok.tokenizer_from_meta(meta["tokenizer"])
    stream = np.concatenate([train, read_split(tmp_path / "out", meta, "val")])
    assert decoder.decode(stream[1:].tolist()) == text


@pytest.mark.gpt2_bpe
def test_failure_mid_write_leaves_the_directory_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    run_corpus([SHAKESPEARE], out, chunk_bytes=20000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_write = writer.TokenFileWriter.write
    calls = []

    def disk_full_on_third_write(self, ids):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, ids)

    monkeypatch.setattr(writer.TokenFileWriter, "write", disk_full_on_third_write)
    with pytest.raises(OSError, match="No space"):
        run_corpus([SHAKESPEARE], out, chunk_bytes=20000, shard_tokens=1000, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old dataset intact, no *.tmp left
    with pytest.raises(OSError, match="No space"):
        calls.clear()
        run_corpus([SHAKESPEARE], tmp_path / "fresh", chunk_bytes=20000)
    assert not (tmp_path / "fresh").exists()  # a directory this run created is removed again


@pytest.mark.gpt2_bpe
def test_rerun_replaces_outputs_and_removes_stale_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_corpus([SHAKESPEARE], out, chunk_bytes=20000, shard_tokens=5000)
    (out / "train.bin.tmp").write_bytes(b"left by a killed run")
    (out / ".meta.json.abc.tmp").write_text("{")
    with pytest.raises(UserError, match=r"already holds prepared data \(meta.json\); pass --overwrite=True"):
        run_corpus([SHAKESPEARE], out, chunk_bytes=20000)
    meta = run_corpus([SHAKESPEARE], out, chunk_bytes=20000, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert read_meta(out, check_files=True) == meta


@pytest.mark.gpt2_bpe
def test_size_checks(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="corpus is empty"):
        run_corpus([tmp_path / "empty.txt"], tmp_path / "out")
    with pytest.raises(UserError, match=r"val split has .* fewer than one training block"):
        run_corpus([SHAKESPEARE], tmp_path / "out", block_size=20_000)  # train holds such blocks, val does not
    assert not (tmp_path / "out").exists()


def test_prepare_refuses_impossible_settings_before_writing(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--chunk_bytes must be at least 256"):
        run_corpus([SHAKESPEARE], tmp_path / "out", chunk_bytes=10)
    assert not (tmp_path / "out").exists()


def test_write_dataset_in_memory_and_its_summary(tmp_path: Path) -> None:
    chars = tok.CharTokenizer(list("ab"))
    meta = writer.write_dataset(
        tmp_path, chars, {"train": (np.array([0, 1, 1]), 3, 1), "val": (np.array([1]), 1, 1)}, {"note": "x"}
    )
    assert meta["dtype"] == "uint16" and meta["splits"]["train"]["tokens"] == 3
    assert np.fromfile(tmp_path / "train.bin", dtype="<u2").tolist() == [0, 1, 1]
    line = driver.summary_line(meta, tmp_path, 0.0, 0)
    assert line == (
        f"wrote 3 files to {tmp_path} (uint16, vocab 2): train 3 tokens / 1 document / 1 file; "
        "val 1 token / 1 document / 1 file"
    )
    timed = driver.summary_line({**meta, "source": {"skipped_documents": 2}}, tmp_path, 2.0, 4_000_000)
    assert timed.endswith("; 2 documents skipped; 4.0 MB in 2.0 s (2.0 MB/s, 0.00M tokens/s)")


def test_summary_line_counts_the_files_left_out_by_reason(tmp_path: Path) -> None:
    chars = tok.CharTokenizer(list("ab"))
    skipped = {"binary": 13, "__pycache__": 2424, "version control": 0, "hidden": 1}
    meta = writer.write_dataset(
        tmp_path, chars, {"train": (np.array([0, 1]), 2, 1), "val": (np.array([1]), 1, 1)}, {"skipped_files": skipped}
    )
    assert driver.summary_line(meta, tmp_path, 0.0, 0).endswith(
        "val 1 token / 1 document / 1 file; 2,438 files left out (13 binary, 2,424 __pycache__, 1 hidden)"
    )
    nothing = {**meta, "source": {"skipped_files": dict.fromkeys(skipped, 0)}}
    assert "left out" not in driver.summary_line(nothing, tmp_path, 0.0, 0)
