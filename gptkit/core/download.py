"""Download a file over HTTP into a cache: timeouts, retries with backoff, resume with Range, sha256, atomic rename.

A download goes to `<destination>.part`; only a complete (and, when the hash is known, verified) file is renamed
to the destination, so a file at the destination is always whole. After a dropped connection the next attempt
(or the next run) resumes the `.part` file with an HTTP Range request when the server supports it.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3

from gptkit.core.errors import UserError
from gptkit.core.fileio import sha256_file
from gptkit.core.progress import byte_progress_bar
from gptkit.core.settings import setting

CACHE_ENV = "GPT_TOOLKIT_CACHE"
PART_SUFFIX = ".part"


@dataclass(frozen=True, kw_only=True)
class DownloadPolicy:
    """How hard to try: timeouts in seconds, retries after the first attempt, backoff doubling from `backoff`."""

    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    retries: int = 5
    backoff: float = 1.0
    max_backoff: float = 30.0
    block_bytes: int = 1 << 20


@dataclass(kw_only=True)
class DownloadSettings:
    """The download settings of every script that downloads (their settings classes extend it)."""

    cache_dir: str | None = setting(None, "download cache; default $GPT_TOOLKIT_CACHE or ~/.cache/gpt-toolkit")
    retries: int = setting(5, "download retries per file after the first attempt")
    read_timeout: float = setting(60.0, "seconds without data before a download attempt is abandoned")

    def download_policy(self) -> DownloadPolicy:
        return policy_from_settings(self.retries, self.read_timeout)


def policy_from_settings(retries: int, read_timeout: float) -> DownloadPolicy:
    """The policy a script's --retries and --read_timeout ask for; UserError for values no download can use."""
    if retries < 0 or not read_timeout > 0:  # `not >`: NaN is refused too
        raise UserError("--retries must be >= 0 and --read_timeout > 0")
    return DownloadPolicy(retries=retries, read_timeout=read_timeout)


class _RetryableError(Exception):
    """A failure worth another attempt: a dropped connection, a timeout, a 5xx answer."""


def default_cache_dir() -> Path:
    """$GPT_TOOLKIT_CACHE, else ~/.cache/gpt-toolkit."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "gpt-toolkit"


def is_url(source: str) -> bool:
    """Whether `source` is an http(s) URL rather than a local path."""
    return source.startswith(("http://", "https://"))


def cache_path_for(url: str, cache_dir: str | os.PathLike | None = None, name: str | None = None) -> Path:
    """Where `url` is kept in the cache: `name` if given, else downloads/<sha1(url)[:12]>-<file name>."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if name:
        return root / name
    basename = Path(urlsplit(url).path).name or "download"
    return root / "downloads" / f"{hashlib.sha1(url.encode()).hexdigest()[:12]}-{basename}"


def fetch(
    url: str,
    cache_dir: str | os.PathLike | None = None,
    sha256: str | None = None,
    name: str | None = None,
    policy: DownloadPolicy | None = None,
) -> Path:
    """Return the cached copy of `url`, downloading it first when it is missing (or fails its known sha256)."""
    destination = cache_path_for(url, cache_dir, name)
    if destination.is_file():
        if sha256 is None or sha256_file(destination) == sha256:
            return destination
        destination.unlink()  # a cached copy that fails its hash is damaged: fetch it again
    return download(url, destination, sha256=sha256, policy=policy)


def _status_is_retryable(status: int) -> bool:
    return status >= 500 or status in (408, 429)


def _is_name_resolution_failure(exc: Exception) -> bool:
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    resolution_error = getattr(urllib3.exceptions, "NameResolutionError", ())
    return (bool(resolution_error) and isinstance(reason, resolution_error)) or "Failed to resolve" in str(exc)


def _describe(exc: Exception) -> str:
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return "connection timed out"
    text = str(exc)
    if isinstance(exc, requests.exceptions.ReadTimeout) or "Read timed out" in text:
        return "read timed out"
    if isinstance(exc, (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError)):
        return "connection closed before the end of the file"
    if isinstance(exc, requests.exceptions.ConnectionError):
        return "could not connect" if "Connection refused" in text else "connection failed"
    return type(exc).__name__


def _body_blocks(response: requests.Response, block_bytes: int) -> Iterator[bytes]:
    """The response body in blocks as they arrive.

    read1 hands over whatever the socket has delivered, so when the connection drops every byte received so
    far reaches the .part file and the resume starts right after it (a plain read(n) would discard a short block).
    """
    raw = response.raw
    if not hasattr(raw, "read1"):  # urllib3 < 2
        yield from response.iter_content(block_bytes)
        return
    while True:
        block = raw.read1(block_bytes)
        if not block:
            return
        yield block


