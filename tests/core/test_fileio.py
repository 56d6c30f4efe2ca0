"""gptkit/core/fileio.py: atomic writes that leave the earlier file whole and name the file the user knows, UTF-8
reading, the checks of an output path, and file digests against git's and hashlib's own."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gptkit.core import fileio
from gptkit.core.errors import UserError


def test_an_atomic_write_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "results.json"
    fileio.atomic_write_json(path, {"accuracy": 0.5, "name": "é"})
    assert path.read_text(encoding="utf-8") == '{\n  "accuracy": 0.5,\n  "name": "é"\n}\n'
    fileio.atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and sorted(p.name for p in path.parent.iterdir()) == ["results.json"]


@pytest.mark.parametrize("failure", ["full disk", "interrupted"])
def test_a_failed_write_leaves_the_earlier_file_and_no_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    path = tmp_path / "ckpt.json"
    path.write_text("earlier")
    raised = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if failure == "full disk" else KeyboardInterrupt()

    def fail(fd: int) -> None:
        raise raised

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(type(raised)) as info, fileio.atomic_open(path, "w") as handle:
        handle.write("half of the new one")
    assert path.read_text() == "earlier" and [p.name for p in tmp_path.iterdir()] == ["ckpt.json"]
    if failure == "full disk":  # said of the file the user knows, not of its temporary twin
        assert (info.value.errno, info.value.filename) == (errno.ENOSPC, str(path))


def test_a_folder_that_takes_no_file_is_named_in_the_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / ".x.json.abc.tmp"))

    monkeypatch.setattr(fileio.tempfile, "mkstemp", read_only)
    with pytest.raises(OSError) as info:
        fileio.atomic_write_json(tmp_path / "x.json", {})
    assert (info.value.errno, info.value.filename) == (errno.EROFS, str(tmp_path / "x.json"))


def test_utf8_text_loses_its_byte_order_mark_and_bad_bytes_are_named_by_line(tmp_path: Path) -> None:
    good = tmp_path / "prompt.txt"
    good.write_bytes(b"\xef\xbb\xbfline one\nline two\n")
    assert fileio.read_utf8_text(good) == "line one\nline two\n"
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("first\nsecond\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt:3: not UTF-8 text \(byte 0xe9\); save the file as UTF-8$"):
        fileio.read_utf8_text(bad)


def test_an_output_path_is_checked_before_the_work(tmp_path: Path) -> None:
    fileio.check_writable_parent(tmp_path / "new" / "er" / "out.json", "--json_out")  # folders to be made
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match=r"^--out=.*a_file/x\.png: .*a_file is a file, not a directory; name another"):
        fileio.check_writable_parent(tmp_path / "a_file" / "x.png", "--out")
    assert fileio.existing_ancestor(tmp_path / "a" / "b" / "c.txt") == tmp_path


def test_digests_equal_hashlibs_and_gits_own(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    data = bytes(range(256)) * 5000 + b"tail"
    path.write_bytes(data)
    assert fileio.sha256_file(path, block_bytes=4096) == hashlib.sha256(data).hexdigest()
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    git = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True).stdout
    assert fileio.git_blob_sha1(path, block_bytes=4096) == git.strip()
