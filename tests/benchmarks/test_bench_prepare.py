"""bench_prepare.py: the reference loop and corpus.py run on the same generated corpus and agree on its tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import bench_prepare
from gptkit.core.errors import UserError
from helpers import sample_text

needs_gpt2_bpe = pytest.mark.skipif(
    not os.environ.get("TIKTOKEN_CACHE_DIR"), reason="GPT-2 BPE files needed offline (../shared/tiktoken_cache)"
)


@needs_gpt2_bpe
def test_speed_comparison_and_memory_check_on_a_small_corpus(tmp_path: Path):
    source = tmp_path / "source.txt"
    source.write_text(sample_text(), encoding="utf-8")
    out = tmp_path / "prepare.json"
    argv = [
        "--size_mb=1",
        "--runs=1",
        "--num_workers=2",
        "--memory_check_gb=0.002",
        f"--source={source}",
        f"--tmp_dir={tmp_path}",
        f"--json_out={out}",
    ]
    assert bench_prepare.main(argv) == 0
    report = json.loads(out.read_text())
    reference, one_worker, two_workers = report["results"]
    assert one_worker["tokens"] == two_workers["tokens"]  # the worker count never changes the tokens
    # corpus.py adds an end-of-text token per document; the reference loop adds none.
    assert reference["tokens"] < one_worker["tokens"] <= reference["tokens"] + 2
    assert report["speedup_vs_reference"] == pytest.approx(reference["median_s"] / two_workers["median_s"], abs=0.01)
    assert report["input_bytes"] >= 10**6 and report["memory_check"]["tokens"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepare.json", "source.txt"]  # work files removed


def test_bad_settings_are_refused(tmp_path: Path):
    with pytest.raises(UserError, match="--runs"):
        bench_prepare.main(["--runs=0", f"--tmp_dir={tmp_path}"])
