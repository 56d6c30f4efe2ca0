"""Training a byte-level BPE (gptkit.data.prepare.tokenizer_training, prepare_data/train_tokenizer.py) on Python's own
standard library sources, and using it through tiktoken: agreement with the trainer on held-out text, round trips,
compression against GPT-2, the whole path to sampling from a checkpoint alone, and damaged tokenizer directories."""

from __future__ import annotations

import errno
import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import tiktoken
import tiktoken.load

import sample
import train
from gptkit.core.errors import UserError
from gptkit.core.fileio import sha256_file
from gptkit.data import bpe
from gptkit.data import tokenizer as tok
from gptkit.data.meta import read_meta
from gptkit.data.prepare import discover
from gptkit.data.prepare.settings import PrepareSettings
from gptkit.data.prepare.tokenizer_training import TrainingJob, train_bpe
from helpers import (
    REPO,
    SHAKESPEARE,
    alive,
    assert_one_line_message,
    assert_script_error,
    clean_env,
    cli_args,
    run_in_process,
    stdlib_sources,
    tiny_train_args,
)
from hf_tokenizer_dirs import write_byte_level
from prepare_data import corpus, train_tokenizer

TRAIN_TOKENIZER = "prepare_data/train_tokenizer.py"
VOCAB_SIZE = 1000


def adversarial_texts() -> list[str]:
    """Strings a tokenizer gets wrong first: long runs, mixed scripts, emoji sequences, control characters,
    the special token as plain text, and random code points (no lone surrogates: they are not UTF-8 text)."""
    texts = [
        "",
        "a" * 50_000,
        " " * 20_000,
        "\n" * 20_000,
        "\t \r\n" * 5_000,
        "x" + " " * 1000 + "y\n" + "    " * 300 + "return",
        "Grüße, Привет мир, 你好世界, こんにちは, 안녕하세요, مرحبا بالعالم, שלום, नमस्ते, Ελληνικά, ภาษาไทย",
        "👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇫🇷🇯🇵 🧑🏿‍🚀 ❤️‍🔥 " * 40,
        "".join(chr(c) for c in range(32)) + "\x7f\x85\u2028\u2029\u00a0\u3000\u200b\u200d\ufeff\ufffd",
        "<|endoftext|>",
        "before<|endoftext|>after <|endoftext|><|endoftext|>",
        "ſ 'S 'LL 'Ve I'M it's ＡＢＣ１２３ ٣٤٥ ⅫⅣ 12345678901234567890",
        "e\u0301\u0302\u0303" * 500,
        "".join(chr(c) for c in range(0x80, 0x3000)),
        "".join(chr(c) for c in range(0x1F300, 0x1FA00)),
        "\U0010ffff\U000e0001\U0001d11e" * 100,
    ]
    rng = random.Random(0)
    code_points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for _ in range(100):
        texts.append("".join(chr(rng.choice(code_points)) for _ in range(rng.randint(1, 300))))
        texts.append("".join(rng.choice(" \n\t\r'aZ9_.ſé😀\u200d") for _ in range(rng.randint(1, 300))))
    return texts


@pytest.fixture(scope="module")
def held_out() -> list[str]:
    """Standard library modules the tokenizer is not trained on, and Python's own documentation topics."""
    texts = [path.read_text(encoding="utf-8") for path in stdlib_sources(offset=1, max_bytes=300_000)]
    topics = Path(os.__file__).parent / "pydoc_data" / "topics.py"  # non-ASCII prose (typographic quotes, ...)
    return [*texts, topics.read_text(encoding="utf-8")] if topics.is_file() else texts


@pytest.fixture(scope="module")
def trained() -> tuple:
    """(result, Hugging Face trainer, BpeTokenizer) of a 1,000-token BPE on ~470 KB of stdlib sources."""
    found = discover.find_inputs([str(path) for path in stdlib_sources(max_bytes=400_000)])
    job = TrainingJob(files=found.files, read=PrepareSettings(chunk_bytes=1 << 16), vocab_size=VOCAB_SIZE)
    result, hf = train_bpe(job)
    record = bpe.make_record(
        "stdlib", job.pattern, {tok.END_OF_TEXT: len(result.ranks)}, bpe.ranks_to_text(result.ranks)
    )
    return result, hf, tok.BpeTokenizer(record)


