"""Tests for gptkit/train/runlog.py: the exact lines a training run prints (scripts and people parse them), log.jsonl,
and the optional wandb run."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest

from gptkit.core.errors import UserError
from gptkit.train import runlog
from gptkit.train.runlog import RunLog

EVAL = {"iter": 10, "train/loss": 4.07681, "val/loss": 4.07072, "val/bpb": 5.87271}


def test_lines_keep_their_formats() -> None:
    # Each expected line is one the toolkit printed before these helpers existed.
    assert runlog.header_line(31_000, "cpu", "float32", 1, "128 tokens per step", "/tmp/data") == (
        "0.03M parameters | cpu float32 | 1 process(es) | 128 tokens per step | data /tmp/data"
    )
    assert runlog.eval_line({**EVAL, "iter": 0}) == "step 0: train loss 4.0768 | val loss 4.0707 | val bpb 5.8727"
    saved = runlog.saved_note(Path("/o/ckpt.pt"), Path("/o/best.pt"))
    assert runlog.eval_line(EVAL, saved) == (
        "step 10: train loss 4.0768 | val loss 4.0707 | val bpb 5.8727 | saved /o/ckpt.pt and /o/best.pt"
    )
    assert runlog.eval_line({**EVAL, "val/bpb": None}, runlog.saved_note(Path("/o/ckpt.pt"))) == (
        "step 10: train loss 4.0768 | val loss 4.0707 | saved /o/ckpt.pt"
    )
    # GRPO without held-out prompts has no figure: the line says so, or names the save alone
    grpo = {"iter": 0, "train/loss": None, "val/loss": None, "val/bpb": None}
    assert runlog.eval_line(grpo) == "step 0: no figures to evaluate"
    assert runlog.eval_line({**grpo, "iter": 2}, runlog.saved_note(Path("/o/ckpt.pt"))) == "step 2: saved /o/ckpt.pt"
    assert runlog.eval_line({**grpo, "val/pass@1": 0.25}) == "step 0: val pass@1 0.2500"
    entry = {"iter": 5, "train/loss": 4.07771, "lr": 1.8e-06, "mfu": None, "tokens_per_s": 18_690.3}
    assert runlog.progress_line(entry, 0.00684) == (
        "iter 5: loss 4.0777 | lr 1.80e-06 | 6.8 ms/iter | 18,690 tok/s | mfu n/a"
    )
    assert runlog.progress_line({**entry, "mfu": 0.4567}, 0.00684).endswith(" | mfu 45.7%")
    assert runlog.estimate_line(4, EVAL) == (
        "eval (4 batches per split): train loss 4.0768 | val loss 4.0707 | val bpb 5.8727"
    )
    assert runlog.full_split_line(111_540, 1.67749, None) == "eval (whole val split, 111,540 tokens): val loss 1.6775"
    assert runlog.stopped_line("SIGTERM", 37, " | saved o/ckpt.pt") == (
        "stopped by SIGTERM after 37 steps | saved o/ckpt.pt; continue with --init_from=resume"
    )
    assert runlog.stopped_line(None, 37, "").startswith("stopped by a signal to another process after 37 steps")
    assert runlog.stopped_line("SIGINT", 0, None) == (
        "stopped by SIGINT after 0 steps, before this run trained one: nothing saved"
    )
    assert (
        runlog.resumed_line(150, Path("o/ckpt.pt"), 1.23456)
        == "resumed from step 150 of o/ckpt.pt (best val loss 1.2346)"
    )
    assert runlog.resumed_line(8, Path("o/ckpt.pt"), math.inf) == "resumed from step 8 of o/ckpt.pt"  # GRPO: no loss
    assert runlog.replaced_line(Path("o"), ["ckpt.pt", "log.jsonl"]) == (
        "replaced the earlier run in o: removed ckpt.pt, log.jsonl"
    )
    assert runlog.done_line(20, 4.06931, Path("out")) == "done: 20 iters, best val loss 4.0693, checkpoints in out"
    assert runlog.done_line(2, 0.69312, Path("o"), best_saved=False) == (
        "done: 2 iters, best val loss 0.6931 (the weights it began from, not saved: ckpt.pt holds the last step), "
        "checkpoints in o"
    )


def test_rank_0_prints_and_appends_to_log_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_dir = tmp_path / "new" / "out"
    log = RunLog(master=True, out_dir=out_dir)
    log.say("hello")
    log.record(EVAL)
    log.close()
    resumed = RunLog(master=True, out_dir=out_dir)  # a resumed run adds to the same file
    resumed.record({"iter": 11, "train/loss": 4.0, "lr": 1e-3, "mfu": None, "tokens_per_s": 10.0})
    resumed.close()
    assert capsys.readouterr().out == "hello\n"
    entries = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    assert entries == [EVAL, {"iter": 11, "train/loss": 4.0, "lr": 1e-3, "mfu": None, "tokens_per_s": 10.0}]


@pytest.mark.parametrize("cut", ['{"iter": 12, "train/lo', "{", '{"iter": 12, "text": "' + "x" * 70_000])
def test_a_resumed_run_drops_a_record_cut_short_before_it_appends(tmp_path: Path, cut: str) -> None:
    """A full disk or a kill left half a line: the resumed run's first record starts a line of its own."""
    first = {"iter": 11, "train/loss": 4.0}
    (tmp_path / "log.jsonl").write_text(json.dumps(EVAL) + "\n" + json.dumps(first) + "\n" + cut)
    log = RunLog(master=True, out_dir=tmp_path)
    log.record({"iter": 12, "train/loss": 3.5})
    log.close()
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [EVAL, first, {"iter": 12, "train/loss": 3.5}]
    (tmp_path / "log.jsonl").write_text(cut)  # no whole line at all
    RunLog(master=True, out_dir=tmp_path).close()
    assert (tmp_path / "log.jsonl").read_bytes() == b""


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path: Path) -> None:
    (tmp_path / "log.jsonl").write_text(json.dumps(EVAL) + "\n" + json.dumps({"iter": 11, "train/loss": 4.0}))
    log = RunLog(master=True, out_dir=tmp_path)
    log.record({"iter": 12, "train/loss": 3.5})
    log.close()
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["iter"] for line in lines] == [EVAL["iter"], 11, 12]


