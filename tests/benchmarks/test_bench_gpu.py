"""benchmarks/bench_gpu.py: its smoke run (tiny sizes, on the CPU) finishes and writes every section."""

from __future__ import annotations

import json
from pathlib import Path

import bench
import bench_gpu
from helpers import REPO, assert_script_error, run_main, run_script, scripts_in_process

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
TINY_RECIPE = ["--max_iters=4", "--eval_interval=2", "--eval_iters=1", "--n_layer=1", "--n_head=2", "--n_embd=16"]
TINY_RECIPE += ["--block_size=16", "--batch_size=2", "--gradient_accumulation_steps=1", "--compile=False"]
# The figure each section is there for.
HEADLINE = {
    "cuda_tests": "exit_code",
    "matmul_peak": "tflops",
    "train": "tokens_per_s",
    "shakespeare_char": "val_loss_full",
    "sample": "tokens_per_s",
}


def test_smoke_run_writes_every_section(tmp_path: Path, char_data_dir: Path, capsys, monkeypatch) -> None:
    """bench_gpu.main in this process (the test below runs the script as a process), and train.py in it too; the
    CUDA tests still run in a pytest process of their own, as the benchmark starts them."""
    monkeypatch.chdir(REPO)  # the recipe is named relative to the repository, as a user in it names it
    scripts_in_process(monkeypatch, bench)
    json_out = tmp_path / "gpu.json"
    extra = [f"--char_extra={flag}" for flag in [f"--data_dir={char_data_dir}", *TINY_RECIPE, "--curves=False"]]
    args = [*SMOKE_FLAGS, *extra, f"--work_dir={tmp_path / 'work'}", f"--json_out={json_out}"]
    code, _, err = run_main(bench_gpu.main, args, capsys)
    assert code == 0, err
    report = json.loads(json_out.read_text())
    assert set(report) == {"benchmark", "settings", "machine", "results"} and report["benchmark"] == "gpu"
    sections = [row["section"] for row in report["results"]]
    assert sections == ["cuda_tests", "matmul_peak", "train", "shakespeare_char", "sample", "sample", "sample"]
    assert all(HEADLINE[row["section"]] in row for row in report["results"])
    sample_paths = {row["path"] for row in report["results"] if row["section"] == "sample"}
    assert sample_paths == {"auto", "eager_bf16", "hf"}


def test_refuses_a_non_gpu_device_without_smoke() -> None:
    result = run_script("benchmarks/bench_gpu.py", "--device=cpu", "--json_out=")
    assert_script_error(result, "not a CUDA GPU; use --smoke=True")