def test_tiktoken_encodes_held_out_text_token_for_token_as_the_trainer(trained: tuple, held_out: list[str]) -> None:
    result, hf, tokenizer = trained
    assert tokenizer.vocab_size == VOCAB_SIZE and tokenizer.eot_token == VOCAB_SIZE - 1
    assert len(result.ranks) == VOCAB_SIZE - 1 and result.chars > 300_000
    # The trainer's own check, on the val documents it left out of training.
    assert result.check_source == "held-out" and result.check_chars > 0 and result.check_mismatches == 0
    tokens = 0
    for text in held_out:
        ids = tokenizer.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        tokens += len(ids)
    assert tokens < sum(len(text.encode("utf-8")) for text in held_out) / 2  # merges are used, not bytes one by one


def test_any_text_round_trips(trained: tuple, held_out: list[str]) -> None:
    _, hf, tokenizer = trained
    for text in [*held_out, *adversarial_texts(), SHAKESPEARE.read_text(encoding="utf-8")[:100_000]]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode_array(text).tolist() == ids
        assert tokenizer.eot_token not in ids  # '<|endoftext|>' in a text is text, as in tiktoken's encode_ordinary
        assert ids == hf.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode("") == []
    assert tokenizer.decode([tokenizer.eot_token]) == tok.END_OF_TEXT


@pytest.mark.gpt2_bpe
def test_trained_on_python_compresses_held_out_python_better_than_gpt2(trained: tuple, held_out: list[str]) -> None:
    _, _, tokenizer = trained
    gpt2 = tok.TiktokenTokenizer("gpt2")
    python = held_out[:-1] if len(held_out) > 1 else held_out
    text_bytes = sum(len(text.encode("utf-8")) for text in python)
    ours = text_bytes / sum(len(tokenizer.encode(text)) for text in python)
    theirs = text_bytes / sum(len(gpt2.encode(text)) for text in python)
    # 1,000 tokens learnt from 470 KB of Python against GPT-2's 50,257 learnt from web text (measured: 2.4 vs 2.2).
    assert ours > theirs * 1.05, (ours, theirs)


def test_the_ranks_file_is_tiktokens_own_format(trained: tuple, tmp_path: Path) -> None:
    result, _, tokenizer = trained
    meta = bpe.write_tokenizer_dir(tmp_path, result.ranks, bpe.GPT4_PATTERN, {tok.END_OF_TEXT: 999}, "x", {})
    assert tiktoken.load.load_tiktoken_bpe(str(tmp_path / bpe.RANKS_FILENAME)) == result.ranks
    assert meta["ranks_sha256"] == sha256_file(tmp_path / bpe.RANKS_FILENAME)
    loaded = tok.make_tokenizer(str(tmp_path))
    assert isinstance(loaded, tok.BpeTokenizer) and loaded.to_meta() == tokenizer.to_meta() | {"name": "x"}


