"""bench_tokenizer.py at tiny sizes: every figure is produced, and the work files are removed."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

import bench_tokenizer
from gptkit.core.errors import UserError
from helpers import stdlib_sources


def test_every_figure_at_tiny_sizes(tmp_path: Path) -> None:
    stdlib = tmp_path / "lib"
    (stdlib / "site-packages").mkdir(parents=True)
    for path in stdlib_sources(every=1, max_bytes=250_000):
        shutil.copyfile(path, stdlib / path.name)
    (stdlib / "site-packages" / "left_out.py").write_text("x = 1\n")
    work, out = tmp_path / "work", tmp_path / "tokenizer.json"
    work.mkdir()
    argv = [
        f"--stdlib={stdlib}",
        "--held_out_every=4",
        "--vocab_sizes=300",
        "--vocab_sizes=400",
        "--model_vocab=300",
        "--val_fraction=0.3",
        "--seconds=0",
        "--iters=2",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--block_size=16",
        "--batch_size=2",
        f"--tmp_dir={work}",
        f"--json_out={out}",
    ]
    assert bench_tokenizer.main(argv) == 0
    report = json.loads(out.read_text())
    assert [row["vocab_size"] for row in report["training"]] == [300, 400]
    for row in report["training"]:
        assert (
            row["mb_per_s"] > 0 and row["peak_rss_mb"] > 0 and row["tiktoken_check"]["texts_encoded_differently"] == 0
        )
    ratios = {row["tokenizer"]: row["bytes_per_token"] for row in report["compression"]}
    assert ratios["trained 400"] > ratios["trained 300"] > 1 and ratios["gpt2"] > 1
    assert [row["tokenizer"] for row in report["model"]] == ["gpt2", "trained 300"]
    for row in report["model"]:
        assert row["iters"] == 2 and math.isfinite(row["val_bits_per_byte"]) and row["val_bits_per_byte"] > 0
    assert list(work.iterdir()) == []  # the corpus copy, tokenizers, data and checkpoints are gone


def test_bad_settings_are_refused() -> None:
    with pytest.raises(UserError, match="must be one of --vocab_sizes"):
        bench_tokenizer.main(["--vocab_sizes=300", "--model_vocab=400"])
    with pytest.raises(UserError, match="--seconds"):
        bench_tokenizer.main(["--seconds=0"])
