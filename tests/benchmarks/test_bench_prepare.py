"""benchmarks/bench_prepare.py: its smallest run (1 MB, one run each, a tiny memory check) finishes, writes both
parts and removes its work files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import bench_prepare
from helpers import assert_script_error, run_main, run_script, sample_text

needs_gpt2_bpe = pytest.mark.skipif(
    not os.environ.get("TIKTOKEN_CACHE_DIR"), reason="GPT-2 BPE files needed offline (../shared/tiktoken_cache)"
)
ROW_KEYS = {"name", "tokens", "tokens_per_s", "mb_per_s", "median_s", "median_cpu_s", "runs_s", "max_process_rss_mb"}


@needs_gpt2_bpe
def test_smoke_run_writes_the_speed_comparison_and_the_memory_check(tmp_path: Path, capsys) -> None:
    """bench_prepare.main in this process (the runs it measures are processes; the test below starts the script)."""
    source = tmp_path / "source.txt"
    source.write_text(sample_text(), encoding="utf-8")
    out = tmp_path / "prepare.json"
    args = ["--size_mb=1", "--runs=1", "--num_workers=2", "--memory_check_gb=0.001", f"--source={source}"]
    code, _, err = run_main(bench_prepare.main, [*args, f"--tmp_dir={tmp_path}", f"--json_out={out}"], capsys)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert {"benchmark", "machine", "results", "speedup_vs_reference", "memory_check"} <= set(report)
    names = [row["name"] for row in report["results"]]
    assert names == ["reference: 1 process encode_ordinary", "corpus.py --num_workers=1", "corpus.py --num_workers=2"]
    assert all(set(row) >= ROW_KEYS for row in report["results"])
    assert {"tokens", "tokens_per_s", "max_process_rss_mb"} <= set(report["memory_check"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepare.json", "source.txt"]  # work files removed


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    assert_script_error(run_script("benchmarks/bench_prepare.py", "--runs=0", f"--tmp_dir={tmp_path}"), "--runs")
    assert list(tmp_path.iterdir()) == []