@pytest.mark.parametrize("failing", [1, 2], ids=["tokenizer.json", "ranks"])
def test_a_write_that_fails_leaves_the_earlier_tokenizer_whole(
    trained: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    """--overwrite=True on a full disk, found when either new file is synced: neither replaces the old ones."""
    result = trained[0]
    bpe.write_tokenizer_dir(tmp_path, result.ranks, bpe.GPT4_PATTERN, {tok.END_OF_TEXT: 999}, "x", {})
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    calls = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    smaller = dict(list(result.ranks.items())[:300])
    with pytest.raises(OSError, match="No space left"):
        bpe.write_tokenizer_dir(tmp_path, smaller, bpe.GPT4_PATTERN, {tok.END_OF_TEXT: 300}, "y", {})
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
    assert tok.make_tokenizer(str(tmp_path)).vocab_size == 1000


def test_training_is_deterministic_and_honours_max_chars(trained: tuple) -> None:
    found = discover.find_inputs([str(path) for path in stdlib_sources(max_bytes=400_000)])
    job = TrainingJob(files=found.files, read=PrepareSettings(chunk_bytes=1 << 16), vocab_size=VOCAB_SIZE)
    assert train_bpe(job)[0].ranks == trained[0].ranks
    sample, _ = train_bpe(
        TrainingJob(files=found.files, read=PrepareSettings(chunk_bytes=4096), vocab_size=300, max_chars=20_000)
    )
    assert sample.chars == 20_000 and len(sample.ranks) == 299


def test_jsonl_gz_inputs_train_on_their_text_field(tmp_path: Path) -> None:
    path = tmp_path / "code.jsonl.gz"
    lines = [json.dumps({"content": p.read_text(encoding="utf-8"), "id": i}) for i, p in enumerate(stdlib_sources())]
    path.write_bytes(gzip.compress("\n".join(lines[:40]).encode()))
    found = discover.find_inputs([str(path)])
    result, _ = train_bpe(
        TrainingJob(files=found.files, read=PrepareSettings(text_field="content", val_fraction=0.2), vocab_size=400)
    )
    assert len(result.ranks) == 399 and result.val_chars_left_out > 0 and result.check_mismatches == 0
    assert any(b"def" in token for token in result.ranks)
    with pytest.raises(UserError, match="no string field 'text'"):
        train_bpe(TrainingJob(files=found.files, read=PrepareSettings(), vocab_size=400))


# ----------------------------------------------------------------------------- the script, end to end


@pytest.fixture(scope="module")
def corpus_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stdlib sources in a folder with what corpus.py leaves out: a binary file and a __pycache__ folder."""
    root = tmp_path_factory.mktemp("tree")
    for path in stdlib_sources(max_bytes=200_000):
        shutil.copyfile(path, root / path.name)
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "skipped.py").write_text("never_seen_identifier_xyz = 1\n" * 100)
    return root


@pytest.mark.heavy
def test_train_prepare_train_and_sample_from_the_checkpoint_alone(corpus_tree: Path, tmp_path: Path, capsys) -> None:
    """Each step calls its script's main in this process (each script's own tests start it as a process: here the
    signal tests below)."""
    tok_dir, data_dir, out_dir = tmp_path / "tok", tmp_path / "data", tmp_path / "out"
    trained = run_in_process(train_tokenizer.main, cli_args(input=corpus_tree, vocab_size=600, out_dir=tok_dir), capsys)
    assert trained.returncode == 0, trained.stderr
    assert "vocab 600" in trained.stdout and "2 files left out (1 binary, 1 __pycache__)" in trained.stdout
    assert "exactly as the trainer" in trained.stdout
    meta = json.loads((tok_dir / bpe.META_FILENAME).read_text())
    assert meta["training"]["skipped_files"]["binary"] == 1 and meta["special_tokens"] == {tok.END_OF_TEXT: 599}
    assert b"never_seen_identifier_xyz" not in tiktoken.load.load_tiktoken_bpe(str(tok_dir / bpe.RANKS_FILENAME))

    again = run_in_process(train_tokenizer.main, cli_args(input=corpus_tree, vocab_size=600, out_dir=tok_dir), capsys)
    assert_script_error(again, "already holds a tokenizer", "--overwrite=True")

    prepared = run_in_process(
        corpus.main, cli_args(input=corpus_tree, tokenizer=tok_dir, out_dir=data_dir, block_size=16), capsys
    )
    assert prepared.returncode == 0, prepared.stderr
    data_meta = read_meta(data_dir, check_files=True)
    assert data_meta["vocab_size"] == 600 and data_meta["eot_token"] == 599 and data_meta["tokenizer"]["kind"] == "bpe"
    assert data_meta["tokenizer"]["ranks_sha256"] == meta["ranks_sha256"]

    training = run_in_process(train.main, tiny_train_args(data_dir, out_dir), capsys)
    assert training.returncode == 0, training.stderr
    shutil.rmtree(data_dir)
    shutil.rmtree(tok_dir)
    sampled = run_in_process(
        sample.main, cli_args(out_dir=out_dir, device="cpu", max_new_tokens=20, start="def "), capsys
    )
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("def ")


@pytest.mark.parametrize(
    "signum, group, code, line",
    [(signal.SIGTERM, False, 143, "terminated by SIGTERM"), (signal.SIGINT, True, 130, "interrupted")],
)
def test_a_signal_stops_the_training_at_once(tmp_path: Path, signum: int, group: bool, code: int, line: str) -> None:
    """The Rust trainer cannot be interrupted; its child process is killed, and nothing is written."""
    big = tmp_path / "big.txt"
    big.write_text(SHAKESPEARE.read_text(encoding="utf-8") * 110)  # ~22 MB: seconds of training at the least
    command = [sys.executable, str(REPO / TRAIN_TOKENIZER), *cli_args(input=big, out_dir=tmp_path / "tok")]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (children := psutil.Process(process.pid).children()):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # inside the trainer
        started = time.monotonic()
        if group:  # as a terminal's Ctrl-C: the whole process group, the training process included
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert (process.returncode, stderr, stdout) == (code, line + "\n", "")
    assert time.monotonic() - started < 5
    assert alive([child.pid for child in children]) == []
    assert not (tmp_path / "tok").exists()


# ----------------------------------------------------------------------------- damaged or foreign directories


def _truncate_ranks(directory: Path) -> None:
    path = directory / bpe.RANKS_FILENAME
    path.write_bytes(path.read_bytes()[:1000])


def _change_hash(directory: Path) -> None:
    path = directory / bpe.META_FILENAME
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "ranks_sha256": "0" * 64}))


def _hugging_face_file(directory: Path) -> None:
    (directory / bpe.META_FILENAME).write_text(
        json.dumps({"version": "1.0", "model": {"type": "BPE"}, "pre_tokenizer": None, "added_tokens": []})
    )


DAMAGES = {
    "truncated ranks": (_truncate_ranks, "truncated, damaged or from another tokenizer"),
    "hash mismatch": (_change_hash, "truncated, damaged or from another tokenizer"),
    "no metadata": (lambda d: (d / bpe.META_FILENAME).unlink(), "has no tokenizer.json"),
    "no ranks": (lambda d: (d / bpe.RANKS_FILENAME).unlink(), "tokenizer.tiktoken is missing"),
    "foreign JSON": (lambda d: (d / bpe.META_FILENAME).write_text('{"format": "other"}'), "not a BPE tokenizer"),
    "Hugging Face file": (_hugging_face_file, "a Hugging Face tokenizers file"),
    "not JSON": (lambda d: (d / bpe.META_FILENAME).write_text("{"), "not valid JSON"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_or_foreign_tokenizer_dir_is_one_clear_error(damage: str, trained: tuple, tmp_path: Path) -> None:
    result = trained[0]
    bpe.write_tokenizer_dir(tmp_path, result.ranks, bpe.GPT4_PATTERN, {tok.END_OF_TEXT: 999}, "x", {})
    change, fragment = DAMAGES[damage]
    change(tmp_path)
    with pytest.raises(UserError) as info:
        tok.make_tokenizer(str(tmp_path))
    assert_one_line_message(info.value, fragment, "train_tokenizer.py")


def test_corpus_py_reports_a_damaged_tokenizer_dir_in_one_line(
    trained: tuple, corpus_tree: Path, tmp_path: Path, capsys
) -> None:
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    bpe.write_tokenizer_dir(tok_dir, trained[0].ranks, bpe.GPT4_PATTERN, {tok.END_OF_TEXT: 999}, "x", {})
    _truncate_ranks(tok_dir)
    args = cli_args(input=corpus_tree, tokenizer=tok_dir, out_dir=tmp_path / "data")
    result = run_in_process(corpus.main, args, capsys)  # corpus.py's own tests run it as a process
    assert_script_error(result, str(tok_dir / bpe.RANKS_FILENAME), "train it again")
    assert not (tmp_path / "data").exists()


def test_bad_settings_and_foreign_out_dirs_are_refused(tmp_path: Path, corpus_tree: Path, capsys) -> None:
    """train_tokenizer.py's main in this process (the pipeline test above runs the script as a process)."""
    (tmp_path / "notes.txt").write_text("mine")
    model = write_byte_level(tmp_path / "model")  # a Hugging Face model's directory: tokenizer.json and its config
    files = {path.name: path.read_bytes() for path in model.iterdir()}
    cases = [
        (cli_args(input=corpus_tree, vocab_size=100, out_dir=tmp_path / "t"), "at least 257"),
        (cli_args(input=corpus_tree, vocab_size=2**32, out_dir=tmp_path / "t"), "at most 16,777,216"),
        (cli_args(out_dir=tmp_path / "t"), "no input given"),
        (cli_args(input=corpus_tree, out_dir=tmp_path), "holds files and no tokenizer"),
        (cli_args(input=tmp_path / "missing", out_dir=tmp_path / "t"), "does not exist"),
        (cli_args(input=corpus_tree, out_dir=model, overwrite=True), "holds a Hugging Face model's tokenizer.json"),
    ]
    for args, fragment in cases:
        assert_script_error(run_in_process(train_tokenizer.main, args, capsys), fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes.txt"]
    assert {path.name: path.read_bytes() for path in model.iterdir()} == files
