"""benchmarks/bench_chat.py at its smallest: both runs train, the packing figures are in range, the JSON is written.
The smoke run calls its main and train.py's in this process; the script runs as a process in the refusal test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_chat
from helpers import assert_script_error, run_main, run_script, scripts_in_process


@pytest.mark.gpt2_bpe
def test_smoke_run_compares_chat_with_plain_training(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "chat.json"
    # 2 rows of 64 tokens: the GPT-2 vocabulary's logits of the default 8 rows of 256 (400 MB) would dominate the run.
    tiny = ["--conversations=60", "--iters=2", "--repeats=1", "--n_layer=1", "--n_head=2", "--n_embd=16"]
    tiny += ["--block_size=64", "--batch_size=2"]
    scripts_in_process(monkeypatch, bench_chat)
    code, _, err = run_main(bench_chat.main, [*tiny, f"--work_dir={tmp_path / 'work'}", f"--json_out={out}"], capsys)
    assert code == 0, err
    plain, chat = json.loads(out.read_text())["results"]
    assert plain["mode"] == "plain" and chat["mode"] == "chat" and plain["x_plain"] == 1.0
    assert chat["tokens_per_s_median"] > 0 and 0 <= chat["padding_share"] < 1 and 0 < chat["trained_share"] < 1


def test_bad_settings_are_refused_by_the_script() -> None:
    assert_script_error(run_script("benchmarks/bench_chat.py", "--iters=0"), "iters must be a positive integer")
