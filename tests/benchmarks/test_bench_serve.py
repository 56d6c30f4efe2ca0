"""bench_serve.py at a tiny size: serve.py started, both phases (2 rounds) and the first-token probes measured, JSON
written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_serve


def test_serve_bench_measures_both_phases_and_first_tokens(tmp_path: Path):
    out = tmp_path / "serve.json"
    args = [
        "--clients=3",
        "--new_tokens=6",
        "--probes=2",
        "--probe_tokens=2",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--block_size=32",
        f"--work_dir={tmp_path / 'work'}",
        f"--json_out={out}",
    ]
    assert bench_serve.main(args) == 0
    report = json.loads(out.read_text())
    alone, together, idle, busy = report["results"]
    assert report["benchmark"] == "serve" and report["settings"]["clients"] == 3
    for row in (alone, together):  # 2 rounds of 3 requests of up to 6 tokens
        assert row["requests"] == 6 and 0 < row["tokens"] <= 36 and len(row["rounds_tokens_per_s"]) == 2
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"], rel=0.05)
        assert row["median_ttft_ms"] > 0
    assert together["x_one_at_a_time"] == pytest.approx(together["tokens_per_s"] / alone["tokens_per_s"], abs=0.01)
    assert idle["median_ttft_ms"] > 0 and busy["median_ttft_ms"] > 0 and len(busy["all_ttft_ms"]) == 2
    assert busy["mode"] == "first token, 2 others decoding" and len(busy["decoding_when_sent"]) == 2
    assert (tmp_path / "work" / "server.log").exists() and not (tmp_path / "work" / "ckpt.pt").exists()
