"""Broken data directories, where runs write, and download failures end to end through the preparation scripts.

- Data: a data dir without meta.json or token files, malformed meta.json (bad JSON, wrong types, missing keys),
  token files that do not match meta.json: train.py refuses each with one line and creates nothing.
- Paths: a training run and a preparation run write only under out_dir (and the download cache given); the
  working directory, HOME and TMPDIR stay untouched.
- Downloads: prepare_data/shakespeare_char.py --source=http://127.0.0.1:PORT/... against a scripted http.server in
  a thread (127.0.0.1 only): a stall past the read timeout, a wrong checksum, a dropped connection (resumed with
  Range), a redirect, a refused connection. A 404 is covered by
  tests/data/test_prepare_shakespeare.py::test_download_from_url_once_into_cache.
- Hostile inputs to prepare_data/corpus.py: JSONL text that is a number, null or an object; a FIFO, a device,
  a symbolic link loop or a dangling link named as input; an empty directory, one holding only binary files, a
  glob matching nothing; a gzip file cut mid-stream; a read failing with EIO: each one line, nothing written.
  Symbolic link loops and a FIFO inside a tree are left out and counted, never followed or opened.
  (SIGTERM mid-run: tests/data/test_prepare_corpus.py and tests/data/test_prepare_fineweb.py.)
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import train
from gptkit.core.errors import run_cli
from gptkit.data.prepare.items import is_val_document
from helpers import (
    REPO,
    QuietHandler,
    ScriptedServer,
    assert_one_line_error,
    clean_env,
    make_char_data,
    run_in_process,
    sample_text,
    serving,
    tiny_train_args,
)
from prepare_data import corpus, shakespeare_char

TEXT = sample_text(20_000)
BODY = TEXT.encode("utf-8")
BODY_SHA256 = hashlib.sha256(BODY).hexdigest()


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones included) with its contents."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class ScriptedHandler(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        with self.server.lock:
            self.server.log.append((self.path, self.headers.get("Range")))
            first = sum(1 for path, _ in self.server.log if path == self.path) == 1
        if self.path == "/text.txt" or (self.path in ("/drop.txt", "/stall.txt") and not first):
            self.send_body()
        elif self.path == "/drop.txt":  # half the body, then the connection closes
            self.send_head(200, {"Content-Length": str(len(BODY))})
            self.wfile.write(BODY[: len(BODY) // 2])
            self.wfile.flush()
            self.close_connection = True
        elif self.path == "/stall.txt":  # some of the body, then nothing until the test ends
            self.send_head(200, {"Content-Length": str(len(BODY))})
            self.wfile.write(BODY[:1000])
            self.wfile.flush()
            self.server.release.wait(30)
        elif self.path == "/redirect.txt":
            self.send_head(302, {"Location": "/text.txt", "Content-Length": "0"})
        else:
            self.send_head(404, {"Content-Length": "0"})

    def send_head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def send_body(self) -> None:
        wanted = self.headers.get("Range", "")
        start = int(wanted[len("bytes=") : -1]) if wanted.startswith("bytes=") and wanted.endswith("-") else 0
        if start:
            content_range = f"bytes {start}-{len(BODY) - 1}/{len(BODY)}"
            self.send_head(206, {"Content-Length": str(len(BODY) - start), "Content-Range": content_range})
        else:
            self.send_head(200, {"Content-Length": str(len(BODY))})
        self.wfile.write(BODY[start:])


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with serving(ScriptedHandler) as httpd:
        yield httpd


# ----------------------------------------------------------------------------- broken data directories


def edit_meta(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        meta = json.loads((directory / "meta.json").read_text())
        change(meta)
        (directory / "meta.json").write_text(json.dumps(meta))

    return apply


def write_meta_text(text: str | bytes) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        path = directory / "meta.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    return apply


def remove(*names: str) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        for name in names:
            (directory / name).unlink()

    return apply


def shorten_train_bin(directory: Path) -> None:
    path = directory / "train.bin"
    path.write_bytes(path.read_bytes()[:-200])  # 100 uint16 tokens fewer than meta.json says


def append_one_byte(directory: Path) -> None:
    with open(directory / "val.bin", "ab") as handle:
        handle.write(b"\x00")


def ids_beyond_vocabulary(directory: Path) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    np.full(meta["splits"]["train"]["tokens"], meta["vocab_size"], dtype=np.uint16).tofile(directory / "train.bin")


def drop(*keys: str) -> Callable[[dict], None]:
    def change(meta: dict) -> None:
        target = meta
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]

    return change


def set_value(value: object, *keys: str) -> Callable[[dict], None]:
    def change(meta: dict) -> None:
        target = meta
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return change


# (name, how the data dir is broken, what train.py says). Unit-level checks of the same conditions are in
# tests/data/test_tokenizer.py (test_malformed_meta_rejected, test_read_meta_*) and tests/data/test_loader.py.
BROKEN_DATA = [
    ("no_meta", remove("meta.json"), "no meta.json in {dir}: prepare the data first"),
    ("no_token_files", remove("train.bin", "val.bin"), "train.bin (split 'train') is missing; prepare the data"),
    ("bad_json", write_meta_text('{"format": "gpt-tokens",'), "meta.json is not valid JSON"),
    ("not_utf8", write_meta_text(b"\xff\xfe{}"), "meta.json is not valid JSON"),
    ("deeply_nested_json", write_meta_text('{"a": ' + "[" * 100_000), "meta.json is not valid JSON"),
    ("json_list", write_meta_text("[]"), "meta.json: expected a JSON object"),
    ("vocab_size_string", edit_meta(set_value("58", "vocab_size")), "'vocab_size' must be a positive integer"),
    ("dtype_number", edit_meta(set_value(16, "dtype")), "'dtype' must be one of uint16, uint32"),
    ("tokens_string", edit_meta(set_value("10", "splits", "train", "tokens")), "needs 'tokens', a non-negative"),
    ("chars_string", edit_meta(set_value("abc", "tokenizer", "chars")), "needs 'chars', a list of single char"),
    ("files_not_list", edit_meta(set_value("train.bin", "splits", "train", "files")), "needs 'files', a non-empty"),
    ("file_outside_dir", edit_meta(set_value(["../train.bin"], "splits", "train", "files")), "outside the data dir"),
    ("missing_splits", edit_meta(drop("splits")), "'splits' must be an object"),
    ("missing_tokenizer", edit_meta(drop("tokenizer")), "'tokenizer' must be an object with kind"),
    ("missing_val_split", edit_meta(drop("splits", "val")), "meta.json has no 'val' split (it has train)"),
    ("missing_version", edit_meta(drop("version")), "not a token-data description"),
    ("token_file_shorter", shorten_train_bin, "split 'train' files hold"),
    ("partial_token", append_one_byte, "bytes, not a whole number of uint16 tokens"),
    ("ids_beyond_vocab", ids_beyond_vocabulary, "the train split holds token id"),
]


@pytest.mark.parametrize(("name", "breakage", "message"), BROKEN_DATA, ids=[case[0] for case in BROKEN_DATA])
def test_broken_data_dir_is_one_line_and_nothing_is_written(
    name: str, breakage: Callable[[Path], None], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data_dir = tmp_path / "data"
    make_char_data(data_dir, text=TEXT)
    breakage(data_dir)
    before = tree(data_dir)
    out_dir = tmp_path / "out"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(train.main, tiny_train_args(data_dir, out_dir))
    stderr = capsys.readouterr().err
    assert_one_line_error(exit_info.value.code, stderr, message.format(dir=data_dir))
    assert tree(data_dir) == before  # the data is only read
    if name == "ids_beyond_vocab":  # found in the first batch read: the run had started its (empty) log
        assert tree(out_dir) == {"log.jsonl": b""}
    else:
        assert not out_dir.exists()


# ----------------------------------------------------------------------------- where runs write


@pytest.fixture
def sandbox(tmp_path: Path) -> dict[str, Path]:
    """Empty cwd, HOME and TMPDIR for a child, so anything written outside the given directories shows."""
    places = {name: tmp_path / name for name in ("cwd", "home", "tmp")}
    for path in places.values():
        path.mkdir()
    return places


def sandbox_env(places: dict[str, Path]) -> dict[str, str]:
    env = clean_env(HOME=str(places["home"]), TMPDIR=str(places["tmp"]))
    env.pop("XDG_CACHE_HOME", None)
    return env


def changed_paths(before: dict[str, bytes], after: dict[str, bytes]) -> set[str]:
    return {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}


def test_training_writes_only_under_out_dir(sandbox: dict[str, Path], tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    make_char_data(data_dir, text=TEXT)
    before = tree(tmp_path)
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *tiny_train_args(data_dir, tmp_path / "out")],
        cwd=sandbox["cwd"],
        env=sandbox_env(sandbox),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    changed = changed_paths(before, tree(tmp_path))
    assert changed and all(path.startswith("out/") for path in changed), changed
    assert sorted(changed) == ["out/best.pt", "out/ckpt.pt", "out/log.jsonl", "out/summary.json"]


def prepare_flags(source: str, out_dir: Path, cache_dir: Path, *flags: str) -> list[str]:
    """prepare_data/shakespeare_char.py's flags for `source`, with short download timeouts."""
    locations = [f"--source={source}", f"--out_dir={out_dir}", f"--cache_dir={cache_dir}"]
    return [*locations, "--read_timeout=0.5", "--retries=0", *flags]


