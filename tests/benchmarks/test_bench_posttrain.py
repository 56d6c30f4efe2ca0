"""benchmarks/bench_posttrain.py: the task it makes, and the whole pipeline at its smallest (SFT, GRPO, DPO, the
rollout comparison, whose batched and one-at-a-time completions must be the same tokens), run in this process with
the scripts it starts (prepare_data/chat.py, train.py, eval.py, prepare_data/preferences.py) called in it too; the
script itself runs as a process below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_posttrain
from helpers import assert_script_error, run_main, run_script, scripts_in_process


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_task_files(tmp_path: Path) -> None:
    cfg = bench_posttrain.PosttrainBench(held_out=50, suffix_share=0.5)
    bench_posttrain.make_task(cfg, tmp_path)
    sft, rl, held = read(tmp_path / "sft.jsonl"), read(tmp_path / "rl.jsonl"), read(tmp_path / "held.jsonl")
    assert (len(sft), len(rl), len(held)) == (1500, 1100, 50)
    words = [r["prompt"] for r in sft + rl + held]
    assert len(set(words)) == len(words)  # held-out words are never trained on
    assert all(r["completion"].rstrip(".") == r["prompt"][::-1] for r in sft)
    dotted = sum(r["completion"].endswith(".") for r in sft) / len(sft)
    assert 0.45 < dotted < 0.55
    assert all(r["answer"] == r["prompt"][::-1] for r in rl + held)
    pairs = read(tmp_path / "pairs.jsonl")
    assert all(p["chosen"] == p["prompt"][::-1] and p["rejected"] != p["chosen"] for p in pairs)
    assert all(sorted(p["rejected"]) == sorted(p["prompt"]) for p in pairs)  # a near miss: the same letters


@pytest.mark.heavy
def test_smoke_run(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "posttrain.json"
    tiny = ["--sft_iters=5", "--grpo_iters=2", "--grpo_prompts=2", "--group_size=2", "--dpo_iters=2", "--held_out=8"]
    tiny += ["--throughput_prompts=1", "--repeats=1"]
    scripts_in_process(monkeypatch, bench_posttrain)
    code, _, err = run_main(bench_posttrain.main, [*tiny, f"--work_dir={tmp_path / 'w'}", f"--json_out={out}"], capsys)
    assert code == 0, err
    grpo, dpo, rollouts = json.loads(out.read_text())["results"]
    assert 0 <= grpo["before"] <= 1 and 0 <= grpo["after"] <= 1
    assert dpo["before"] == 0.5  # the starting model is its own reference
    assert rollouts["before"] > 0 and rollouts["after"] > 0


def test_bad_settings_are_refused_by_the_script() -> None:
    assert_script_error(
        run_script("benchmarks/bench_posttrain.py", "--group_size=0"), "group_size must be a positive integer"
    )
