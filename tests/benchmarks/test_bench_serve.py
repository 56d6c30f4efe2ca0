"""benchmarks/bench_serve.py at its smallest (2 clients, 2 tokens, one round, one probe): serve.py is started, both
phases and the first-token probes are measured, and the JSON is written. The first run calls its main in this process
(serve.py is still a process of its own); the chat run starts the script as a process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_serve
from helpers import run_main, run_script

TINY = ["--clients=2", "--new_tokens=2", "--rounds=1", "--probes=1", "--probe_tokens=1"]
TINY_MODEL = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=32"]


@pytest.mark.gpt2_bpe
def test_smoke_run_measures_both_phases_and_first_tokens(tmp_path: Path, capsys) -> None:
    out, work = tmp_path / "serve.json", tmp_path / "work"
    code, _, err = run_main(bench_serve.main, [*TINY, *TINY_MODEL, f"--work_dir={work}", f"--json_out={out}"], capsys)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert set(report) == {"benchmark", "settings", "machine", "results"} and report["benchmark"] == "serve"
    modes = [row["mode"] for row in report["results"]]
    assert modes == ["one at a time", "2 concurrent", "first token, idle server", "first token, 1 others decoding"]
    assert all({"tokens_per_s", "median_ttft_ms"} <= set(row) for row in report["results"][:2])
    assert all("median_ttft_ms" in row for row in report["results"][2:])
    assert sorted(p.name for p in work.iterdir()) == ["server.log"]  # the random weights are deleted


@pytest.mark.gpt2_bpe
def test_smoke_run_of_chat_clients(tmp_path: Path) -> None:
    out, work = tmp_path / "serve.json", tmp_path / "work"
    args = ["--chat=True", f"--work_dir={work}", f"--json_out={out}"]
    result = run_script("benchmarks/bench_serve.py", *TINY, *TINY_MODEL, *args)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["results"]
    assert rows[0]["mode"] == "one at a time" and rows[0]["tokens"] > 0 and rows[1]["tokens"] > 0
