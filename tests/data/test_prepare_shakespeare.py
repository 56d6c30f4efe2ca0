"""End-to-end tests of prepare_data/shakespeare_char.py and shakespeare.py (exact token counts). Each script runs once
as a process as a user runs it (shakespeare.py's offline: a process whose tiktoken has loaded nothing yet); the other
runs call the script's main in this process, where the process is not what they test."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from gptkit.data import tokenizer as tok
from gptkit.data.meta import read_meta
from helpers import (
    SHAKESPEARE,
    assert_script_error,
    canonical_shakespeare,
    clean_env,
    copy_gpt2_bpe_files,
    run_in_process,
    run_script,
    script_main,
    serving_directory,
)


def prepare(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """prepare_data/`script` run as a user would, with `env` added to a clean environment."""
    return run_script(f"prepare_data/{script}", *args, env=clean_env(**(env or {})))


@pytest.fixture
def prepare_here(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., subprocess.CompletedProcess]:
    """prepare_data/`script`'s main in this process, as a finished process, with `env` set as `prepare` sets it."""

    def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        for name in ("TINYSHAKESPEARE", "GPT_TOOLKIT_CACHE"):  # as clean_env leaves them out
            monkeypatch.delenv(name, raising=False)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        return run_in_process(script_main(f"prepare_data/{script}"), list(args), capsys)

    return run


@pytest.fixture
def file_server() -> Iterator[tuple[str, list[str]]]:
    """Serve the tests' corpus folder on 127.0.0.1; yields (base URL, list of requested paths)."""
    with serving_directory(SHAKESPEARE.parent) as served:
        yield served


def test_char_level_counts_vocab_and_meta(tmp_path: Path) -> None:
    corpus = canonical_shakespeare()
    out = tmp_path / "sc"
    result = prepare("shakespeare_char.py", f"--out_dir={out}", env={"TINYSHAKESPEARE": str(corpus)})
    assert result.returncode == 0, result.stderr
    assert "train 1,003,854 tokens" in result.stdout and "val 111,540 tokens" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    meta = read_meta(out, check_files=True)
    text = corpus.read_text(encoding="utf-8")
    chars = sorted(set(text))
    assert len(chars) == 65 and meta["vocab_size"] == 65
    assert meta["tokenizer"] == {"kind": "char", "chars": chars, "eot": False}
    assert (meta["dtype"], meta["eot_token"]) == ("uint16", None)
    assert meta["splits"]["train"] == {"files": ["train.bin"], "tokens": 1003854, "text_bytes": 1003854, "documents": 1}
    assert meta["splits"]["val"] == {"files": ["val.bin"], "tokens": 111540, "text_bytes": 111540, "documents": 1}
    assert meta["source"]["sha256"] == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    assert meta["source"]["source"] == str(corpus)
    # Raw little-endian uint16, id = rank of the character.
    train = np.fromfile(out / "train.bin", dtype="<u2")
    val = np.fromfile(out / "val.bin", dtype="<u2")
    ranks = {c: i for i, c in enumerate(chars)}
    assert train[:20].tolist() == [ranks[c] for c in text[:20]]
    assert "".join(chars[i] for i in val[-20:]) == text[-20:]
    assert "".join(chars[i] for i in np.concatenate([train, val])) == text


@pytest.mark.gpt2_bpe
def test_gpt2_counts_with_source_flag(tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]) -> None:
    corpus = canonical_shakespeare()
    out = tmp_path / "s"
    result = prepare_here("shakespeare.py", f"--source={corpus}", f"--out_dir={out}")
    assert result.returncode == 0, result.stderr
    meta = read_meta(out, check_files=True)
    assert meta["tokenizer"] == {"kind": "tiktoken", "encoding": "gpt2"}
    assert (meta["vocab_size"], meta["dtype"], meta["eot_token"]) == (50257, "uint16", 50256)
    assert meta["splits"]["train"]["tokens"] == 301966 and meta["splits"]["val"]["tokens"] == 36059
    text = corpus.read_text(encoding="utf-8")
    enc = tok.TiktokenTokenizer("gpt2")
    assert np.fromfile(out / "val.bin", dtype="<u2").tolist() == enc.encode(text[int(len(text) * 0.9) :])


