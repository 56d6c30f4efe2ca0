"""Tests for loader.py: token streams over files and shards, reproducible batch sampling, full-split windows."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.data import loader
from gptkit.data.meta import read_meta, write_meta
from helpers import clean_env, make_char_data


def whole_split(directory: Path, split: str) -> np.ndarray:
    meta = read_meta(directory)
    dtype = np.dtype("<u2") if meta["dtype"] == "uint16" else np.dtype("<u4")
    return np.concatenate([np.fromfile(directory / f, dtype=dtype) for f in meta["splits"][split]["files"]])


def test_sharded_split_reads_as_one_stream_across_file_boundaries(tmp_path: Path) -> None:
    meta = make_char_data(tmp_path, shards=3, dtype="uint32")
    assert meta["splits"]["train"]["files"] == ["train_000000.bin", "train_000001.bin", "train_000002.bin"]
    expected = whole_split(tmp_path, "train")
    stream = loader.open_split(tmp_path, "train")
    assert len(stream) == len(expected) == meta["splits"]["train"]["tokens"]
    boundary = stream.lengths[0]
    starts = [0, boundary - 3, boundary + stream.lengths[1] - 1, len(stream) - 10]
    windows = stream.read_windows(starts, 10)
    assert windows.dtype == np.int64
    for row, start in enumerate(starts):
        np.testing.assert_array_equal(windows[row], expected[start : start + 10])
    with pytest.raises(IndexError):
        stream.read_windows([len(stream) - 9], 10)


def test_empty_shard_is_skipped(tmp_path: Path) -> None:
    meta = make_char_data(tmp_path, shards=2)
    (tmp_path / "train_empty.bin").write_bytes(b"")
    meta["splits"]["train"]["files"].insert(1, "train_empty.bin")
    write_meta(tmp_path, meta)
    stream = loader.open_split(tmp_path, "train")
    first = stream.lengths[0]
    np.testing.assert_array_equal(
        stream.read_windows([first - 2], 4)[0], whole_split(tmp_path, "train")[first - 2 : first + 2]
    )


def test_open_split_errors_name_the_problem(tmp_path: Path) -> None:
    meta = make_char_data(tmp_path)
    with pytest.raises(UserError, match="no 'test' split"):
        loader.open_split(tmp_path, "test")
    (tmp_path / "val.bin").write_bytes((tmp_path / "val.bin").read_bytes() + b"\x00")
    with pytest.raises(UserError, match="not a whole number"):
        loader.open_split(tmp_path, "val")
    (tmp_path / "val.bin").write_bytes((tmp_path / "val.bin").read_bytes()[:-3])
    with pytest.raises(UserError, match=r"meta\.json says"):
        loader.open_split(tmp_path, "val")
    (tmp_path / "val.bin").unlink()
    with pytest.raises(UserError, match=r"val.bin .*missing"):
        loader.open_split(tmp_path, "val", meta)
    with pytest.raises(UserError, match=r"no meta\.json"):
        loader.open_split(tmp_path / "nowhere", "train")


def test_batches_are_real_shifted_windows_and_reproducible(tmp_path: Path) -> None:
    make_char_data(tmp_path)
    stream = loader.open_split(tmp_path, "train")
    tokens = whole_split(tmp_path, "train")
    sampler = loader.BatchSampler(stream, batch_size=8, block_size=16, seed=5)
    x, y = sampler.batch(3)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    joined = tokens.tobytes()
    for row in range(8):  # each row is a window that occurs in the stream
        assert np.asarray([*x[row].tolist(), int(y[row, -1])], dtype=tokens.dtype).tobytes() in joined
    again = loader.BatchSampler(stream, batch_size=8, block_size=16, seed=5).batch(3)
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    assert not torch.equal(sampler.batch(4)[0], x)
    assert not torch.equal(loader.BatchSampler(stream, 8, 16, seed=6).batch(3)[0], x)
    assert not torch.equal(loader.BatchSampler(stream, 8, 16, seed=5, purpose=loader.PURPOSE_EVAL_TRAIN).batch(3)[0], x)


def test_sampler_state_round_trips(tmp_path: Path) -> None:
    make_char_data(tmp_path)
    stream = loader.open_split(tmp_path, "train")
    sampler = loader.BatchSampler(stream, 4, 8, seed=1)
    sampler.position = 17
    state = sampler.state_dict()
    assert state == {"seed": 1, "purpose": 0, "position": 17}
    restored = loader.BatchSampler(stream, 4, 8, seed=999)
    restored.load_state_dict(state)
    assert restored.position == 17
    assert torch.equal(restored.batch(restored.position)[0], sampler.batch(17)[0])


def test_batches_do_not_depend_on_sharding(tmp_path: Path) -> None:
    make_char_data(tmp_path / "one")
    make_char_data(tmp_path / "many", shards=4)
    one = loader.BatchSampler(loader.open_split(tmp_path / "one", "train"), 6, 32, seed=2)
    many = loader.BatchSampler(loader.open_split(tmp_path / "many", "train"), 6, 32, seed=2)
    for index in range(5):
        assert torch.equal(one.batch(index)[0], many.batch(index)[0])


def test_split_shorter_than_a_window_is_a_clear_error(tmp_path: Path) -> None:
    make_char_data(tmp_path, text="abcdefghij" * 5)  # val split: 5 tokens
    stream = loader.open_split(tmp_path, "val")
    with pytest.raises(UserError, match=r"split 'val' has 5 tokens, fewer than block_size\+1 = 9"):
        loader.BatchSampler(stream, 2, 8, seed=0)
    loader.BatchSampler(stream, 2, 4, seed=0).batch(0)  # 5 tokens are exactly one window of 4 + 1


def test_split_windows_predict_every_token_exactly_once(tmp_path: Path) -> None:
    make_char_data(tmp_path, shards=2)
    tokens = whole_split(tmp_path, "val")
    windows = loader.SplitWindows(loader.open_split(tmp_path, "val"), block_size=64, batch_size=7)
    xs, ys = zip(*windows)
    assert all(x.shape == y.shape for x, y in zip(xs, ys))
    assert xs[0].shape == (7, 64) and xs[-1].shape[0] == 1 and xs[-1].shape[1] == (len(tokens) - 1) % 64
    np.testing.assert_array_equal(torch.cat([x.flatten() for x in xs]).numpy(), tokens[:-1])
    np.testing.assert_array_equal(torch.cat([y.flatten() for y in ys]).numpy(), tokens[1:])
    assert len(windows) == len(xs) and torch.equal(windows[1][0], xs[1])


# Run in a fresh process: ru_maxrss is a high-water mark, and in the test process earlier tests (models, big
# arrays) may have set it so high that any growth from sampling would hide below it.
SAMPLE_AND_REPORT_GROWTH = """
import resource, sys
from gptkit.data import loader
sampler = loader.BatchSampler(loader.open_split(sys.argv[1], "train"), 64, 256, seed=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
for index in range(20):
    x, _ = sampler.batch(index)
assert int(x.max()) == 0  # holes read as zeros
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    # A 4 GiB token file that costs no disk (sparse): sampling from it must only touch the pages it reads.
    meta = make_char_data(tmp_path)
    tokens = 2**31
    with open(tmp_path / "train.bin", "wb") as handle:
        handle.truncate(tokens * 2)
    meta["splits"]["train"]["tokens"] = tokens
    write_meta(tmp_path, meta)
    child = subprocess.run(
        [sys.executable, "-c", SAMPLE_AND_REPORT_GROWTH, str(tmp_path)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    grown_mib = float(child.stdout)
    assert grown_mib < 200


def test_to_device_and_bits_per_byte() -> None:
    x, y = torch.arange(6).view(2, 3), torch.arange(1, 7).view(2, 3)
    dx, dy = loader.to_device(x, y, torch.device("cpu"))
    assert torch.equal(dx, x) and torch.equal(dy, y)
    assert loader.bits_per_byte(math.log(2), {"tokens": 100, "text_bytes": 400}) == pytest.approx(0.25)
    assert loader.bits_per_byte(1.0, {"tokens": 100, "text_bytes": 0}) is None
    assert loader.data_dir_for("shakespeare_char", None) == Path("data/shakespeare_char")
    assert loader.data_dir_for("ignored", "/srv/corpora/mine") == Path("/srv/corpora/mine")


class RecordingSampler(loader.BatchSampler):
    """A BatchSampler that notes which batch each call read and on which thread."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[tuple[int, str]] = []

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append((index, threading.current_thread().name))
        return super().batch(index)


def test_prefetcher_gives_the_samplers_batches_whatever_is_announced(tmp_path: Path) -> None:
    make_char_data(tmp_path, text="abcdefghij" * 40)
    stream = loader.open_split(tmp_path, "train")
    sampler = loader.BatchSampler(stream, batch_size=3, block_size=8, seed=5)
    reference = loader.BatchSampler(stream, batch_size=3, block_size=8, seed=5)
    prefetcher = loader.BatchPrefetcher(sampler, torch.device("cpu"))
    # Announced right, announced wrong (a miss), nothing announced, then a jump (as after a resume).
    calls = [(0, 1), (1, 7), (2, None), (9, 10), (10, 11), (11, None)]
    try:
        for index, upcoming in calls:
            x, y = prefetcher.get(index, upcoming)
            expected_x, expected_y = reference.batch(index)
            assert torch.equal(x, expected_x) and torch.equal(y, expected_y), index
    finally:
        prefetcher.close()


def test_prefetcher_reads_the_announced_batch_ahead_on_its_own_thread(tmp_path: Path) -> None:
    make_char_data(tmp_path, text="abcdefghij" * 40)
    sampler = RecordingSampler(loader.open_split(tmp_path, "train"), batch_size=2, block_size=8, seed=1)
    prefetcher = loader.BatchPrefetcher(sampler, torch.device("cpu"))
    try:
        prefetcher.get(0, upcoming=1)
        prefetcher._pending[1].result(timeout=10)  # batch 1 is ready before anyone asks for it
        assert sampler.reads == [(0, "MainThread"), (1, sampler.reads[1][1])]
        assert sampler.reads[1][1].startswith("batch-prefetch")
        prefetcher.get(1, upcoming=None)
        assert len(sampler.reads) == 2  # served from the prefetched copy, not read again
    finally:
        prefetcher.close()
