"""benchmarks/bench_gpu.py: the smoke run (tiny sizes, on the CPU) goes through every section and writes them all."""

from __future__ import annotations

import json
from pathlib import Path

import bench_gpu
from helpers import run_main

SMOKE_FLAGS = [
    "--device=cpu",
    "--smoke=True",
    "--batch_size=2",
    "--accumulation=1",
    "--train_iters=4",
    "--warmup_iters=1",
    "--compile=False",
    "--sample_batches=1",
    "--sample_tokens=4",
    "--char_config=config/train_shakespeare_char_cpu.py",
    "--prepare_char=False",
]
TINY_RECIPE = [
    "--max_iters=4",
    "--eval_interval=2",
    "--eval_iters=1",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=16",
    "--block_size=16",
    "--batch_size=2",
    "--gradient_accumulation_steps=1",
    "--compile=False",
    "--curves=False",
]


def test_smoke_run_measures_every_section(tmp_path: Path, char_data_dir: Path, capsys) -> None:
    json_out = tmp_path / "gpu.json"
    extra = [f"--char_extra={flag}" for flag in [f"--data_dir={char_data_dir}", *TINY_RECIPE]]
    args = [*SMOKE_FLAGS, *extra, f"--work_dir={tmp_path / 'work'}", f"--json_out={json_out}"]
    code, out, err = run_main(bench_gpu.main, args, capsys)
    assert code == 0, err
    rows = json.loads(json_out.read_text())["results"]
    sections = {row["section"]: row for row in rows}
    assert set(sections) == {"cuda_tests", "matmul_peak", "train", "shakespeare_char", "sample"}
    tests = sections["cuda_tests"]
    assert tests["exit_code"] == 0 and tests.get("failed", 0) == 0
    assert tests.get("skipped", 0) + tests.get("passed", 0) >= 8  # every test of tests/test_cuda.py was collected
    assert sections["matmul_peak"]["tflops"] > 0
    train = sections["train"]
    assert train["tokens_per_s"] > 0 and train["mfu_measured_peak"] > 0 and train["mfu_datasheet"] is None
    assert 0 < sections["shakespeare_char"]["val_loss_full"] < 10
    sample_paths = {row["path"] for row in rows if row["section"] == "sample"}
    assert sample_paths == {"auto", "eager_bf16", "hf"}
    assert "tokens_per_s" in out


def test_refuses_a_non_gpu_device_without_smoke(capsys) -> None:
    code, _, err = run_main(bench_gpu.main, ["--device=cpu", "--json_out="], capsys)
    assert code == 2 and "not a CUDA GPU; use --smoke=True" in err
