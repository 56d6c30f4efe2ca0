"""Tests for gptkit/core/download.py against a real HTTP server on 127.0.0.1 (started in a thread).

The server's paths script one behaviour each: a plain file with Range support, a connection dropped mid-body,
404, a stall past the client's read timeout, a redirect, a transient 500. Every request is logged so tests
can assert which requests (and Range headers) the client sent.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gptkit.core import download as dl
from gptkit.core.errors import UserError
from gptkit.core.fileio import sha256_file
from helpers import QuietHandler, ScriptedServer, serving

BODY = bytes(range(256)) * 400  # 100 KiB, every byte value
BODY_SHA256 = hashlib.sha256(BODY).hexdigest()
FAST = dl.DownloadPolicy(connect_timeout=2.0, read_timeout=0.3, retries=2, backoff=0.01)


class ScriptedHandler(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        path = self.path
        with self.server.lock:
            self.server.log.append((path, self.headers.get("Range")))
            hit = self.server.hits[path] = self.server.hits.get(path, 0) + 1
        if path == "/file.bin":
            self.send_file(ranges=True)
        elif path == "/norange.bin":
            self.send_file(ranges=False)
        elif path == "/drop.bin" and hit == 1:
            self.send_headers(200, len(BODY))
            self.wfile.write(BODY[: len(BODY) // 3])
            self.wfile.flush()
            self.close_connection = True  # the rest of the body never comes
        elif path == "/drop.bin":
            self.send_file(ranges=True)
        elif path == "/drop-norange.bin" and hit == 1:
            self.send_headers(200, len(BODY))
            self.wfile.write(BODY[:1000])
            self.close_connection = True
        elif path == "/drop-norange.bin":
            self.send_file(ranges=False)
        elif path == "/stall-headers.bin":
            self.server.release.wait(10)
        elif path == "/stall-body.bin":
            self.send_headers(200, len(BODY))
            self.wfile.write(BODY[:100])
            self.wfile.flush()
            self.server.release.wait(10)
        elif path == "/redirect.bin":
            self.send_response(302)
            self.send_header("Location", "/file.bin")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/flaky.bin" and hit == 1:
            self.send_headers(500, 0)
        elif path == "/flaky.bin":
            self.send_file(ranges=True)
        else:
            self.send_headers(404, 0)

    def send_headers(self, status: int, length: int, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()

    def send_file(self, ranges: bool) -> None:
        wanted = self.headers.get("Range")
        if ranges and wanted and wanted.startswith("bytes=") and wanted.endswith("-"):
            start = int(wanted[len("bytes=") : -1])
            if start >= len(BODY):
                self.send_headers(416, 0, {"Content-Range": f"bytes */{len(BODY)}"})
                return
            self.send_headers(206, len(BODY) - start, {"Content-Range": f"bytes {start}-{len(BODY) - 1}/{len(BODY)}"})
            self.wfile.write(BODY[start:])
        else:
            self.send_headers(200, len(BODY))
            self.wfile.write(BODY)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with serving(ScriptedHandler) as httpd:
        yield httpd


def assert_nothing_left(destination: Path) -> None:
    assert not destination.exists()
    assert not destination.with_name(destination.name + dl.PART_SUFFIX).exists()


def test_success_verifies_and_leaves_no_part_file(server: ScriptedServer, tmp_path: Path) -> None:
    destination = tmp_path / "sub" / "file.bin"
    result = dl.download(f"{server.base}/file.bin", destination, sha256=BODY_SHA256, policy=FAST)
    assert result == destination and destination.read_bytes() == BODY
    assert [p.name for p in destination.parent.iterdir()] == ["file.bin"]
    assert server.log == [("/file.bin", None)]


def test_fetch_uses_the_cache_on_second_call(server: ScriptedServer, tmp_path: Path) -> None:
    first = dl.fetch(f"{server.base}/file.bin", cache_dir=tmp_path, sha256=BODY_SHA256, policy=FAST)
    second = dl.fetch(f"{server.base}/file.bin", cache_dir=tmp_path, sha256=BODY_SHA256, policy=FAST)
    assert first == second and first.read_bytes() == BODY
    assert first.parent == tmp_path / "downloads" and first.name.endswith("-file.bin")
    assert len(server.log) == 1
    first.write_bytes(b"damaged")  # a cached copy failing its hash is fetched again
    assert dl.fetch(f"{server.base}/file.bin", cache_dir=tmp_path, sha256=BODY_SHA256, policy=FAST).read_bytes() == BODY
    assert len(server.log) == 2


def test_resume_after_connection_dropped_mid_body(server: ScriptedServer, tmp_path: Path) -> None:
    destination = tmp_path / "drop.bin"
    dl.download(f"{server.base}/drop.bin", destination, sha256=BODY_SHA256, policy=FAST)
    assert destination.read_bytes() == BODY
    assert server.log == [("/drop.bin", None), ("/drop.bin", f"bytes={len(BODY) // 3}-")]


def test_drop_on_server_without_range_support_restarts(server: ScriptedServer, tmp_path: Path) -> None:
    destination = tmp_path / "x.bin"
    dl.download(f"{server.base}/drop-norange.bin", destination, sha256=BODY_SHA256, policy=FAST)
    assert destination.read_bytes() == BODY
    assert server.log == [("/drop-norange.bin", None), ("/drop-norange.bin", "bytes=1000-")]


def test_resume_of_part_file_left_by_an_earlier_run(server: ScriptedServer, tmp_path: Path) -> None:
    destination = tmp_path / "file.bin"
    (tmp_path / "file.bin.part").write_bytes(BODY[:5000])
    dl.download(f"{server.base}/file.bin", destination, sha256=BODY_SHA256, policy=FAST)
    assert destination.read_bytes() == BODY
    assert server.log == [("/file.bin", "bytes=5000-")]


def test_part_file_longer_than_the_file_starts_over(server: ScriptedServer, tmp_path: Path) -> None:
    destination = tmp_path / "file.bin"
    (tmp_path / "file.bin.part").write_bytes(BODY + b"junk")
    dl.download(f"{server.base}/file.bin", destination, sha256=BODY_SHA256, policy=FAST)
    assert destination.read_bytes() == BODY
    assert server.log == [("/file.bin", f"bytes={len(BODY) + 4}-"), ("/file.bin", None)]


def test_404_fails_at_once_with_one_line(server: ScriptedServer, tmp_path: Path) -> None:
    destination = tmp_path / "missing.bin"
    with pytest.raises(UserError) as info:
        dl.download(f"{server.base}/missing.bin", destination, policy=FAST)
    assert "HTTP 404" in str(info.value) and "\n" not in str(info.value)
    assert_nothing_left(destination)
    assert len(server.log) == 1  # a 404 is not retried


@pytest.mark.parametrize("path", ["/stall-headers.bin", "/stall-body.bin"])
def test_stall_past_read_timeout(server: ScriptedServer, tmp_path: Path, path: str) -> None:
    destination = tmp_path / "stall.bin"
    with pytest.raises(UserError) as info:
        dl.download(f"{server.base}{path}", destination, policy=FAST)
    message = str(info.value)
    assert "read timed out" in message and "after 3 attempts" in message and "\n" not in message
    assert not destination.exists()
    assert len(server.log) == FAST.retries + 1


def test_wrong_checksum_rejected(server: ScriptedServer, tmp_path: Path) -> None:
    destination = tmp_path / "file.bin"
    with pytest.raises(UserError, match=r"sha256 .* expected 0000000000000000"):
        dl.download(f"{server.base}/file.bin", destination, sha256="0" * 64, policy=FAST)
    assert_nothing_left(destination)


def test_redirect_followed(server: ScriptedServer, tmp_path: Path) -> None:
    destination = tmp_path / "r.bin"
    dl.download(f"{server.base}/redirect.bin", destination, sha256=BODY_SHA256, policy=FAST)
    assert destination.read_bytes() == BODY
    assert [p for p, _ in server.log] == ["/redirect.bin", "/file.bin"]


def test_server_error_retried(server: ScriptedServer, tmp_path: Path) -> None:
    destination = tmp_path / "f.bin"
    dl.download(f"{server.base}/flaky.bin", destination, sha256=BODY_SHA256, policy=FAST)
    assert destination.read_bytes() == BODY
    assert len(server.log) == 2


def test_connection_refused(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    destination = tmp_path / "f.bin"
    with pytest.raises(UserError, match="could not connect"):
        dl.download(f"http://127.0.0.1:{port}/f.bin", destination, policy=FAST)
    assert_nothing_left(destination)


def test_resolve_source(server: ScriptedServer, tmp_path: Path) -> None:
    local = tmp_path / "local.txt"
    local.write_bytes(BODY)
    assert dl.resolve_source(str(local), sha256=BODY_SHA256) == local
    with pytest.raises(UserError, match="pass --sha256=None"):
        dl.resolve_source(str(local), sha256="1" * 64)
    with pytest.raises(UserError, match="does not exist"):
        dl.resolve_source(str(tmp_path / "nope.txt"))
    with pytest.raises(UserError, match="only http"):
        dl.resolve_source("ftp://example.invalid/x.txt")
    fetched = dl.resolve_source(f"{server.base}/file.bin", sha256=BODY_SHA256, cache_dir=tmp_path / "c", policy=FAST)
    assert fetched.read_bytes() == BODY and fetched.is_relative_to(tmp_path / "c")


def test_default_cache_dir_honours_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(dl.CACHE_ENV, str(tmp_path / "cache"))
    assert dl.default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv(dl.CACHE_ENV)
    assert dl.default_cache_dir() == Path.home() / ".cache" / "gpt-toolkit"


def test_sha256_file_is_the_sha256_of_the_whole_file(tmp_path: Path) -> None:
    # gptkit.core.fileio.sha256_file is the one hash of a file (downloads, the cache, --bpe_dir, meta.json provenance).
    path = tmp_path / "body.bin"
    path.write_bytes(BODY)
    assert sha256_file(path) == BODY_SHA256
    assert sha256_file(path, block_bytes=1000) == BODY_SHA256  # many blocks, the last one short


def test_policy_from_settings_refuses_values_no_download_can_use() -> None:
    assert dl.policy_from_settings(0, 0.5) == dl.DownloadPolicy(retries=0, read_timeout=0.5)
    for retries, read_timeout in [(-1, 1.0), (1, 0.0), (1, float("nan"))]:
        with pytest.raises(UserError, match=r"^--retries must be >= 0 and --read_timeout > 0$"):
            dl.policy_from_settings(retries, read_timeout)
