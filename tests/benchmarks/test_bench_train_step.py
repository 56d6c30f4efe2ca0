"""benchmarks/bench_train_step.py: its smoke run (a tiny model on the CPU, one step) profiles a training step and
writes the whole step, the groups of the table and the operators by name."""

from __future__ import annotations

import json
from pathlib import Path

import bench_train_step
from helpers import assert_script_error, run_in_process, run_script

SMOKE = ["--device=cpu", "--smoke=True", "--compile=False", "--dtype=float32", "--warmup=1", "--steps=1"]
GROUPS = {"matrix products", "attention", "optimizer", "device idle (no kernel running)"}


def test_smoke_run_profiles_a_training_step(tmp_path: Path) -> None:
    out = tmp_path / "train_step.json"
    result = run_script("benchmarks/bench_train_step.py", *SMOKE, f"--json_out={out}")
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"benchmark", "settings", "machine", "results"} and report["benchmark"] == "train_step"
    whole, *rows = report["results"]
    assert whole["part"] == "whole step (not profiled)" and {"ms", "tokens_per_s", "mfu_datasheet"} <= set(whole)
    groups = {row["part"] for row in rows if not row["part"].startswith("  ")}
    assert groups >= GROUPS and all({"ms", "share"} <= set(row) for row in rows)
    assert any(row["part"].strip() == "aten::mm" for row in rows)  # operators by name after the groups


def test_refuses_a_cpu_without_smoke(capsys) -> None:
    result = run_in_process(bench_train_step.main, ["--device=cpu", "--json_out="], capsys)  # the smoke run: a process
    assert_script_error(result, "not a CUDA GPU; use --smoke=True")
