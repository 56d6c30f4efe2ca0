"""Finding the input files of a corpus: walking directories and expanding globs, in sorted order.

What directories and globs find is left out when it is binary (a NUL byte in the first 8 KiB, as git decides),
in __pycache__ or a version-control folder, hidden, in a folder of model files (a prepared dataset, a training run
or a model's weights: their JSON is no corpus text), not a regular file (a FIFO would block), or excluded by
--include/--exclude; the files left out are counted by reason. A file named on its own is always read.
"""

from __future__ import annotations

import errno
import glob
import gzip
import os
import re
import stat
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any

from gptkit.core.errors import UserError, describe_os_error

JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True, kw_only=True)
class InputFile:
    """One input file: its path, position in the input list, format ("text"/"jsonl") and gzip flag."""

    path: Path
    index: int
    kind: str
    compressed: bool

    @property
    def size(self) -> int:
        """Bytes on disk (compressed size for .gz)."""
        return self.path.stat().st_size


def _describe_input(path: Path, index: int) -> InputFile:
    name = path.name.lower()
    compressed = name.endswith(".gz")
    if compressed:
        name = name[: -len(".gz")]
    kind = "jsonl" if name.endswith(JSONL_SUFFIXES) else "text"
    return InputFile(path=path, index=index, kind=kind, compressed=compressed)


BINARY_SNIFF_BYTES = 8192  # git and ripgrep call a file binary when its first 8 KiB hold a NUL byte
VERSION_CONTROL_DIRS = frozenset({".git", ".hg", ".svn", ".bzr"})
# Why a file found by walking a directory or expanding a glob was left out (meta.json's source.skipped_files).
SKIP_REASONS = ("binary", "__pycache__", "version control", "hidden", "model files", "excluded", "not a regular file")
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".pt", ".pth")
TOKEN_FILE = re.compile(r"(train|val)(_\d+)?\.bin")  # a prepared split's token file (prepare/writer.py)


@dataclass(frozen=True, kw_only=True)
class PathFilter:
    """--include / --exclude globs, matched against the path relative to the directory given (for a glob: the
    folder before its first wildcard) and against the name alone."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def excludes_folder(self, relative: PurePosixPath) -> bool:  # and everything under it
        return _matches(self.exclude, relative)

    def excludes_file(self, relative: PurePosixPath) -> bool:  # --exclude matches, or --include does not
        return _matches(self.exclude, relative) or (bool(self.include) and not _matches(self.include, relative))


def _matches(globs: Sequence[str], relative: PurePosixPath) -> bool:
    text = relative.as_posix()
    # fnmatchcase: the same answer on every platform; "build/" means the folder build.
    return any(fnmatchcase(text, g.rstrip("/")) or fnmatchcase(relative.name, g.rstrip("/")) for g in globs)


def _folder_reason(relative: PurePosixPath, path_filter: PathFilter) -> str | None:
    """Why a folder found by walking is not entered (None: it is)."""
    name = relative.name
    if name == "__pycache__":
        return "__pycache__"
    if name in VERSION_CONTROL_DIRS:
        return "version control"
    if name.startswith("."):  # .venv, .tox, .idea, .cache: tools' folders, never corpus text
        return "hidden"
    return "excluded" if path_filter.excludes_folder(relative) else None


def holds_model_files(names: Sequence[str]) -> bool:
    """Whether a folder holding files `names` is one this toolkit (or a model hub) writes: prepared data (meta.json
    beside train.bin or val.bin, or their shards), a training run (ckpt.pt or best.pt) or a model's weights beside
    their config.json. Why: a walk of a project's folder (--input=.) would otherwise read their JSON as corpus text."""
    if "ckpt.pt" in names or "best.pt" in names:
        return True
    if "meta.json" in names and any(TOKEN_FILE.fullmatch(name) for name in names):
        return True
    weights = any(name.endswith(WEIGHT_SUFFIXES) or name.startswith("pytorch_model") for name in names)
    return weights and "config.json" in names


