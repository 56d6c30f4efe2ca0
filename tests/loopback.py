"""A scripted HTTP server on 127.0.0.1 for download tests; each test module brings its own request handler."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class ScriptedServer(ThreadingHTTPServer):
    """127.0.0.1 only, on a port the OS picks. `log` records (path, Range header) of every request, `hits`
    counts requests per path, and `release` ends responses that stall on purpose when the test is over."""

    daemon_threads = True

    def __init__(self, handler: Callable[..., BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.log: list[tuple[str, str | None]] = []
        self.hits: dict[str, int] = {}
        self.release = threading.Event()
        self.lock = threading.Lock()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that keeps the test output clean."""

    server: ScriptedServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@contextlib.contextmanager
def serving(handler: Callable[..., BaseHTTPRequestHandler]) -> Iterator[ScriptedServer]:
    """Run a ScriptedServer with `handler` in a thread for the duration of the block."""
    httpd = ScriptedServer(handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@contextlib.contextmanager
def serving_directory(directory: str | Path) -> Iterator[tuple[str, list[str]]]:
    """Serve the files under `directory` on 127.0.0.1; yields (base URL, the paths requested so far)."""
    requested: list[str] = []

    class FileHandler(SimpleHTTPRequestHandler, QuietHandler):
        def do_GET(self) -> None:
            requested.append(self.path)
            super().do_GET()

    with serving(partial(FileHandler, directory=str(directory))) as httpd:
        yield httpd.base, requested