@pytest.mark.gpt2_bpe
def test_gpt2_from_bpe_dir_without_tiktoken_cache(
    tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    corpus = canonical_shakespeare()
    bpe = copy_gpt2_bpe_files(tmp_path / "bpe")
    offline = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"), "TINYSHAKESPEARE": str(corpus)}
    result = prepare("shakespeare.py", f"--out_dir={tmp_path / 'o'}", f"--bpe_dir={bpe}", env=offline)
    assert result.returncode == 0, result.stderr
    assert "train 301,966 tokens" in result.stdout and "val 36,059 tokens" in result.stdout
    vocab = bytearray((bpe / "vocab.bpe").read_bytes())
    vocab[-2] ^= 1
    (bpe / "vocab.bpe").write_bytes(bytes(vocab))
    corrupted = prepare_here("shakespeare.py", f"--out_dir={tmp_path / 'o2'}", f"--bpe_dir={bpe}", env=offline)
    assert_script_error(corrupted, "vocab.bpe has sha256")
    assert not (tmp_path / "o2").exists()


def test_download_from_url_once_into_cache(
    tmp_path: Path, file_server: tuple[str, list[str]], prepare_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    base, requested = file_server
    env = {"TINYSHAKESPEARE": f"{base}/{SHAKESPEARE.name}", "GPT_TOOLKIT_CACHE": str(tmp_path / "cache")}
    first = prepare_here("shakespeare_char.py", "--sha256=None", f"--out_dir={tmp_path / 'a'}", env=env)
    second = prepare_here("shakespeare_char.py", "--sha256=None", f"--out_dir={tmp_path / 'b'}", env=env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert requested == [f"/{SHAKESPEARE.name}"]  # the second run used the cache
    assert (tmp_path / "a" / "train.bin").read_bytes() == (tmp_path / "b" / "train.bin").read_bytes()
    assert len(list((tmp_path / "cache" / "downloads").iterdir())) == 1
    missing = prepare_here("shakespeare_char.py", f"--source={base}/nope.txt", f"--out_dir={tmp_path / 'c'}", env=env)
    assert_script_error(missing, "HTTP 404")
    assert not (tmp_path / "c").exists()


def test_other_text_needs_sha256_none(tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]) -> None:
    other = tmp_path / "other.txt"
    other.write_text("To be, or not to be, that is the question.\n" * 40)
    rejected = prepare_here("shakespeare_char.py", f"--source={other}", f"--out_dir={tmp_path / 'o'}")
    assert_script_error(rejected, "pass --sha256=None")
    accepted = prepare_here("shakespeare_char.py", f"--source={other}", "--sha256=None", f"--out_dir={tmp_path / 'o'}")
    assert accepted.returncode == 0, accepted.stderr
    meta = read_meta(tmp_path / "o")
    assert meta["splits"]["train"]["tokens"] == int(len(other.read_text()) * 0.9)
    missing = prepare_here("shakespeare_char.py", f"--source={tmp_path / 'missing.txt'}", f"--out_dir={tmp_path / 'x'}")
    assert_script_error(missing, "does not exist")


@pytest.mark.gpt2_bpe
def test_earlier_data_is_replaced_only_by_the_same_preparation_or_with_overwrite(
    tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    """Running a Shakespeare script again over its own data writes the same files (make demo does so every time);
    another preparation's data needs --overwrite=True, and a training run's directory or one of other files is
    refused before anything is read."""
    corpus, other = canonical_shakespeare(), tmp_path / "other.txt"
    other.write_text("To be, or not to be, that is the question.\n" * 40)
    out = tmp_path / "sc"
    assert prepare_here("shakespeare_char.py", f"--source={corpus}", f"--out_dir={out}").returncode == 0
    first = (out / "train.bin").read_bytes()
    again = prepare_here("shakespeare_char.py", f"--source={corpus}", f"--out_dir={out}")
    assert again.returncode == 0, again.stderr
    assert (out / "train.bin").read_bytes() == first
    for args in ([f"--source={other}", "--sha256=None"], []):  # another text, another tokenizer
        script = "shakespeare_char.py" if args else "shakespeare.py"
        refused = prepare_here(script, f"--source={corpus}", *args, f"--out_dir={out}")
        assert_script_error(refused, "already holds prepared data (meta.json); pass --overwrite=True")
        assert (out / "train.bin").read_bytes() == first
    replaced = prepare_here("shakespeare.py", f"--source={corpus}", f"--out_dir={out}", "--overwrite=True")
    assert replaced.returncode == 0 and read_meta(out)["tokenizer"] == {"kind": "tiktoken", "encoding": "gpt2"}
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(b"weights")
    refused = prepare_here("shakespeare_char.py", "--source=https://127.0.0.1:9/none.txt", f"--out_dir={run}")
    assert_script_error(refused, f"--out_dir={run} is a training run's directory")
    assert sorted(path.name for path in run.iterdir()) == ["ckpt.pt"]
