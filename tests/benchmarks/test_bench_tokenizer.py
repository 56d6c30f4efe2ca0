"""benchmarks/bench_tokenizer.py at its smallest (one small vocabulary, a few sources, one training step): every
part of the report is written and the work files are removed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import bench_tokenizer
from helpers import assert_script_error, run_main, run_script, stdlib_sources

TINY = ["--held_out_every=4", "--vocab_sizes=300", "--model_vocab=300", "--val_fraction=0.3", "--seconds=0"]
TINY += ["--iters=1", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2"]


def test_smoke_run_writes_every_part(tmp_path: Path, capsys) -> None:
    """bench_tokenizer.main in this process (the test below runs the script as a process)."""
    stdlib = tmp_path / "lib"
    stdlib.mkdir()
    for path in stdlib_sources(every=1, max_bytes=100_000):
        shutil.copyfile(path, stdlib / path.name)
    work, out = tmp_path / "work", tmp_path / "tokenizer.json"
    work.mkdir()
    args = [f"--stdlib={stdlib}", *TINY, f"--tmp_dir={work}", f"--json_out={out}"]
    code, _, err = run_main(bench_tokenizer.main, args, capsys)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert set(report) == {"benchmark", "machine", "settings", "corpus", "training", "compression", "model"}
    assert [row["vocab_size"] for row in report["training"]] == [300]
    assert {"mb_per_s", "peak_rss_mb", "tiktoken_check"} <= set(report["training"][0])
    assert {row["tokenizer"] for row in report["compression"]} >= {"gpt2", "trained 300"}
    assert [row["tokenizer"] for row in report["model"]] == ["gpt2", "trained 300"]
    assert all("val_bits_per_byte" in row for row in report["model"])
    assert list(work.iterdir()) == []  # the corpus copy, tokenizers, data and checkpoints are gone


def test_bad_settings_are_refused() -> None:
    bad = run_script("benchmarks/bench_tokenizer.py", "--vocab_sizes=300", "--model_vocab=400")
    assert_script_error(bad, "must be one of --vocab_sizes")
