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
# measure.MODEL_SHAPES["tiny"]: 2 blocks, 64 wide, MLP 256; per block c_attn (192, 64), attn.c_proj (64, 64),
# mlp.c_fc (256, 64), mlp.c_proj (64, 256): 49,152 weights in 576 rows, 1,536 groups of 32 along the rows
TINY_BASES = ["--shape=tiny", "--bases=True", "--block_size=16", "--batch_size=1", "--steps=1", "--rank=2"]
ALL_ADAPTERS = 2 * (ATTENTION_ADAPTERS + 2 * 64 + 256 * 2 + 2 * 256 + 64 * 2)
BASE_BYTES = {
    "bfloat16": 2 * 49152 * 2,  # 2 bytes a weight
    "int8": 2 * (49152 + 576 * 4),  # a byte a weight and a float32 scale a row
    "int4": 2 * 1536 * (16 + 2 + 2),  # a group: 32 codes of 4 bits, a float16 scale and minimum
}


def test_smoke_run_reports_every_mode(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "lora.json"
    scripts_in_process(monkeypatch, bench_lora)
    code, _, err = run_main(bench_lora.main, [*TINY, f"--json_out={out}"], capsys)
    assert code == 0, err
    rows = json.loads(out.read_text())["results"]
    assert [row["mode"] for row in rows] == list(bench_lora.MODES)
    full, attention = rows[0], rows[1]
    assert full["trainable_share"] == 1.0 and full["x_first_step_time"] == 1.0
    assert attention["trainable_params"] == ATTENTION_ADAPTERS
    assert attention["weights_grads_optimizer_mb"] < full["weights_grads_optimizer_mb"]
    assert all(row["step_ms_median"] > 0 and row["peak_rss_mb"] > 0 for row in rows)


def test_one_mode_runs_as_the_benchmark_starts_it() -> None:
    """A mode's own process prints its figures as the last line of JSON, which the benchmark reads."""
    result = run_script("benchmarks/bench_lora.py", "--mode=LoRA attention", *TINY, "--json_out=")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["mode"] == "LoRA attention" and row["rank"] == 2 and row["trainable_params"] == ATTENTION_ADAPTERS


def test_bases_run_holds_each_base_in_its_format(tmp_path: Path, capsys, monkeypatch) -> None:
    """--bases on a named shape: LoRA on all layers over a bfloat16, int8 and int4 base, each base's bytes as its
    format gives them, the same adapters over each."""
    out = tmp_path / "bases.json"
    scripts_in_process(monkeypatch, bench_lora)
    code, _, err = run_main(bench_lora.main, [*TINY_BASES, f"--json_out={out}"], capsys)
    assert code == 0, err
    rows = json.loads(out.read_text())["results"]
    assert [row["mode"] for row in rows] == bench_lora.BASE_MODES
    assert [row["adapted_base_bytes"] for row in rows] == list(BASE_BYTES.values())
    assert all(row["trainable_params"] == ALL_ADAPTERS and row["shape"] == "tiny" for row in rows)
    assert all(row["setup_peak_rss_mb"] > 0 and row["steady_rss_mb"] > 0 and row["step_ms_median"] > 0 for row in rows)
    assert rows[0]["x_first_step_time"] == 1.0


def test_an_unknown_shape_is_a_one_line_error(capsys) -> None:
    code, _, err = run_main(bench_lora.main, ["--shape=gpt5", "--json_out="], capsys)
    assert code == 2 and "smollm2-1.7b" in err
