"""benchmarks/bench_chat.py at its smallest: both runs train, the packing figures are in range, the JSON is written."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_script


def test_smoke_run_compares_chat_with_plain_training(tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    # 2 rows of 64 tokens: the GPT-2 vocabulary's logits of the default 8 rows of 256 (400 MB) would dominate the run.
    tiny = ["--conversations=60", "--iters=2", "--repeats=1", "--n_layer=1", "--n_head=2", "--n_embd=16"]
    tiny += ["--block_size=64", "--batch_size=2"]
    result = run_script("benchmarks/bench_chat.py", *tiny, f"--work_dir={tmp_path / 'work'}", f"--json_out={out}")
    assert result.returncode == 0, result.stderr
    plain, chat = json.loads(out.read_text())["results"]
    assert plain["mode"] == "plain" and chat["mode"] == "chat" and plain["x_plain"] == 1.0
    assert chat["tokens_per_s_median"] > 0 and 0 <= chat["padding_share"] < 1 and 0 < chat["trained_share"] < 1
