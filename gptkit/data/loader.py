"""Token data for training: memory-mapped token streams and reproducible batches.

A split (train, val, ...) is one stream of tokens: its files from meta.json, concatenated in order. Files are
memory-mapped only for the duration of one batch, so memory use does not grow with the corpus and the
operating system's page cache does the rest.

Batches are *counter-based*: batch number i of a sampler is drawn from a fresh numpy Generator seeded with
(seed, purpose, i). A sampler's whole state is therefore (seed, purpose, position), which makes an
interrupted run resume on exactly the batches it would have seen. It also makes the data independent of how
a step is split over processes: step s uses global micro-batches s*G ... s*G + G-1 (G = micro-batches per
step over all ranks), and rank r of N takes the r-th contiguous group of G/N of them. So N ranks with A
accumulation steps each and one process with N*A steps consume identical batches.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gptkit.core.errors import UserError
from gptkit.data.meta import read_meta

# Token files are raw little-endian arrays without a header (the nanoGPT layout).
_FILE_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

# Purposes keep the random streams of training and evaluation apart, so evaluating never shifts training data.
PURPOSE_TRAIN = 0
PURPOSE_EVAL_TRAIN = 1
PURPOSE_EVAL_VAL = 2


@dataclass(frozen=True, kw_only=True)
class TokenStream:
    """One split of a data directory as a single stream of token ids across its files."""

    name: str
    paths: tuple[Path, ...]
    lengths: tuple[int, ...]  # tokens per file
    dtype: np.dtype
    vocab_size: int | None = None  # when known, reading a larger id is an error (the model would crash on it)

    def __post_init__(self) -> None:
        ends = np.cumsum(np.asarray(self.lengths, dtype=np.int64))
        object.__setattr__(self, "_ends", ends)
        object.__setattr__(self, "_starts", ends - np.asarray(self.lengths, dtype=np.int64))

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self.lengths) else 0

    def read_windows(self, starts: np.ndarray | list[int], length: int, sequential: bool = False) -> np.ndarray:
        """Read `length` consecutive tokens from each start position; returns an int64 array (len(starts), length).

        A window may cross file boundaries. Files are mapped lazily for this call only and released after.
        `sequential` says the windows are in file order (read-ahead helps); otherwise they are random.
        """
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size and (starts.min() < 0 or starts.max() + length > len(self)):
            raise IndexError(f"window outside the {self.name} stream of {len(self)} tokens")
        out = np.empty((len(starts), length), dtype=np.int64)
        maps: dict[int, np.memmap] = {}
        for row, start in enumerate(starts.tolist()):
            filled = 0
            while filled < length:
                position = start + filled
                index = int(np.searchsorted(self._ends, position, side="right"))  # skips empty files
                offset = position - int(self._starts[index])
                take = min(length - filled, self.lengths[index] - offset)
                if index not in maps:
                    maps[index] = _map_file(self.paths[index], self.dtype, sequential)
                out[row, filled : filled + take] = maps[index][offset : offset + take]
                filled += take
        if self.vocab_size is not None and out.size and out.max() >= self.vocab_size:
            raise UserError(
                f"the {self.name} split holds token id {out.max()} but meta.json's vocab_size is {self.vocab_size}; "
                "the token files are damaged or belong to other data, prepare the data again"
            )
        return out


def _map_file(path: Path, dtype: np.dtype, sequential: bool) -> np.memmap:
    tokens = np.memmap(path, dtype=dtype, mode="r")
    # For random windows the kernel's read-ahead would fetch (or zero-fill) far more than the few hundred bytes
    # a window needs; MADV_RANDOM turns it off. Numpy keeps the mmap object in the private `_mmap`.
    advice = getattr(mmap, "MADV_SEQUENTIAL" if sequential else "MADV_RANDOM", None)
    handle = getattr(tokens, "_mmap", None)
    if advice is not None and handle is not None:
        handle.madvise(advice)
    return tokens


def data_dir_for(dataset: str, data_dir: str | None) -> Path:
    """The data directory: `data_dir` when given, else data/`dataset`."""
    return Path(data_dir) if data_dir else Path("data") / dataset


def open_split(data_dir: str | os.PathLike, split: str, meta: dict | None = None) -> TokenStream:
    """Open split `split` of `data_dir` as a TokenStream (meta.json read when `meta` is None).

    Raises UserError when the split, a file or its size does not match meta.json.
    """
    directory = Path(data_dir)
    meta = read_meta(directory) if meta is None else meta
    if split not in meta["splits"]:
        raise UserError(f"{directory}/meta.json has no {split!r} split (it has {', '.join(meta['splits'])})")
    info = meta["splits"][split]
    dtype = _FILE_DTYPES[meta["dtype"]]
    paths, lengths = [], []
    for name in info["files"]:
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise UserError(f"{path} (split {split!r}) is missing; prepare the data again") from None
        if size % dtype.itemsize:
            raise UserError(f"{path} is {size} bytes, not a whole number of {meta['dtype']} tokens; prepare again")
        paths.append(path)
        lengths.append(size // dtype.itemsize)
    stream = TokenStream(
        name=split, paths=tuple(paths), lengths=tuple(lengths), dtype=dtype, vocab_size=meta["vocab_size"]
    )
    if len(stream) != info["tokens"]:
        raise UserError(
            f"{directory}: split {split!r} files hold {len(stream)} tokens but meta.json says {info['tokens']}; "
            "the data is incomplete or altered, prepare it again"
        )
    return stream


def check_stream_fits(stream: TokenStream, block_size: int, where: str) -> None:
    """UserError unless the stream holds at least one training window (block_size + 1 tokens)."""
    if len(stream) < block_size + 1:
        raise UserError(
            f"{where}: split {stream.name!r} has {len(stream)} tokens, fewer than block_size+1 = {block_size + 1}; "
            "use a smaller --block_size or more data"
        )


class BatchSampler:
    """Random (x, y) windows of a stream; batch number i is a pure function of (seed, purpose, i).

    x is `batch_size` windows of `block_size` tokens and y the same windows shifted by one token.
    `position` counts the batches consumed so far; state_dict()/load_state_dict() save and restore it.
    """

    def __init__(self, stream: TokenStream, batch_size: int, block_size: int, seed: int, purpose: int = 0) -> None:
        check_stream_fits(stream, block_size, "data")
        self.stream, self.batch_size, self.block_size = stream, batch_size, block_size
        self.seed, self.purpose = seed, purpose
        self.position = 0

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number `index` as int64 CPU tensors x, y of shape (batch_size, block_size)."""
        rng = np.random.default_rng((self.seed, self.purpose, index))  # its own generator per batch
        # The last valid start leaves room for block_size inputs plus one more target token.
        starts = rng.integers(0, len(self.stream) - self.block_size, size=self.batch_size)
        return _inputs_and_targets(self.stream.read_windows(starts, self.block_size + 1))

    def state_dict(self) -> dict[str, int]:
        """The sampler's state as plain ints (safe for torch.load(weights_only=True))."""
        return {"seed": self.seed, "purpose": self.purpose, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved state: same seed and purpose, same position."""
        self.seed, self.purpose, self.position = int(state["seed"]), int(state["purpose"]), int(state["position"])


class FixedBatches:
    """`count` batches of a sampler (batch numbers 0..count-1) as an indexable sequence, for evaluation."""

    def __init__(self, sampler: BatchSampler, count: int) -> None:
        self.sampler, self.count = sampler, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        return self.sampler.batch(index)


class SplitWindows:
    """The whole stream cut into non-overlapping windows, in order, as an indexable sequence of batches.

    Every token after the first is predicted exactly once: full windows of block_size targets are grouped
    `batch_size` to a batch, and the tokens left over at the end form a last, shorter window of their own.
    Average losses weighted by y.numel() to get the exact per-token loss of the split.
    """

    def __init__(self, stream: TokenStream, block_size: int, batch_size: int) -> None:
        check_stream_fits(stream, 1, "data")
        self.stream, self.block_size, self.batch_size = stream, block_size, batch_size
        self.full_windows = (len(stream) - 1) // block_size
        self.tail = (len(stream) - 1) - self.full_windows * block_size
        self.full_batches = -(-self.full_windows // batch_size)

    def __len__(self) -> int:
        return self.full_batches + (1 if self.tail else 0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index < self.full_batches:
            first = index * self.batch_size
            count = min(self.batch_size, self.full_windows - first)
            starts = (first + np.arange(count)) * self.block_size
            windows = self.stream.read_windows(starts, self.block_size + 1, sequential=True)
        else:
            windows = self.stream.read_windows([self.full_windows * self.block_size], self.tail + 1, sequential=True)
        return _inputs_and_targets(windows)


def _inputs_and_targets(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    # Contiguous copies: the model flattens targets with .view(), which a strided slice would not allow.
    return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a batch to `device`; on CUDA through pinned memory with a non-blocking copy."""
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


class BatchPrefetcher:
    """A sampler's batches on `device`, the next one read (and on CUDA pinned and copied) on a background thread
    while the current step computes.

    `get(index, upcoming)` returns batch `index` and starts preparing batch `upcoming`, the one the caller will ask
    for next. A batch is a pure function of its index, so prefetching never changes what training sees: a miss (the
    first call, or a different index than announced) is read on the spot. On CUDA the copy runs on a stream of its
    own and the compute stream waits for it, so the host-to-device transfer overlaps the previous step's kernels.
    """

    def __init__(self, sampler: BatchSampler, device: torch.device) -> None:
        self.sampler, self.device = sampler, device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")
        self._pending: tuple[int, Future] | None = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def get(self, index: int, upcoming: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` (x, y) on the device; then batch `upcoming` starts on the background thread."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == index:
            x, y = pending[1].result()
        else:
            if pending is not None:
                pending[1].cancel()
            x, y = self._prepare(index)
        if self._copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self._copy_stream)  # the copy has been queued: kernels start after it lands
            x.record_stream(compute)  # memory made on the copy stream is not reused while compute reads it
            y.record_stream(compute)
        if upcoming is not None:
            self._pending = (upcoming, self._pool.submit(self._prepare, upcoming))
        return x, y

    def close(self) -> None:
        """Stop the background thread (a batch being read is finished and dropped)."""
        self._pending = None
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _prepare(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.sampler.batch(index)
        if self._copy_stream is None:
            return x.to(self.device), y.to(self.device)
        # This thread's current CUDA device is not the caller's: name it, then queue the copy on the copy stream.
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
            return to_device(x, y, self.device)


def bits_per_byte(loss_nats: float, split_info: dict) -> float | None:
    """Bits per UTF-8 byte of text for a per-token loss in nats, using meta.json's tokens/text_bytes of a split."""
    tokens, text_bytes = split_info.get("tokens", 0), split_info.get("text_bytes", 0)
    if not tokens or not text_bytes:
        return None
    return loss_nats / float(np.log(2)) * tokens / text_bytes
