"""train.py across processes: 2 CPU processes (gloo) under torchrun, with DDP and with FSDP2, must train exactly
like one process that does all the micro-batches itself, and write checkpoints any of them can resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_char_data

from gptkit import checkpoint as ckpt

REPO = Path(__file__).resolve().parent.parent
MAX_ITERS = 20


def args_for(data_dir: Path, out_dir: Path, accumulation: int, *extra: str) -> list[str]:
    settings = {
        "data_dir": data_dir, "out_dir": out_dir, "device": "cpu", "compile": False, "n_layer": 2, "n_head": 2,
        "n_embd": 32, "block_size": 32, "batch_size": 4, "gradient_accumulation_steps": accumulation,
        "dropout": 0.1, "max_iters": MAX_ITERS, "eval_interval": 10, "eval_iters": 5, "log_interval": 2,
        "learning_rate": 3e-3, "warmup_iters": 5, "lr_decay_iters": MAX_ITERS, "min_lr": 3e-4,
    }  # fmt: skip
    return [f"--{key}={value}" for key, value in settings.items()] + list(extra)


def run(args: list[str], processes: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable, str(REPO / "train.py")]
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                    str(REPO / "train.py")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*launcher, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result


def losses(out_dir: Path) -> list[tuple[int, str, float]]:
    """(iter, metric, value) for every logged loss, in order."""
    rows = []
    for line in (out_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows += [(record["iter"], key, record[key]) for key in ("train/loss", "val/loss") if key in record]
    return rows


def assert_same_curve(a: Path, b: Path) -> None:
    curve_a, curve_b = losses(a), losses(b)
    assert [row[:2] for row in curve_a] == [row[:2] for row in curve_b]
    assert len(curve_a) == MAX_ITERS // 2 + 2 * (MAX_ITERS // 10 + 1)
    for (_, _, value_a), (_, _, value_b) in zip(curve_a, curve_b):
        assert value_a == pytest.approx(value_b, abs=1e-4)


def assert_close_weights(a: Path, b: Path) -> None:
    weights_a = ckpt.load_checkpoint(a / "ckpt.pt")["model"]
    weights_b = ckpt.load_checkpoint(b / "ckpt.pt")["model"]
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        torch.testing.assert_close(weights_a[key], weights_b[key], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process with 4 micro-batches per step; 2 DDP processes and 2 FSDP processes with 2 each."""
    root = tmp_path_factory.mktemp("ddp")
    make_char_data(root / "data")
    outs = {name: root / name for name in ("single", "ddp", "fsdp")}
    run(args_for(root / "data", outs["single"], 4))
    ddp = run(args_for(root / "data", outs["ddp"], 4), processes=2)
    assert "2 process(es)" in ddp.stdout and ddp.stdout.count("done:") == 1  # only rank 0 reports
    run(args_for(root / "data", outs["fsdp"], 4, "--parallel=fsdp"), processes=2)
    return {**outs, "data": root / "data"}


def test_ddp_matches_one_process_with_twice_the_accumulation(runs: dict[str, Path]) -> None:
    assert_same_curve(runs["single"], runs["ddp"])
    assert_close_weights(runs["single"], runs["ddp"])
    assert sorted(p.name for p in runs["ddp"].iterdir()) == ["best.pt", "ckpt.pt", "log.jsonl", "summary.json"]


def test_fsdp_matches_ddp_and_saves_the_same_checkpoint_format(runs: dict[str, Path]) -> None:
    assert_same_curve(runs["ddp"], runs["fsdp"])
    assert_close_weights(runs["ddp"], runs["fsdp"])
    ddp_state = ckpt.load_checkpoint(runs["ddp"] / "ckpt.pt")
    fsdp_state = ckpt.load_checkpoint(runs["fsdp"] / "ckpt.pt")
    assert fsdp_state["optimizer"]["state"].keys() == ddp_state["optimizer"]["state"].keys()
    assert [g["params"] for g in fsdp_state["optimizer"]["param_groups"]] == [
        g["params"] for g in ddp_state["optimizer"]["param_groups"]
    ]


def test_checkpoints_move_between_fsdp_and_one_process(runs: dict[str, Path], tmp_path: Path) -> None:
    # The FSDP run continues in one process; the one-process run continues under FSDP: same result.
    more = ["--init_from=resume", f"--max_iters={MAX_ITERS + 4}", f"--lr_decay_iters={MAX_ITERS + 4}"]
    for source, processes, extra in (("fsdp", 1, []), ("single", 2, ["--parallel=fsdp"])):
        (tmp_path / source).mkdir()
        (tmp_path / source / "ckpt.pt").write_bytes((runs[source] / "ckpt.pt").read_bytes())
        run(args_for(runs["data"], tmp_path / source, 4, *more, *extra), processes=processes)
        assert ckpt.load_checkpoint(tmp_path / source / "ckpt.pt")["iter_num"] == MAX_ITERS + 4
    assert_close_weights(tmp_path / "fsdp", tmp_path / "single")