def looks_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB (of the decompressed text, for a gzip file)."""
    with open(path, "rb") as raw:
        head = raw.read(BINARY_SNIFF_BYTES)
        if path.name.lower().endswith(".gz") and head.startswith(b"\x1f\x8b"):
            raw.seek(0)
            try:
                with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                    head = stream.read(BINARY_SNIFF_BYTES)
            except (OSError, EOFError, zlib.error):
                return False  # damaged: reading it stops with an error that says so
    return b"\0" in head


def _file_reason(
    path: Path, relative: PurePosixPath, path_filter: PathFilter, binary_suffixes: tuple[str, ...] = ()
) -> str | None:
    """Why a file found by walking or a glob is left out (None: it is read). Cheap checks first."""
    for depth in range(1, len(relative.parts)):  # a glob such as src/** also matches files inside __pycache__
        reason = _folder_reason(PurePosixPath(*relative.parts[:depth]), path_filter)
        if reason is not None:
            return reason
    if relative.name.startswith("."):  # .DS_Store, editor swap files
        return "hidden"
    if path_filter.excludes_file(relative):
        return "excluded"
    try:
        mode = path.stat().st_mode  # follows a symbolic link
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return "not a regular file"  # a dangling or looping symbolic link
        raise
    if not stat.S_ISREG(mode):
        return "not a regular file"  # a FIFO (opening one waits for a writer forever), socket or device
    if relative.name.lower().endswith(binary_suffixes):
        return None  # a binary format the caller reads (chat data's parquet files)
    return "binary" if looks_binary(path) else None


def _raise(exc: OSError) -> None:  # a folder that cannot be listed is an error, never silently left out
    raise exc


def _relative(path: Path, base: Path) -> PurePosixPath:
    return PurePosixPath(path.relative_to(base).as_posix())


class _Finder:
    """Collects the files of each --input in order, and the files left out of directories and globs, by reason."""

    def __init__(self, path_filter: PathFilter, out_dir: Path | None, binary_suffixes: tuple[str, ...] = ()) -> None:
        self.filter = path_filter
        self.binary_suffixes = binary_suffixes
        self.out_dir = out_dir
        self.paths: list[Path] = []
        self.skipped: dict[str, set[str]] = {reason: set() for reason in SKIP_REASONS}

    def add(self, pattern: str) -> None:
        """One --input: a directory (walked), a file (always read: named on purpose), or a glob."""
        candidate = Path(pattern).expanduser()
        if candidate.is_dir():
            self._walk(candidate, candidate, named=True)
        elif candidate.is_file():
            self._check_named_file(candidate)
            self.paths.append(candidate)
        elif glob.has_magic(pattern):
            self._glob(pattern)
        else:
            raise _not_a_file(pattern, candidate)

    def _check_named_file(self, path: Path) -> None:
        """UserError for a file named on purpose that holds no text: a walk leaves such a file out, but a named one
        would be read as text (a token file's bytes are mostly valid UTF-8)."""
        if path.name.lower().endswith(self.binary_suffixes):
            return
        try:
            binary = looks_binary(path)
        except OSError:  # reading it says what is wrong, naming it
            return
        if not binary:
            return
        hint = " (parquet: prepare_data/chat.py and fineweb.py read it)" if path.suffix.lower() == ".parquet" else ""
        raise UserError(f"--input={path} is a binary file, not text or JSONL{hint}; name text files")

    def _is_output(self, path: Path) -> bool:  # left out silently: what the run writes is no input
        return self.out_dir is not None and Path(os.path.realpath(path)).is_relative_to(self.out_dir)  # no loop error

    def _consider(self, path: Path, base: Path) -> None:
        reason = _file_reason(path, _relative(path, base), self.filter, self.binary_suffixes)
        if reason is None:
            self.paths.append(path)
        else:
            self.skipped[reason].add(os.path.realpath(path))

    def _skip_folder(self, folder: Path, reason: str) -> None:  # counted file by file, as the summary reports
        for root, _, files in os.walk(os.path.realpath(folder)):  # the same keys as _consider's, one realpath
            self.skipped[reason].update(os.path.join(root, name) for name in files)

    def _walk(self, top: Path, base: Path, named: bool = False) -> None:
        """Every file under `top`, sorted; links to folders are not followed (so no link loop), as in git. A folder
        of model files is left out, but `top` when it was `named` on its own (--input=FOLDER: read on purpose)."""
        if self._is_output(top):
            return
        for root, dirs, files in os.walk(top, onerror=_raise):
            here = Path(root)
            kept = []
            if not (named and here == top) and holds_model_files(files):
                self._skip_folder(here, "model files")
                dirs[:] = []
                continue
            for name in sorted(dirs):
                folder = here / name
                if folder.is_symlink() or self._is_output(folder):
                    continue
                reason = _folder_reason(_relative(folder, base), self.filter)
                if reason is None:
                    kept.append(name)
                else:
                    self._skip_folder(folder, reason)
            dirs[:] = kept
            for name in sorted(files):
                self._consider(here / name, base)

    def _glob(self, pattern: str) -> None:
        base, rest = _split_glob(Path(pattern).expanduser())
        try:
            # pathlib's "**" does not follow symbolic links to folders: glob.glob's does, and two link loops in a
            # tree make it run for ever.
            matches = sorted(base.glob(rest)) if base.is_dir() else []
        except ValueError as exc:
            raise UserError(f"--input={pattern} is not a valid glob ({exc})") from None
        if not matches:
            raise UserError(f"--input={pattern} matches no files; check the pattern")
        folders = {m for m in matches if m.is_dir() and not m.is_symlink()}
        for match in matches:
            if any(parent in folders for parent in match.parents) or self._is_output(match):
                continue  # inside a matched folder, which is walked (e.g. the many matches of src/**)
            if match in folders:
                reason = _folder_reason(_relative(match, base), self.filter) if match != base else None
                if reason is None:
                    self._walk(match, base)
                else:
                    self._skip_folder(match, reason)
            elif not match.is_dir():
                self._consider(match, base)


def _split_glob(pattern: Path) -> tuple[Path, str]:  # (the folder before the first wildcard, the rest)
    parts = pattern.parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    return Path(*parts[:first]) if first else Path("."), "/".join(parts[first:])


def _not_a_file(pattern: str, candidate: Path) -> UserError:
    try:
        mode = candidate.stat().st_mode
    except OSError as exc:
        if not os.path.lexists(candidate):
            return UserError(f"input {pattern} does not exist; check the path")
        if exc.errno == errno.ENOENT:
            return UserError(f"input {pattern} is a symbolic link to {os.readlink(candidate)}, which does not exist")
        return UserError(f"input {pattern} cannot be read: {describe_os_error(exc)}")  # e.g. a symbolic link loop
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device or special file"
    return UserError(f"input {pattern} is {kind}, not a regular file: corpus.py reads its inputs more than once")


def describe_skipped(skipped: dict[str, int]) -> str:
    """E.g. "2,424 __pycache__, 13 binary" (reasons with a count only); "" when nothing was skipped."""
    return ", ".join(f"{count:,} {reason}" for reason, count in skipped.items() if count)


@dataclass(frozen=True, kw_only=True)
class FoundInputs:
    """The input files in order; the files that directories and globs left out, counted by each SKIP_REASON."""

    files: list[InputFile]
    skipped: dict[str, int]


def find_inputs(
    patterns: Sequence[str],
    out_dir: str | os.PathLike | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    binary_suffixes: Sequence[str] = (),
) -> FoundInputs:
    """Expand files, directories (recursive) and globs into a de-duplicated list of InputFile, in sorted order.

    A file named on its own is always read; what directories and globs find is left out for a SKIP_REASON (see
    the module doc), and files under `out_dir` silently. Files whose names end with one of `binary_suffixes`
    (lower case, e.g. ".parquet") are never left out as binary. UserError for a path that does not exist or is no file,
    a glob that matches nothing, or no files at all.
    """
    if not patterns:
        raise UserError("no input given: pass --input=FILE, a directory or a glob (repeat for more)")
    if not all(pattern.strip() for pattern in patterns):  # e.g. --input=$UNSET_VARIABLE: not the current directory
        raise UserError("an --input is empty: name a file, a directory or a glob (e.g. --input=. for this directory)")
    excluded = Path(out_dir).resolve() if out_dir is not None else None
    finder = _Finder(PathFilter(include=tuple(include), exclude=tuple(exclude)), excluded, tuple(binary_suffixes))
    for pattern in patterns:
        finder.add(pattern)
    unique: dict[Path, Path] = {}
    for path in finder.paths:
        resolved = path.resolve()
        if excluded is None or not resolved.is_relative_to(excluded):
            unique.setdefault(resolved, path)
    read = {str(resolved) for resolved in unique}  # a file named on its own was not skipped, whatever a walk said
    skipped = {reason: len(paths - read) for reason, paths in finder.skipped.items()}
    if not unique:
        left_out = f" (files left out: {describe_skipped(skipped)})" if any(skipped.values()) else ""
        raise UserError(f"no input files found in {', '.join(patterns)}{left_out}")
    return FoundInputs(
        files=[_describe_input(path, index) for index, path in enumerate(unique.values())], skipped=skipped
    )


def is_single_document(files: Sequence[InputFile]) -> bool:
    """One plain-text file alone: the corpus is one document, split between train and val by position."""
    return len(files) == 1 and files[0].kind == "text"


def inputs_record(cfg: Any, found: FoundInputs) -> dict[str, Any]:
    """What was asked (cfg: a script's settings with input, include and exclude) and what find_inputs found and left
    out, as the scripts record it."""
    return {
        "inputs": list(cfg.input),
        "include": list(cfg.include),
        "exclude": list(cfg.exclude),
        "files": len(found.files),
        "skipped_files": found.skipped,
    }


def source_record(cfg: Any, found: FoundInputs, split: str) -> dict[str, Any]:
    """The provenance meta.json records for a corpus found by find_inputs: its inputs_record, the tokenizer and the
    split (cfg: a script's PrepareSettings)."""
    return {
        **inputs_record(cfg, found),
        "tokenizer": cfg.tokenizer,
        "bpe_dir": cfg.bpe_dir,
        "split": split,
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        **({"text_field": cfg.text_field} if cfg.text_field is not None else {}),  # None: the records name theirs
    }
