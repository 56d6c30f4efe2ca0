"""Token files and meta.json of one data directory, written so that nothing looks complete before it is.

Tokens are appended to `<split>.bin` (or `<split>_000000.bin`, ... shards) written as `*.tmp`; they are renamed
into place only when everything succeeded, and meta.json is written last.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from gptkit.core.errors import UserError
from gptkit.data import tokenizer as tok
from gptkit.data.meta import (
    META_FILENAME,
    META_FORMAT,
    META_VERSION,
    SIDE_STREAMS,
    dtype_for_vocab,
    validate_meta,
    write_meta,
)
from gptkit.data.prepare.items import SPLITS


def _token_file_name(split: str, shard: int | None) -> str:
    return f"{split}.bin" if shard is None else f"{split}_{shard:06d}.bin"


def _is_token_file_name(name: str) -> bool:
    stem, _, extension = name.partition(".")
    if extension in {f"{side}.bin" for side in SIDE_STREAMS}:
        return stem in SPLITS
    if extension != "bin":
        return False
    split, _, number = stem.partition("_")
    return split in SPLITS and (number == "" or (len(number) == 6 and number.isdigit()))


class TokenFileWriter:
    """Appends one split's tokens to `<split>.bin.tmp`, or to shards of exactly `shard_tokens` tokens
    (`<split>_000000.bin.tmp`, ...; the last one shorter). `names` lists the final file names in order.
    """

    def __init__(self, out_dir: Path, split: str, dtype: str, shard_tokens: int | None) -> None:
        self.out_dir = out_dir
        self.split = split  # the file name's stem: "train", or "train.mask" for a side stream
        self.dtype = np.dtype(dtype).newbyteorder("<")  # the file format is little-endian on every machine
        self.shard_tokens = shard_tokens
        self.names: list[str] = []
        self.tokens = 0
        self._handle: IO[bytes] | None = None
        self._in_file = 0

    def temp_path(self, name: str) -> Path:
        """The temporary path a final file name is written under."""
        return self.out_dir / (name + ".tmp")

    def _open_next(self) -> None:
        self._close_current()
        name = _token_file_name(self.split, None if self.shard_tokens is None else len(self.names))
        self.names.append(name)
        self._handle = open(self.temp_path(name), "wb")  # noqa: SIM115 - kept open across write() calls
        self._in_file = 0

    def _close_current(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None

    def write(self, ids: np.ndarray) -> None:
        """Append token ids (already of this writer's dtype) to the split's stream."""
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        while ids.size:
            if self._handle is None or (self.shard_tokens is not None and self._in_file >= self.shard_tokens):
                self._open_next()
            room = ids.size if self.shard_tokens is None else min(ids.size, self.shard_tokens - self._in_file)
            assert self._handle is not None
            self._handle.write(memoryview(ids[:room]).cast("B"))
            self._in_file += room
            self.tokens += room
            ids = ids[room:]

    def close(self) -> None:
        """Flush, fsync and close; an empty split still gets one (empty) file."""
        if not self.names:
            self._open_next()
        self._close_current()

    def discard(self) -> None:
        """Close and delete this writer's temporary files."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        for name in self.names:
            self.temp_path(name).unlink(missing_ok=True)


@dataclass(kw_only=True)
class SplitStats:
    """Per-split counters kept next to the token files."""

    text_bytes: int = 0
    documents: int = 0
    assistant_tokens: int = 0  # chat data: tokens the loss mask trains on


class DatasetWriter:
    """Writes one data directory for one run; nothing in it looks complete until `commit` has finished.

    On creation stale `*.tmp` files of an interrupted run are removed. Token files are written as `*.tmp`;
    `commit` removes the old meta.json, renames the new files into place, removes token files of an earlier
    run that the new one does not list, and writes meta.json last. Used as a context manager, an exception
    discards this run's temporaries and leaves the directory as it was before the run.
    """

    def __init__(
        self, out_dir: str | os.PathLike, dtype: str, shard_tokens: int | None = None, side_streams: bool = False
    ) -> None:
        """`side_streams`: also write chat data's mask and conversation offsets (gptkit.data.conversations), one
        file per split each, never sharded."""
        self.out_dir = Path(out_dir)
        self.created_out_dir = not self.out_dir.exists()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.out_dir.glob("*.tmp"):
            stale.unlink()
        self.dtype = dtype
        self.writers = {split: TokenFileWriter(self.out_dir, split, dtype, shard_tokens) for split in SPLITS}
        self.stats = {split: SplitStats() for split in SPLITS}
        self.side = {
            split: {
                name: TokenFileWriter(self.out_dir, f"{split}.{name}", kind, None)
                for name, kind in SIDE_STREAMS.items()
            }
            for split in SPLITS
            if side_streams
        }
        self.skipped_documents = 0
        self.committed = False

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if not self.committed:
            self.discard()

    def write(self, split: str, ids: np.ndarray, text_bytes: int, documents: int) -> None:
        """Append tokens to `split` with the text bytes and documents they come from."""
        self.writers[split].write(ids)
        self.stats[split].text_bytes += text_bytes
        self.stats[split].documents += documents

    def write_conversation(self, split: str, ids: np.ndarray, mask: np.ndarray, text_bytes: int) -> None:
        """Append one rendered conversation (its ids and loss mask) to `split` (a writer with side streams)."""
        if len(ids) != len(mask):
            raise ValueError(f"{len(ids)} ids but {len(mask)} mask values")
        self.side[split]["conversations"].write(np.array([self.tokens(split)], dtype=np.uint64))
        self.side[split]["mask"].write(np.asarray(mask, dtype=np.uint8))
        self.stats[split].assistant_tokens += int(np.count_nonzero(mask))
        self.write(split, np.asarray(ids).astype(self.dtype), text_bytes, 1)

    def tokens(self, split: str) -> int:
        """Tokens written to `split` so far."""
        return self.writers[split].tokens

    def check_sizes(self, block_size: int, what: str) -> None:
        """UserError when the corpus is empty or a split cannot fill one training block (block_size + 1)."""
        if all(self.tokens(split) == 0 for split in SPLITS):
            skipped = f" ({self.skipped_documents} document(s) skipped)" if self.skipped_documents else ""
            raise UserError(f"the corpus is empty: no text found in {what}{skipped}")
        for split in SPLITS:
            count = self.tokens(split)
            if count < block_size + 1:
                raise UserError(
                    f"the {split} split has {count} tokens, fewer than one training block "
                    f"(block_size {block_size} + 1): add text, change --val_fraction or --seed, or lower --block_size"
                )

    def _all_writers(self) -> list[TokenFileWriter]:
        return [*self.writers.values(), *(writer for streams in self.side.values() for writer in streams.values())]

    def _split_info(self, split: str) -> dict[str, Any]:
        writer = self.writers[split]
        info = {
            "files": writer.names,
            "tokens": writer.tokens,
            "text_bytes": self.stats[split].text_bytes,
            "documents": self.stats[split].documents,
        }
        for name, side in self.side.get(split, {}).items():
            info[f"{name}_files"] = side.names
        if self.side:
            info["assistant_tokens"] = self.stats[split].assistant_tokens
        return info

    def commit(self, tokenizer: tok.Tokenizer, source: dict[str, Any]) -> dict[str, Any]:
        """Rename the token files into place and write meta.json last; returns the meta dict."""
        for writer in self._all_writers():
            writer.close()
        meta = {
            "format": META_FORMAT,
            "version": META_VERSION,
            "tokenizer": tokenizer.to_meta(),
            "vocab_size": tokenizer.vocab_size,
            "dtype": self.dtype,
            "eot_token": tokenizer.eot_token,
            "splits": {split: self._split_info(split) for split in self.writers},
            "source": source,
        }
        validate_meta(meta, "meta to write")
        # From here until meta.json is written the directory has no meta.json, so nobody takes it as complete.
        (self.out_dir / META_FILENAME).unlink(missing_ok=True)
        new_names = {name for writer in self._all_writers() for name in writer.names}
        for writer in self._all_writers():
            for name in writer.names:
                os.replace(writer.temp_path(name), self.out_dir / name)
        for old in self.out_dir.iterdir():
            if _is_token_file_name(old.name) and old.name not in new_names:
                old.unlink()  # e.g. shards beyond the new count, or train.bin after switching to shards
        write_meta(self.out_dir, meta)
        self.committed = True
        return meta

    def discard(self) -> None:
        """Delete this run's temporary files (and the output directory if this run created it)."""
        for writer in self._all_writers():
            writer.discard()
        if self.created_out_dir:
            with contextlib.suppress(OSError):  # not empty: someone else put files there meanwhile
                self.out_dir.rmdir()


def write_dataset(
    out_dir: str | os.PathLike,
    tokenizer: tok.Tokenizer,
    splits: dict[str, tuple[np.ndarray, int, int]],
    source: dict[str, Any],
) -> dict[str, Any]:
    """Write token arrays held in memory: splits maps name -> (ids, text_bytes, documents). Returns the meta."""
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    with DatasetWriter(out_dir, dtype) as writer:
        for split, (ids, text_bytes, documents) in splits.items():
            writer.write(split, np.asarray(ids).astype(dtype), text_bytes, documents)
        return writer.commit(tokenizer, source)
