"""Files on disk: atomic writes, and the one sha256 of a file that every check of a known hash uses.

Atomic writes: a reader never sees a half-written file, and a failed write leaves nothing behind. The data goes
to a temporary file in the destination's directory (same filesystem, so the final `os.replace` is atomic), is
flushed and fsynced, and only then renamed over the destination.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from gptkit.core.errors import UserError


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; not every platform/filesystem allows opening a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", suffix: str = ".tmp") -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` for writing; on success it replaces `path` atomically.

    Takes the destination path and a write mode ("wb" or "w"). Yields the open file object.
    If the block raises (including KeyboardInterrupt or a full disk), the temporary file is
    removed and `path` is left exactly as it was.
    """
    if "w" not in mode:
        raise ValueError("atomic_open only writes")
    destination = Path(path)
    destination.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=suffix, dir=destination.parent)
    except OSError as exc:
        raise named_os_error(exc, destination) from exc
    tmp_path = Path(tmp_name)
    try:
        os.chmod(tmp_path, 0o666 & ~_current_umask())  # mkstemp creates 0600; use what open() would give
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_path, destination)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        if isinstance(exc, OSError) and exc.filename in (None, tmp_name):
            raise named_os_error(exc, destination) from exc
        raise
    _fsync_directory(destination.parent)


def named_os_error(exc: OSError, path: str | os.PathLike) -> OSError:
    """`exc` said of `path`, the file or folder the user knows (not a temporary twin, or no name at all), as
    run_cli reports it."""
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as indented UTF-8 JSON to `path` atomically."""
    with atomic_open(path, "w") as handle:
        json.dump(obj, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def read_utf8_text(path: str | os.PathLike) -> str:
    """The text of the file at `path` (a byte-order mark opening it is no text); UserError naming the line of bytes
    that are no UTF-8. OSError as reading raises it, for the caller to word."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = exc.object.count(b"\n", 0, exc.start) + 1
        raise UserError(
            f"{path}:{line}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); save the file as UTF-8"
        ) from None


def existing_ancestor(path: str | os.PathLike) -> Path:
    """The nearest folder above `path` that exists (the current one for a relative path with none): where a file
    written at `path` would have its directories made, or be refused for a file standing in their way."""
    return next((parent for parent in Path(path).parents if parent.exists()), Path("."))


def check_writable_parent(path: Path, flag: str) -> None:
    """UserError unless `path`'s directory exists as a writable directory or can be made: checked before the work
    whose result would be lost at the end. `flag` names the setting that gave the path (--json_out)."""
    above = existing_ancestor(path)
    if not above.is_dir():
        raise UserError(f"{flag}={path}: {above} is a file, not a directory; name another file")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UserError(f"{flag}={path}: {above} is not writable; name another file")


def sha256_file(path: str | os.PathLike, block_bytes: int = 1 << 20) -> str:
    """Hex sha256 of the file at `path`, read in blocks so memory stays small whatever the file's size."""
    return _digest_file(hashlib.sha256(), path, block_bytes)


def git_blob_sha1(path: str | os.PathLike, block_bytes: int = 1 << 20) -> str:
    """The id git gives the file's content (sha1 of "blob SIZE\\0" and the bytes), as a repository's tree lists it:
    the checksum to pin for a file published in a git repository."""
    header = f"blob {os.path.getsize(path)}\0".encode()
    return _digest_file(hashlib.sha1(header, usedforsecurity=False), path, block_bytes)


def _digest_file(digest: Any, path: str | os.PathLike, block_bytes: int) -> str:
    with open(path, "rb") as handle:
        while block := handle.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()