def _attempt(client: requests.Session, url: str, part: Path, policy: DownloadPolicy, progress) -> None:
    """One GET into `part`, resuming from its current size. Raises _RetryableError or UserError."""
    have = part.stat().st_size if part.exists() else 0
    # identity: a compressed transfer would make byte offsets for Range meaningless.
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        with client.get(
            url, headers=headers, stream=True, timeout=(policy.connect_timeout, policy.read_timeout)
        ) as response:
            status = response.status_code
            if status == 416 and have:
                part.unlink()  # our partial file does not fit the server's file any more: start over
                raise _RetryableError("the server refused to resume; starting over")
            if _status_is_retryable(status):
                raise _RetryableError(f"HTTP {status} {response.reason}")
            if status not in (200, 206):
                raise UserError(f"download of {url} failed: HTTP {status} {response.reason}; check the URL")
            resuming = status == 206
            if resuming and not response.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                part.unlink(missing_ok=True)  # the server sent a different range than asked: start over
                raise _RetryableError("the server answered with an unexpected range; starting over")
            length = response.headers.get("Content-Length")
            expected = (have if resuming else 0) + int(length) if length and length.isdigit() else None
            if progress is not None:
                progress.reset(total=expected)
                progress.update(have if resuming else 0)
            with open(part, "ab" if resuming else "wb") as handle:
                for block in _body_blocks(response, policy.block_bytes):
                    handle.write(block)
                    if progress is not None:
                        progress.update(len(block))
            size = part.stat().st_size
            if expected is not None and size != expected:
                raise _RetryableError(f"connection closed after {size} of {expected} bytes")
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
        if _is_name_resolution_failure(exc):  # no DNS (offline machine): retrying would only wait
            host = urlsplit(url).hostname
            raise UserError(f"cannot download {url}: host {host} not found (no network, or a mistyped URL)") from exc
        raise _RetryableError(_describe(exc)) from exc
    except (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.HTTPError) as exc:
        raise _RetryableError(_describe(exc)) from exc
    except (
        requests.exceptions.InvalidURL,
        requests.exceptions.MissingSchema,
        requests.exceptions.InvalidSchema,
    ) as exc:
        raise UserError(f"cannot download {url!r}: not a valid http(s) URL") from exc
    except requests.exceptions.TooManyRedirects as exc:
        raise UserError(f"download of {url} failed: too many redirects") from exc


def _progress_bar(url: str) -> Any:
    return byte_progress_bar(f"download {Path(urlsplit(url).path).name}")


def download(
    url: str,
    destination: str | os.PathLike,
    sha256: str | None = None,
    policy: DownloadPolicy | None = None,
    client: requests.Session | None = None,
) -> Path:
    """Download `url` to `destination` (atomic); returns the destination path.

    Retries dropped connections, timeouts and 5xx answers `policy.retries` times with exponential backoff,
    resuming with Range. Raises UserError (one line) on a 4xx answer, after the last retry, or on a sha256
    mismatch; nothing is left at the destination then. The `.part` file of a download cut off by the network
    is kept so a later run resumes it; one that fails its checksum or gets a 4xx is removed.
    """
    policy = policy or DownloadPolicy()
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    part = destination.with_name(destination.name + PART_SUFFIX)
    own_client = client is None
    client = client or requests.Session()
    progress = _progress_bar(url)
    try:
        for attempt in range(policy.retries + 1):
            try:
                _attempt(client, url, part, policy, progress)
                break
            except _RetryableError as exc:
                if attempt == policy.retries:
                    raise UserError(
                        f"download of {url} failed after {attempt + 1} attempts: {exc}; check the network and "
                        "the URL (a partial download is resumed on the next run)"
                    ) from None
                time.sleep(min(policy.backoff * 2**attempt, policy.max_backoff))
            except UserError:
                part.unlink(missing_ok=True)
                raise
    finally:
        if progress is not None:
            progress.close()
        if own_client:
            client.close()
    if sha256 is not None:
        actual = sha256_file(part)
        if actual != sha256:
            part.unlink()
            raise UserError(
                f"download of {url} has sha256 {actual[:16]}..., expected {sha256[:16]}...: the file is damaged "
                "or differs from the known one; retry, or pass --sha256=None to accept a different file"
            )
    with open(part, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(part, destination)
    return destination


def resolve_source(
    source: str,
    sha256: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    policy: DownloadPolicy | None = None,
) -> Path:
    """A local file for `source`: an http(s) URL is fetched into the cache, a path must be an existing file.

    When `sha256` is given the file must match it (UserError otherwise, with how to accept another file).
    """
    if is_url(source):
        return fetch(source, cache_dir=cache_dir, sha256=sha256, policy=policy)
    if "://" in source:
        raise UserError(f"cannot read {source!r}: only http(s) URLs and local paths are supported")
    path = Path(source).expanduser()
    if not path.is_file():
        raise UserError(f"source {source} does not exist or is not a file; check the path or give a URL")
    if sha256 is not None:
        actual = sha256_file(path)
        if actual != sha256:
            raise UserError(
                f"{source} has sha256 {actual[:16]}..., expected {sha256[:16]}...: it is not the expected text; "
                "pass --sha256=None to use it anyway"
            )
    return path
