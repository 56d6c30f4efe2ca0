"""Broken data directories, where runs write, and download failures end to end through the preparation scripts.

- Data: a data dir without meta.json or token files, malformed meta.json (bad JSON, wrong types, missing keys),
  token files that do not match meta.json: train.py refuses each with one line and creates nothing.
- Paths: a training run and a preparation run write only under out_dir (and the download cache given); the
  working directory, HOME and TMPDIR stay untouched.
- Downloads: prepare_data/shakespeare_char.py --source=http://127.0.0.1:PORT/... against a scripted http.server in
  a thread (127.0.0.1 only): a stall past the read timeout, a wrong checksum, a dropped connection (resumed with
  Range), a redirect, a refused connection. A 404 is covered by
  tests/test_prepare_shakespeare.py::test_download_from_url_once_into_cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import QuietHandler, ScriptedServer, make_char_data, sample_text, serving

import train
from gptkit.errors import run_cli

REPO = Path(__file__).resolve().parent.parent
TEXT = sample_text(20_000)
BODY = TEXT.encode("utf-8")
BODY_SHA256 = hashlib.sha256(BODY).hexdigest()


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child: one thread, and no variables that point scripts at other data or caches."""
    env = {k: v for k, v in os.environ.items() if k not in ("TINYSHAKESPEARE", "GPT_TOOLKIT_CACHE")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", **extra}


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones included) with its contents."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_one_line_error(code: int, stderr: str, fragment: str) -> None:
    assert code == 2 and "Traceback" not in stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and fragment in stderr, stderr


def tiny_args(data_dir: Path, out_dir: Path) -> list[str]:
    return [f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--device=cpu", "--compile=False", "--n_layer=1",
            "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2", "--gradient_accumulation_steps=1",
            "--max_iters=4", "--eval_interval=2", "--eval_iters=1", "--log_interval=2"]  # fmt: skip


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
# tests/test_tokenizer.py (test_malformed_meta_rejected, test_read_meta_*) and tests/test_data.py.
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
        run_cli(train.main, tiny_args(data_dir, out_dir))
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
        [sys.executable, str(REPO / "train.py"), *tiny_args(data_dir, tmp_path / "out")],
        cwd=sandbox["cwd"], env=sandbox_env(sandbox), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    changed = changed_paths(before, tree(tmp_path))
    assert changed and all(path.startswith("out/") for path in changed), changed
    assert sorted(changed) == ["out/best.pt", "out/ckpt.pt", "out/log.jsonl", "out/summary.json"]


def prepare(source: str, out_dir: Path, cache_dir: Path, *flags: str, **run: object) -> subprocess.CompletedProcess:
    """prepare_data/shakespeare_char.py on `source` with short download timeouts."""
    script = str(REPO / "prepare_data" / "shakespeare_char.py")
    locations = [f"--source={source}", f"--out_dir={out_dir}", f"--cache_dir={cache_dir}"]
    command = [sys.executable, script, *locations, "--read_timeout=0.5", "--retries=0", *flags]
    options = {"cwd": REPO, "env": clean_env(), "capture_output": True, "text": True, "timeout": 120, **run}
    return subprocess.run(command, **options)


def test_preparing_writes_only_under_out_dir_and_the_cache(
    server: ScriptedServer, sandbox: dict[str, Path], tmp_path: Path
) -> None:
    local = tmp_path / "input.txt"
    local.write_bytes(BODY)
    before = tree(tmp_path)
    sandboxed = {"cwd": sandbox["cwd"], "env": sandbox_env(sandbox)}
    from_file = prepare(str(local), tmp_path / "prep_file", tmp_path / "cache", "--sha256=None", **sandboxed)
    assert from_file.returncode == 0, from_file.stderr
    from_url = prepare(
        f"{server.base}/text.txt", tmp_path / "prep_url", tmp_path / "cache", "--sha256=None", **sandboxed
    )
    assert from_url.returncode == 0, from_url.stderr
    changed = changed_paths(before, tree(tmp_path))
    assert {path.split("/")[0] for path in changed} == {"prep_file", "prep_url", "cache"}, changed
    assert sorted(p for p in changed if not p.startswith("cache/")) == [
        "prep_file/meta.json", "prep_file/train.bin", "prep_file/val.bin",
        "prep_url/meta.json", "prep_url/train.bin", "prep_url/val.bin",
    ]  # fmt: skip
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


def test_stall_past_the_read_timeout_fails_then_the_next_run_resumes(server: ScriptedServer, tmp_path: Path) -> None:
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    url = f"{server.base}/stall.txt"
    stalled = prepare(url, out_dir, cache, f"--sha256={BODY_SHA256}")
    assert_one_line_error(stalled.returncode, stalled.stderr, "failed after 1 attempts: read timed out")
    assert not out_dir.exists()
    partial = [p for p in cache.rglob("*") if p.is_file()]
    assert len(partial) == 1 and partial[0].name.endswith("-stall.txt.part")  # only a partial file, named so
    assert partial[0].read_bytes() == BODY[:1000]

    resumed = prepare(url, out_dir, cache, f"--sha256={BODY_SHA256}")
    assert resumed.returncode == 0, resumed.stderr
    assert server.log == [("/stall.txt", None), ("/stall.txt", "bytes=1000-")]
    assert_prepared(out_dir)
    assert [p.name.endswith("-stall.txt") for p in cache.rglob("*") if p.is_file()] == [True]


def test_wrong_checksum_leaves_nothing(server: ScriptedServer, tmp_path: Path) -> None:
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    result = prepare(f"{server.base}/text.txt", out_dir, cache)  # expects tiny Shakespeare's sha256
    assert_one_line_error(result.returncode, result.stderr, "has sha256 ")
    assert "expected 86c4e6aa9db7c042..." in result.stderr and "pass --sha256=None" in result.stderr
    assert not out_dir.exists() and cached_files(cache) == []


def test_dropped_connection_is_resumed_with_range(server: ScriptedServer, tmp_path: Path) -> None:
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    result = prepare(f"{server.base}/drop.txt", out_dir, cache, f"--sha256={BODY_SHA256}", "--retries=1")
    assert result.returncode == 0, result.stderr
    assert server.log == [("/drop.txt", None), ("/drop.txt", f"bytes={len(BODY) // 2}-")]
    assert_prepared(out_dir)
    assert len(cached_files(cache)) == 1 and not cached_files(cache)[0].endswith(".part")


def test_redirect_is_followed(server: ScriptedServer, tmp_path: Path) -> None:
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    result = prepare(f"{server.base}/redirect.txt", out_dir, cache, f"--sha256={BODY_SHA256}")
    assert result.returncode == 0, result.stderr
    assert [path for path, _ in server.log] == ["/redirect.txt", "/text.txt"]
    assert_prepared(out_dir)


def test_refused_connection_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    result = prepare(f"http://127.0.0.1:{port}/text.txt", out_dir, cache)
    assert_one_line_error(result.returncode, result.stderr, "failed after 1 attempts: could not connect")
    assert not out_dir.exists() and cached_files(cache) == []


def test_impossible_download_settings(tmp_path: Path) -> None:
    result = prepare("http://127.0.0.1:9/x.txt", tmp_path / "out", tmp_path / "cache", "--read_timeout=0")
    assert_one_line_error(result.returncode, result.stderr, "--retries must be >= 0 and --read_timeout > 0")
    assert sorted(tmp_path.iterdir()) == []
