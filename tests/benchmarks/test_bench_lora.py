"""benchmarks/bench_lora.py at its smallest: every mode trains in its own process and is reported."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_script


def test_smoke_run_reports_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    tiny = ["--n_layer=1", "--n_embd=64", "--block_size=16", "--batch_size=1", "--steps=1", "--rank=2"]
    result = run_script("benchmarks/bench_lora.py", *tiny, f"--json_out={out}")
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["results"]
    assert [row["mode"] for row in rows][:2] == ["full fine-tuning", "LoRA attention"]
    full, attention = rows[0], rows[1]
    assert full["trainable_share"] == 1.0 and full["x_full_step_time"] == 1.0
    # rank 2 on one block's attention: c_attn A (2, 64) + B (192, 2), c_proj A (2, 64) + B (64, 2)
    assert attention["trainable_params"] == 2 * 64 + 192 * 2 + 2 * 64 + 64 * 2
    assert attention["weights_grads_optimizer_mb"] < full["weights_grads_optimizer_mb"]
