"""benchmarks/measure.py: timed runs taken round-robin, each set against the read speed measured around it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import measure


def test_each_run_gets_the_mean_of_the_read_speeds_just_before_and_after_it():
    """Two paths, one of them run once: the measures go before a round and after every run, a path past its repeats
    is skipped, and every fn first runs once on 8 tokens (warm-up, not timed)."""
    calls: list[tuple[str, int]] = []
    measures = iter([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0])
    runs = {"a": (lambda n: calls.append(("a", n)), 5, 3), "b": (lambda n: calls.append(("b", n)), 7, 1)}
    timed = measure.time_paths(runs, lambda: next(measures))
    assert calls == [("a", 8), ("b", 8), ("a", 5), ("b", 7), ("a", 5), ("a", 5)]
    assert [speed for _, speed in timed["a"]] == [15.0, 45.0, 65.0]  # rounds: 10|a|20|b|30, 40|a|50, 60|a|70
    assert [speed for _, speed in timed["b"]] == [25.0]
    assert next(measures, None) is None and all(seconds >= 0 for runs in timed.values() for seconds, _ in runs)
    assert [speed for _, speed in measure.time_paths({"a": runs["a"]})["a"]] == [None, None, None]


def test_read_bandwidth_is_the_buffer_s_bytes_over_the_best_timed_sum(monkeypatch):
    """A 4 MiB buffer; the warm-up sum reads the clock once, untimed; the two timed sums take 0.5 s and 0.25 s."""
    clock = iter([0.0, 10.0, 10.5, 20.0, 20.25])
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    assert measure.read_bandwidth(torch.device("cpu"), 4, repeats=2) == 4 * 2**20 / 0.25
    assert next(clock, None) is None
