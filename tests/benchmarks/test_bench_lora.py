"""benchmarks/bench_lora.py at its smallest: every mode trains in its own process (bench_lora.py started as a script)
and is reported."""

from __future__ import annotations

import json
from pathlib import Path

import bench_lora
from helpers import run_main


def test_smoke_run_reports_every_mode(tmp_path: Path, capsys) -> None:
    out = tmp_path / "lora.json"
    tiny = ["--n_layer=1", "--n_embd=64", "--block_size=16", "--batch_size=1", "--steps=1", "--rank=2"]
    code, _, err = run_main(bench_lora.main, [*tiny, f"--json_out={out}"], capsys)  # its modes still run as processes
    assert code == 0, err
    rows = json.loads(out.read_text())["results"]
    assert [row["mode"] for row in rows][:2] == ["full fine-tuning", "LoRA attention"]
    full, attention = rows[0], rows[1]
    assert full["trainable_share"] == 1.0 and full["x_full_step_time"] == 1.0
    # rank 2 on one block's attention: c_attn A (2, 64) + B (192, 2), c_proj A (2, 64) + B (64, 2)
    assert attention["trainable_params"] == 2 * 64 + 192 * 2 + 2 * 64 + 64 * 2
    assert attention["weights_grads_optimizer_mb"] < full["weights_grads_optimizer_mb"]