def prepare(source: str, out_dir: Path, cache_dir: Path, *flags: str, **run: object) -> subprocess.CompletedProcess:
    """prepare_data/shakespeare_char.py on `source` as a process (the sandbox test's: where it writes)."""
    script = str(REPO / "prepare_data" / "shakespeare_char.py")
    command = [sys.executable, script, *prepare_flags(source, out_dir, cache_dir, *flags)]
    options = {"cwd": REPO, "env": clean_env(), "capture_output": True, "text": True, "timeout": 120, **run}
    return subprocess.run(command, **options)


@pytest.fixture
def prepare_here(capsys: pytest.CaptureFixture) -> Callable[..., subprocess.CompletedProcess]:
    """prepare_data/shakespeare_char.py's main in this process, as a finished process: the downloads below test
    what it does with the server's answers, not the process (the sandbox test above starts the script)."""
    return lambda *args, **kwargs: run_in_process(shakespeare_char.main, prepare_flags(*args, **kwargs), capsys)


def test_preparing_writes_only_under_out_dir_and_the_cache(
    server: ScriptedServer,
    sandbox: dict[str, Path],
    tmp_path: Path,
    prepare_here: Callable[..., subprocess.CompletedProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The download runs as a process in the sandbox; the local file's run calls main in this process, moved into
    the same sandbox (working directory, HOME, TMPDIR and tempfile's own choice of it)."""
    local = tmp_path / "input.txt"
    local.write_bytes(BODY)
    before = tree(tmp_path)
    sandboxed = {"cwd": sandbox["cwd"], "env": sandbox_env(sandbox)}
    monkeypatch.chdir(sandbox["cwd"])
    monkeypatch.setenv("HOME", str(sandbox["home"]))
    monkeypatch.setenv("TMPDIR", str(sandbox["tmp"]))
    for name in ("XDG_CACHE_HOME", "GPT_TOOLKIT_CACHE", "TINYSHAKESPEARE"):  # as sandbox_env leaves them out
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    from_file = prepare_here(str(local), tmp_path / "prep_file", tmp_path / "cache", "--sha256=None")
    assert from_file.returncode == 0, from_file.stderr
    assert tempfile.gettempdir() == str(sandbox["tmp"])
    from_url = prepare(
        f"{server.base}/text.txt", tmp_path / "prep_url", tmp_path / "cache", "--sha256=None", **sandboxed
    )
    assert from_url.returncode == 0, from_url.stderr
    changed = changed_paths(before, tree(tmp_path))
    assert {path.split("/")[0] for path in changed} == {"prep_file", "prep_url", "cache"}, changed
    assert sorted(p for p in changed if not p.startswith("cache/")) == [
        "prep_file/meta.json",
        "prep_file/train.bin",
        "prep_file/val.bin",
        "prep_url/meta.json",
        "prep_url/train.bin",
        "prep_url/val.bin",
    ]
    downloads = [p for p in changed if p.startswith("cache/")]
    assert len(downloads) == 1 and downloads[0].endswith("-text.txt")  # the URL's copy, nothing else
    assert (tmp_path / "prep_url" / "train.bin").read_bytes() == (tmp_path / "prep_file" / "train.bin").read_bytes()


# ----------------------------------------------------------------------------- downloads through the script


def cached_files(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.rglob("*") if p.is_file())


def assert_prepared(out_dir: Path) -> None:
    meta = json.loads((out_dir / "meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] == int(len(TEXT) * 0.9)
    assert meta["source"]["sha256"] == BODY_SHA256


def test_stall_past_the_read_timeout_fails_then_the_next_run_resumes(
    server: ScriptedServer, tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    url = f"{server.base}/stall.txt"
    stalled = prepare_here(url, out_dir, cache, f"--sha256={BODY_SHA256}")
    assert_one_line_error(stalled.returncode, stalled.stderr, "failed after 1 attempts: read timed out")
    assert not out_dir.exists()
    partial = [p for p in cache.rglob("*") if p.is_file()]
    assert len(partial) == 1 and partial[0].name.endswith("-stall.txt.part")  # only a partial file, named so
    assert partial[0].read_bytes() == BODY[:1000]

    resumed = prepare_here(url, out_dir, cache, f"--sha256={BODY_SHA256}")
    assert resumed.returncode == 0, resumed.stderr
    assert server.log == [("/stall.txt", None), ("/stall.txt", "bytes=1000-")]
    assert_prepared(out_dir)
    assert [p.name.endswith("-stall.txt") for p in cache.rglob("*") if p.is_file()] == [True]


def test_wrong_checksum_leaves_nothing(
    server: ScriptedServer, tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    result = prepare_here(f"{server.base}/text.txt", out_dir, cache)  # expects tiny Shakespeare's sha256
    assert_one_line_error(result.returncode, result.stderr, "has sha256 ")
    assert "expected 86c4e6aa9db7c042..." in result.stderr and "pass --sha256=None" in result.stderr
    assert not out_dir.exists() and cached_files(cache) == []


def test_dropped_connection_is_resumed_with_range(
    server: ScriptedServer, tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    result = prepare_here(f"{server.base}/drop.txt", out_dir, cache, f"--sha256={BODY_SHA256}", "--retries=1")
    assert result.returncode == 0, result.stderr
    assert server.log == [("/drop.txt", None), ("/drop.txt", f"bytes={len(BODY) // 2}-")]
    assert_prepared(out_dir)
    assert len(cached_files(cache)) == 1 and not cached_files(cache)[0].endswith(".part")


def test_redirect_is_followed(
    server: ScriptedServer, tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    result = prepare_here(f"{server.base}/redirect.txt", out_dir, cache, f"--sha256={BODY_SHA256}")
    assert result.returncode == 0, result.stderr
    assert [path for path, _ in server.log] == ["/redirect.txt", "/text.txt"]
    assert_prepared(out_dir)


def test_refused_connection_is_one_line(
    tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    result = prepare_here(f"http://127.0.0.1:{port}/text.txt", out_dir, cache)
    assert_one_line_error(result.returncode, result.stderr, "failed after 1 attempts: could not connect")
    assert not out_dir.exists() and cached_files(cache) == []


def test_impossible_download_settings(tmp_path: Path, prepare_here: Callable[..., subprocess.CompletedProcess]) -> None:
    result = prepare_here("http://127.0.0.1:9/x.txt", tmp_path / "out", tmp_path / "cache", "--read_timeout=0")
    assert_one_line_error(result.returncode, result.stderr, "--retries must be >= 0 and --read_timeout > 0")
    assert sorted(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- hostile inputs to prepare_data/corpus.py

WORDS = "".join(f"line {i} of a perfectly ordinary text file, with words\n" for i in range(400))


def text_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text(WORDS)
    (root / "b.txt").write_text(WORDS.upper())
    return root


def jsonl_with(value: str) -> Callable[[Path], list[str]]:
    def make(tmp_path: Path) -> list[str]:
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps({"text": WORDS}) + "\n" + '{"text": ' + value + "}\n")
        return [f"--input={path}"]

    return make


def fifo_named(tmp_path: Path) -> list[str]:
    os.mkfifo(tmp_path / "pipe")  # opening it would wait for a writer for ever
    return [f"--input={tmp_path / 'pipe'}"]


def symlink_loop_named(tmp_path: Path) -> list[str]:
    (tmp_path / "loop.txt").symlink_to(tmp_path / "loop.txt")
    return [f"--input={tmp_path / 'loop.txt'}"]


def dangling_symlink_named(tmp_path: Path) -> list[str]:
    (tmp_path / "gone.txt").symlink_to(tmp_path / "deleted.txt")
    return [f"--input={tmp_path / 'gone.txt'}"]


def empty_dir(tmp_path: Path) -> list[str]:
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    return [f"--input={tmp_path / 'empty'}"]


def only_binary_dir(tmp_path: Path) -> list[str]:
    root = tmp_path / "bin"
    (root / "__pycache__").mkdir(parents=True)
    (root / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\x00\x00\x00\x00")
    (root / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    return [f"--input={root}"]


def gzip_cut_mid_stream(tmp_path: Path) -> list[str]:
    whole = gzip.compress((WORDS * 20).encode())
    (tmp_path / "cut.txt.gz").write_bytes(whole[: len(whole) // 2])  # a download or copy cut off half way
    return [f"--input={text_dir(tmp_path / 'd')}", f"--input={tmp_path / 'cut.txt.gz'}"]


HOSTILE_INPUTS = [  # (name, make the input and return the flags naming it, what the one line says)
    ("jsonl_text_number", jsonl_with("42"), ["rows.jsonl:2: field 'text' is a number, not a string"]),
    ("jsonl_text_null", jsonl_with("null"), ["rows.jsonl:2: field 'text' is null, not a string"]),
    ("jsonl_text_nested", jsonl_with('{"en": "hi"}'), ["rows.jsonl:2: field 'text' is an object, not a string"]),
    ("fifo_named", fifo_named, ["pipe is a FIFO, not a regular file"]),
    ("device_named", lambda tmp_path: ["--input=/dev/zero"], ["/dev/zero is a device or special file"]),
    ("symlink_loop_named", symlink_loop_named, ["loop.txt cannot be read: Too many levels of symbolic links"]),
    ("dangling_symlink_named", dangling_symlink_named, ["gone.txt is a symbolic link to ", "which does not exist"]),
    ("empty_dir", empty_dir, ["no input files found in"]),
    ("only_binary_dir", only_binary_dir, ["no input files found in", "(files left out: 1 binary, 1 __pycache__)"]),
    ("glob_matches_nothing", lambda tmp_path: [f"--input={text_dir(tmp_path / 'd')}/*.md"], ["matches no files"]),
    ("gzip_cut_mid_stream", gzip_cut_mid_stream, ["cut.txt.gz is not a valid gzip file"]),
    # A read that fails part way (a failing disk, a network file system): /proc/self/mem gives EIO, even to root.
    ("read_error", lambda tmp_path: ["--input=/proc/self/mem"], ["cannot read /proc/self/mem: Input/output error"]),
]


class StillRunning(BaseException):
    """Raised into a run that outlived its time limit (a BaseException, so that no `except Exception` swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block with StillRunning after `seconds`: a run that waits on a FIFO, reads a device or walks a
    symbolic link loop for ever fails the test instead of hanging it (SIGALRM interrupts a blocking open too)."""

    def expire(signum: int, frame: object) -> None:
        raise StillRunning(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.gpt2_bpe
@pytest.mark.parametrize(("name", "make", "fragments"), HOSTILE_INPUTS, ids=[case[0] for case in HOSTILE_INPUTS])
def test_hostile_input_is_one_line_and_nothing_is_written(
    tmp_path: Path, name: str, make: Callable[[Path], list[str]], fragments: list[str], capsys: pytest.CaptureFixture
) -> None:
    if name in ("read_error", "device_named") and not Path("/proc/self/mem").exists():
        pytest.skip("needs Linux's /proc and /dev")
    out = tmp_path / "out"
    args = [*make(tmp_path), f"--out_dir={out}", "--block_size=8"]
    with time_limit(30):  # a FIFO or a device opened by mistake would wait or read for ever
        result = run_in_process(corpus.main, args, capsys)
    assert_one_line_error(result.returncode, result.stderr, *fragments)
    assert not out.exists()


@pytest.mark.gpt2_bpe
def test_symlink_loops_and_a_fifo_in_a_tree_are_left_out_not_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = text_dir(tmp_path / "tree")
    (root / "again").symlink_to(root)  # two folder loops: glob.glob's ** would walk 2^40 paths
    (root / "more").symlink_to(".")
    (root / "self.txt").symlink_to(root / "self.txt")  # a file loop
    os.mkfifo(root / "pipe.txt")  # a reader would wait for a writer for ever
    seed = next(s for s in range(100) if is_val_document(s, 0.5, 0, 0) != is_val_document(s, 0.5, 1, 0))
    for index, pattern in enumerate([str(root), f"{root}/**", f"{root}/**/*.txt"]):
        out = tmp_path / f"out{index}"
        flags = [f"--out_dir={out}", "--block_size=8", "--val_fraction=0.5", f"--seed={seed}"]
        with time_limit(30):
            result = run_in_process(corpus.main, [f"--input={pattern}", *flags], capsys)
        assert result.returncode == 0, result.stderr
        source = json.loads((out / "meta.json").read_text())["source"]
        assert source["files"] == 2 and source["skipped_files"]["not a regular file"] == 2, pattern
        assert "; 2 files left out (2 not a regular file);" in result.stdout
