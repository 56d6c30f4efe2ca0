"""benchmarks/bench_cpu_threads.py's smoke run: every case of the table is measured and written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_cpu_threads


@pytest.mark.heavy
def test_smoke_run_measures_every_case_idle_and_busy(tmp_path: Path, capsys) -> None:
    out = tmp_path / "threads.json"
    assert bench_cpu_threads.main(["--smoke=True", f"--json_out={out}"]) == 0
    result = json.loads(out.read_text())
    cases = {(row["load"], row["threads"], row["wait_policy"]) for row in result["rows"]}
    cores = result["machine"]["cpu_count"]
    expected = {
        (load, threads, wait) for load in ("idle", "busy") for threads in (1, cores) for wait in ("default", "PASSIVE")
    }
    assert cases == expected and result["busy_processes"] == cores
    assert all(row["step_ms"] > 0 for row in result["rows"])
    assert "wait_policy" in capsys.readouterr().out
