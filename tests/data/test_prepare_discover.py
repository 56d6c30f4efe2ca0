"""gptkit.data.prepare.discover: finding input files, and the files directories and globs leave out."""

from __future__ import annotations

import gzip
from pathlib import Path, PurePosixPath

import pytest

from gptkit.core.errors import UserError
from gptkit.data.prepare import discover


def test_find_inputs_dirs_globs_and_errors(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / ".git").mkdir()
    (tmp_path / "d" / "b.txt").write_text("b")
    (tmp_path / "d" / "sub" / "a.md").write_text("a")
    (tmp_path / "d" / "sub" / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "c"}\n'))
    (tmp_path / "d" / ".git" / "config").write_text("hidden")
    (tmp_path / "d" / ".notes.txt").write_text("hidden")
    found = discover.find_inputs([str(tmp_path / "d"), str(tmp_path / "d" / "*.txt")])
    files = found.files
    assert [f.path.relative_to(tmp_path / "d").as_posix() for f in files] == ["b.txt", "sub/a.md", "sub/c.jsonl.gz"]
    assert [f.index for f in files] == [0, 1, 2]
    assert [(f.kind, f.compressed) for f in files] == [("text", False), ("text", False), ("jsonl", True)]
    assert not discover.is_single_document(files) and discover.is_single_document(files[:1])
    # The glob's *.txt matches .notes.txt too: counted once, whichever input found it.
    assert found.skipped == {**dict.fromkeys(discover.SKIP_REASONS, 0), "version control": 1, "hidden": 1}
    inside = discover.find_inputs([str(tmp_path / "d")], out_dir=tmp_path / "d" / "sub").files  # e.g. the out_dir
    assert [f.path.name for f in inside] == ["b.txt"]
    with pytest.raises(UserError, match="does not exist"):
        discover.find_inputs([str(tmp_path / "missing.txt")])
    with pytest.raises(UserError, match="matches no files"):
        discover.find_inputs([str(tmp_path / "*.xyz")])
    with pytest.raises(UserError, match="no input"):
        discover.find_inputs([])
    with pytest.raises(UserError, match="an --input is empty"):  # e.g. --input=$UNSET: not the current directory
        discover.find_inputs([str(tmp_path / "d"), ""])


def binary(tmp_path: Path, name: str, data: bytes) -> bool:
    (tmp_path / name).write_bytes(data)
    return discover.looks_binary(tmp_path / name)


def test_looks_binary_reads_the_first_8_kib_decompressed(tmp_path: Path) -> None:
    # A NUL byte decides, as git and ripgrep do; a .gz is judged by its text.
    assert not binary(tmp_path, "a.txt", "café\n".encode() * 1000)
    assert binary(tmp_path, "b.txt", b"x" * 8000 + b"\0")
    assert not binary(tmp_path, "c.txt", b"x" * 8192 + b"\0")  # too late to count
    assert not binary(tmp_path, "d.txt.gz", gzip.compress(b"plain text\n" * 100))  # the gzip header holds NULs
    assert binary(tmp_path, "e.tar.gz", gzip.compress(b"name\0\0\0\0"))
    assert not binary(tmp_path, "f.txt.gz", gzip.compress(b"text\n" * 5000)[:100])  # damaged: reading says so
    assert binary(tmp_path, "g.gz", b"\x89PNG\r\n\x1a\n\0\0")  # not gzip at all


def test_path_filter_matches_relative_path_or_name() -> None:
    only_py = discover.PathFilter(include=("*.py",))
    assert not only_py.excludes_file(PurePosixPath("src/a.py")) and only_py.excludes_file(PurePosixPath("a.md"))
    no_tests = discover.PathFilter(exclude=("tests/", "src/gen/*", "*.log"))
    assert no_tests.excludes_folder(PurePosixPath("pkg/tests"))  # by name, at any depth
    assert no_tests.excludes_file(PurePosixPath("src/gen/deep/x.py"))  # "*" crosses "/" in a relative path
    assert no_tests.excludes_file(PurePosixPath("logs/run.log"))
    assert not no_tests.excludes_file(PurePosixPath("src/genuine.py"))
    assert not no_tests.excludes_folder(PurePosixPath("src"))


def test_globs_skip_like_walks_and_count_each_file_once(tmp_path: Path) -> None:
    (tmp_path / "d" / "__pycache__").mkdir(parents=True)
    (tmp_path / "d" / "__pycache__" / "m.pyc").write_bytes(b"\0")
    (tmp_path / "d" / "m.py").write_text("x = 1\n")
    (tmp_path / "d" / "img.txt").write_bytes(b"\x89PNG\0")
    (tmp_path / "d" / "loop").symlink_to(tmp_path / "d")
    for pattern in ("d/**", "d/*", "d/**/*"):  # ** matches every folder and file below: each counted once
        found = discover.find_inputs([f"{tmp_path}/{pattern}"])
        assert [f.path.name for f in found.files] == ["m.py"], pattern
        assert (found.skipped["__pycache__"], found.skipped["binary"]) == (1, 1), pattern
    # Named on its own a file is read, and no longer counted as skipped by the walk that also found it; a binary one
    # named so is an error, not read as text.
    (tmp_path / "d" / "notes.txt").write_text("mine\n")
    found = discover.find_inputs([str(tmp_path / "d"), str(tmp_path / "d" / "notes.txt")], include=["*.md"])
    assert [f.path.name for f in found.files] == ["notes.txt"] and found.skipped["excluded"] == 2  # m.py, img.txt
    with pytest.raises(UserError, match=r"--input=.*img.txt is a binary file, not text or JSONL; name text files"):
        discover.find_inputs([str(tmp_path / "d" / "img.txt")])
    (tmp_path / "d" / "notes.txt").unlink()
    with pytest.raises(UserError, match=r"no input files found in .* \(files left out: 1 binary, 1 __pycache__"):
        discover.find_inputs([str(tmp_path / "d")], exclude=["m.py"])
    with pytest.raises(UserError, match="is not a valid glob"):
        discover.find_inputs([f"{tmp_path}/d/a**b"])


def test_the_output_directory_is_left_out_silently_however_it_is_reached(tmp_path: Path) -> None:
    (tmp_path / "d" / "out").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("text\n")
    (tmp_path / "d" / "out" / "train.bin").write_bytes(b"\x01\x00\x02\x00")  # a run's own binary output
    for patterns in (["d"], ["d/*"], ["d/**"], ["d/**/*.bin", "d/a.txt"]):
        found = discover.find_inputs([f"{tmp_path}/{p}" for p in patterns], out_dir=tmp_path / "d" / "out")
        assert [f.path.name for f in found.files] == ["a.txt"] and not any(found.skipped.values()), patterns
