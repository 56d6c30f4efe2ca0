"""benchmarks/bench_lora.py at its smallest: every mode trains and is reported. The smoke run calls its main and the
modes' runs of bench_lora.py in this process; one mode's run is a process of its own below, as the benchmark starts
each."""

from __future__ import annotations

import json
from pathlib import Path

import bench_lora
from helpers import run_main, run_script, scripts_in_process

TINY = ["--n_layer=1", "--n_embd=64", "--block_size=16", "--batch_size=1", "--steps=1", "--rank=2"]
# rank 2 on one block's attention: c_attn A (2, 64) + B (192, 2), c_proj A (2, 64) + B (64, 2)
ATTENTION_ADAPTERS = 2 * 64 + 192 * 2 + 2 * 64 + 64 * 2


def test_smoke_run_reports_every_mode(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "lora.json"
    scripts_in_process(monkeypatch, bench_lora)
    code, _, err = run_main(bench_lora.main, [*TINY, f"--json_out={out}"], capsys)
    assert code == 0, err
    rows = json.loads(out.read_text())["results"]
    assert [row["mode"] for row in rows] == list(bench_lora.MODES)
    full, attention = rows[0], rows[1]
    assert full["trainable_share"] == 1.0 and full["x_full_step_time"] == 1.0
    assert attention["trainable_params"] == ATTENTION_ADAPTERS
    assert attention["weights_grads_optimizer_mb"] < full["weights_grads_optimizer_mb"]
    assert all(row["step_ms_median"] > 0 and row["peak_rss_mb"] > 0 for row in rows)


def test_one_mode_runs_as_the_benchmark_starts_it() -> None:
    """A mode's own process prints its figures as the last line of JSON, which the benchmark reads."""
    result = run_script("benchmarks/bench_lora.py", "--mode=LoRA attention", *TINY, "--json_out=")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["mode"] == "LoRA attention" and row["rank"] == 2 and row["trainable_params"] == ATTENTION_ADAPTERS
