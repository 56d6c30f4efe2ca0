"""benchmarks/measure.py, which every benchmark times with: real runs timed round-robin, each with the memory read
speed measured around it."""

from __future__ import annotations

import time

import torch

import measure


def test_paths_are_timed_with_the_read_speed_around_each_run() -> None:
    def nap(tokens: int) -> None:  # a "path" that takes a millisecond a token
        time.sleep(tokens / 1000)

    read_speed = lambda: measure.read_bandwidth(torch.device("cpu"), 4, repeats=1)  # noqa: E731
    timed = measure.time_paths({"a": (nap, 20, 3), "b": (nap, 10, 1)}, read_speed)
    assert {path: len(runs) for path, runs in timed.items()} == {"a": 3, "b": 1}  # each path's repeats
    assert all(0.02 <= seconds < 5 for seconds, _ in timed["a"]) and 0.01 <= timed["b"][0][0] < 5
    # bytes/s of a memory read: between 100 MB/s and 10 TB/s on anything that runs these tests
    assert all(1e8 < speed < 1e13 for runs in timed.values() for _, speed in runs)
    assert [speed for _, speed in measure.time_paths({"b": (nap, 1, 2)})["b"]] == [None, None]  # no read_speed
