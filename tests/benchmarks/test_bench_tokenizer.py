"""benchmarks/bench_tokenizer.py at its smallest (one small vocabulary, a few sources, one training step): every
part of the report is written and the work files are removed."""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import time
from pathlib import Path

import pytest

import bench_prepare
import bench_tokenizer
from gptkit.core.errors import run_cli
from helpers import REPO, assert_script_error, run_main, run_script, script_main, stdlib_sources

TINY = ["--held_out_every=4", "--vocab_sizes=300", "--model_vocab=300", "--val_fraction=0.3", "--seconds=0"]
TINY += ["--iters=1", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2"]


def measured_in_process(command: list[str], log_path: Path) -> bench_prepare.Run:
    """bench_prepare.run_measured for a repository script (`[python, script, args...]`) called in this process: its
    main through run_cli, its output in `log_path`; the figures are this process's (a tree's RSS is not sampled)."""
    started, code = time.perf_counter(), 0
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            with contextlib.chdir(REPO):
                run_cli(script_main(command[1]), command[2:])
        except SystemExit as exit_info:
            code = exit_info.code or 0
    seconds, output = time.perf_counter() - started, log_path.read_text()
    assert code == 0, output
    rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return bench_prepare.Run(
        seconds=seconds, cpu_seconds=seconds, max_rss_bytes=rss_bytes, tree_rss_bytes=0, stdout=output
    )


@pytest.mark.gpt2_bpe
@pytest.mark.heavy  # train.py and corpus.py in this process
def test_smoke_run_writes_every_part(tmp_path: Path, capsys, monkeypatch) -> None:
    """bench_tokenizer.main in this process, and the scripts it measures too (the test below runs bench_tokenizer.py
    as a process; bench_prepare's smoke run measures real processes)."""
    monkeypatch.setattr(bench_tokenizer, "run_measured", measured_in_process)
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