def test_other_ranks_and_evaluation_runs_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for log in (RunLog(master=False, out_dir=tmp_path / "a"), RunLog(master=True, out_dir=None)):
        log.record(EVAL)
        log.close()
    RunLog(master=False, out_dir=tmp_path / "b").say("not printed")
    RunLog(master=True).say("printed")
    assert capsys.readouterr().out == "printed\n"
    assert list(tmp_path.iterdir()) == []


def test_wandb_gets_the_config_and_each_record_at_its_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    class FakeRun:
        def log(self, values: dict, step: int) -> None:
            calls.append(("log", values, step))

        def finish(self) -> None:
            calls.append(("finish",))

    def init(**kwargs: object) -> FakeRun:
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_DIR", raising=False)
    log = RunLog(True, tmp_path, wandb={"project": "p", "name": None, "config": {"lr": 1.0}})
    log.record({"iter": 3, "train/loss": 2.0, "mfu": None})
    log.close()
    assert calls == [
        ("init", {"project": "p", "name": None, "config": {"lr": 1.0}, "dir": str(tmp_path)}),
        ("log", {"train/loss": 2.0}, 3),  # no iter (it is the step) and no unknown values
        ("finish",),
    ]


def test_wandb_problems_are_one_line_user_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(UserError, match="needs the wandb package: pip install wandb"):
        runlog.start_wandb("p", None, {}, str(tmp_path))

    def init(**kwargs: object) -> None:
        raise RuntimeError("api key not configured")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with pytest.raises(UserError, match=r"wandb could not start \(RuntimeError: api key not configured\); run `wandb"):
        runlog.start_wandb("p", None, {}, str(tmp_path))
