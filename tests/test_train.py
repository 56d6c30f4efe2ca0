"""Tests for train.py in one process: settings and recipes, a real run, exact resume after SIGTERM, signals during
an evaluation, a compilation and a long run, failures (bad settings, NaN loss), fine-tuning a Hugging Face GPT-2
directory, eval_only and wandb offline.

The multi-process runs (DDP, FSDP) are in test_train_ddp.py; kill -9 at seeded moments in test_reliability_train.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import train
from gptkit.core.errors import UserError
from gptkit.core.settings import parse_settings
from gptkit.model import GPT, GPTConfig
from gptkit.train import loop, models
from gptkit.weights import checkpoint as ckpt
from gptkit.weights.hf import write_hf
from helpers import (
    REPO,
    TINY_MODEL,
    assert_script_error,
    clean_env,
    cli_args,
    make_char_data,
    run_in_process,
    run_script,
    tiny_train_args,
)

MAX_ITERS = 150  # long enough after the first checkpoint (step 10) for a kill to land mid-run
# This file's runs: a 2-layer, 32-wide model on 32-character windows, 2 micro-batches of 4 per step, dropout on.
RUN = {
    **TINY_MODEL,
    "batch_size": 4,
    "gradient_accumulation_steps": 2,
    "dropout": 0.1,
    "max_iters": MAX_ITERS,
    "eval_interval": 10,
    "eval_iters": 4,
    "log_interval": 5,
    "learning_rate": 3e-3,
    "warmup_iters": 5,
    "lr_decay_iters": MAX_ITERS,
    "min_lr": 3e-4,
}
UNBUFFERED = clean_env(PYTHONUNBUFFERED="1")  # lines arrive as they are printed


def start_train(args: list[str]) -> subprocess.Popen:
    """train.py in a subprocess that the test can signal or kill while it runs."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=REPO,
        env=UNBUFFERED,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_checkpoint(process: subprocess.Popen, path: Path, min_iter: int) -> int:
    """Poll until `path` holds a checkpoint of at least `min_iter` steps; returns its iter_num.

    Checkpoints are written atomically, so any file seen here is complete.
    """
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, "training ended before a checkpoint could be observed"
        if path.exists():
            iter_num = torch.load(path, weights_only=True)["iter_num"]
            if iter_num >= min_iter:
                return iter_num
        time.sleep(0.005)
    raise AssertionError(f"no checkpoint with iter_num >= {min_iter} in {path}")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="session")  # read only, made in a blink: the tests using it alone need not share a process
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("char_data")
    make_char_data(directory)
    return directory


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted run of the tiny config (in this process: one thread, like the children), started from an
    empty working directory; (its out_dir, its stdout)."""
    out_dir = tmp_path_factory.mktemp("reference") / "out"
    cwd = tmp_path_factory.mktemp("cwd")
    stdout = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(stdout):
            assert train.main(tiny_train_args(data_dir, out_dir, **RUN)) == 0
    finally:
        torch.set_num_threads(threads)
    assert list(cwd.iterdir()) == []  # everything went under out_dir
    return out_dir, stdout.getvalue()


# ----------------------------------------------------------------------------- settings and recipes


def test_help_lists_every_setting(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for field in dataclasses.fields(train.TrainSettings):
        assert f"--{field.name}  (" in text


RECIPES = sorted((REPO / "config").glob("*.py"))
CPU_RECIPE_NAMES = (
    "train_shakespeare_char_cpu",
    "train_shakespeare_char_cpu_best",
    "speedrun_shakespeare_char_cpu",
    "train_corpus_cpu",
    "train_shakespeare_char_llama_cpu",
)
CPU_RECIPES = [REPO / "config" / f"{name}.py" for name in CPU_RECIPE_NAMES]


def load_recipe(path: Path) -> train.TrainSettings:
    """The recipe's settings, with the starting model or prompts its own command line gives (DPO, GRPO)."""
    given = re.findall(r"--(?:init_from|grpo_prompts)=\S+", path.read_text())
    return parse_settings(train.TrainSettings, [str(path), *given], "train.py", "", config_files=True)


def prepared_datasets() -> set[str]:
    """The data directories the preparation scripts write by default (data/NAME), by NAME."""
    scripts = [*(REPO / "prepare_data").glob("*.py"), *(REPO / "gptkit" / "data" / "prepare").glob("*.py")]
    return {m for path in scripts for m in re.findall(r'out_dir: str = setting\(\s*"data/(\w+)"', path.read_text())}


def test_the_recipes_the_readme_names_exist() -> None:
    named = set(re.findall(r"config/(\w+\.py)", (REPO / "README.md").read_text()))
    assert named >= {path.name for path in CPU_RECIPES}
    assert named <= {path.name for path in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_each_recipe_is_valid_and_keeps_the_promises_of_its_text(recipe: Path) -> None:
    cfg = load_recipe(recipe)  # every value checked, the model's shape by GPTConfig
    text = recipe.read_text()
    # The data a recipe names is what a preparation script writes by default (prepare, then train, as documented);
    # a recipe for the user's own data says to give it.
    assert cfg.data_dir is None and (cfg.dataset in prepared_datasets() or "--data_dir=" in text)
    if cfg.eval_only:
        assert cfg.init_from != "scratch"  # evaluating an untrained model means nothing
    # The tokens per step that the text states are what the settings give.
    tokens_per_step = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    for stated in re.findall(r"(\d[\d,]*) tokens per step|= (\d[\d,]*) tokens", text):
        assert int("".join(stated).replace(",", "")) == tokens_per_step
    for millions in re.findall(r"~(\d+(?:\.\d+)?)M tokens per step", text):
        assert float(millions) * 1e6 == pytest.approx(tokens_per_step, rel=0.1)
    # A documented torchrun command must be able to divide the micro-batches among its processes.
    for processes in re.findall(r"--nproc_per_node=(\d+)", text):
        assert cfg.gradient_accumulation_steps % int(processes) == 0


def test_some_recipes_state_their_step_size() -> None:
    # The check above would pass vacuously if the texts stopped matching its patterns.
    stated = [p.name for p in RECIPES if re.search(r"\d[\d,]* tokens per step|= \d[\d,]* tokens", p.read_text())]
    assert {"train_gpt2.py", "finetune_shakespeare.py"} <= set(stated)


@pytest.mark.heavy
@pytest.mark.parametrize("recipe", CPU_RECIPES, ids=lambda path: path.name)
def test_cpu_recipe_trains_on_shakespeare_chars_in_a_few_steps(
    recipe: Path, char_data_dir: Path, tmp_path: Path
) -> None:
    """The CPU recipes as they are, but 12 steps (in float32: bfloat16 is slow on CPUs without AMX/AVX512-BF16) and no
    curves.png (its drawing is checked where curves are what a test is about: test_plot.py, tests/eval)."""
    out_dir = tmp_path / "out"
    flags = cli_args(
        data_dir=char_data_dir, out_dir=out_dir, max_iters=12, lr_decay_iters=12, eval_interval=12, curves=False
    )
    assert train.main([str(recipe), *flags, "--eval_iters=4", "--dtype=float32", "--cpu_threads=1"]) == 0
    cfg = load_recipe(recipe)
    state = ckpt.load_checkpoint(out_dir / "ckpt.pt")
    args = state["model_args"]
    assert (args["n_layer"], args["n_embd"], args["block_size"], args["pos_encoding"]) == (
        cfg.n_layer,
        cfg.n_embd,
        cfg.block_size,
        cfg.pos_encoding,
    )
    evals = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    evals = [entry for entry in evals if "val/loss" in entry]
    assert [entry["iter"] for entry in evals] == [0, 12]
    assert evals[1]["val/loss"] < 0.8 * evals[0]["val/loss"]  # it learns: 4.1 (uniform) to about 2.8
    summary = json.loads((out_dir / "summary.json").read_text())
    if cfg.eval_full_split:  # the Shakespeare recipes (a corpus of one's own may have a val split of any size)
        assert summary["val_loss_full"] == pytest.approx(summary["val_loss"], abs=0.3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--learning_rate=-1"], "learning_rate must be a positive number"),
        (["--n_embd=30", "--n_head=4"], r"n_embd \(30\) must be divisible by n_head \(4\)"),
        (["--block_size=100000"], r"fewer than block_size\+1 = 100001"),
        (["--dtype=float8"], "dtype='float8' is not one of"),
        (["--init_from=resume"], "ckpt.pt does not exist"),
        (["--data_dir=/nonexistent/data"], "no meta.json in /nonexistent/data"),
    ],
)
def test_impossible_settings_fail_before_training(data_dir: Path, tmp_path: Path, flags: list, message: str) -> None:
    with pytest.raises(UserError, match=message):
        train.main([*tiny_train_args(data_dir, tmp_path / "out", **RUN), *flags])
    assert not (tmp_path / "out").exists()


def test_an_unset_schedule_follows_max_iters(data_dir: Path, tmp_path: Path) -> None:
    """README's chat command gives --max_iters=1000 and no warmup: the rate must still reach its peak."""
    out_dir = tmp_path / "out"
    flags = tiny_train_args(data_dir, out_dir, max_iters=20, log_interval=1, learning_rate=1e-3, min_lr=1e-4)
    assert train.main(flags) == 0
    entries = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    rates = {entry["iter"]: entry["lr"] for entry in entries if "lr" in entry}
    # By hand: a warmup of 20 // 10 = 2 steps (lr * (it + 1) / 3), then the cosine from step 2 down to step 20.
    expected = {0: 1e-3 / 3, 1: 2e-3 / 3}
    expected |= {it: 1e-4 + 0.5 * (1 + math.cos(math.pi * (it - 2) / 18)) * 9e-4 for it in range(2, 20)}
    assert rates == pytest.approx(expected)


def test_a_warmup_longer_than_the_run_is_shortened_to_fit_and_said(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A recipe shortened with --max_iters keeps its warmup_iters=30: the rate must still reach its peak."""
    out_dir = tmp_path / "out"
    flags = tiny_train_args(data_dir, out_dir, max_iters=20, warmup_iters=30, log_interval=1, learning_rate=1e-3)
    result = run_in_process(train.main, flags, capsys)
    assert result.returncode == 0, result.stderr
    assert (
        "warmup_iters=30 does not end before max_iters=20: warming up over 2 steps instead (a tenth of max_iters), "
        "so the learning rate reaches its peak"
    ) in result.stdout.splitlines()
    entries = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    rates = [entry["lr"] for entry in entries if "lr" in entry]
    assert rates[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])  # lr * (it + 1) / (2 + 1), then the peak


def test_user_error_is_one_line_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    result = run_in_process(train.main, ["--data_dir", tmp_path / "missing", "--out_dir", tmp_path / "out"], capsys)
    assert assert_script_error(result).startswith("error: no meta.json")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- a real run and its checkpoints


@pytest.mark.heavy  # the reference run
def test_run_logs_learns_and_writes_complete_checkpoints(reference: tuple, data_dir: Path) -> None:
    out_dir, stdout = reference
    lines = stdout.splitlines()
    assert any(line.startswith("iter 0: loss ") and "ms/iter" in line and "mfu n/a" in line for line in lines)
    assert any(line.startswith("step 10: train loss") and "val bpb" in line for line in lines)
    assert lines[-1].startswith(f"done: {MAX_ITERS} iters")
    assert sorted(p.name for p in out_dir.iterdir()) == ["best.pt", "ckpt.pt", "log.jsonl", "summary.json"]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["iters"] == MAX_ITERS and summary["train_seconds"] > 0 and summary["tokens_per_s"] > 0
    assert (
        summary["val_loss"] == pytest.approx(summary["best_val_loss"]) or summary["val_loss"] > summary["best_val_loss"]
    )

    meta = json.loads((data_dir / "meta.json").read_text())
    vocab_size = meta["vocab_size"]
    state = ckpt.load_checkpoint(out_dir / "ckpt.pt", required_keys=ckpt.RESUME_KEYS)  # weights_only
    assert state["iter_num"] == MAX_ITERS
    assert state["sampler"] == {"seed": 1337, "purpose": 0, "position": MAX_ITERS * 2}
    assert state["model_args"]["n_embd"] == 32 and state["model_args"]["vocab_size"] == vocab_size
    assert state["config"]["learning_rate"] == 3e-3 and state["config"]["data_dir"] == str(data_dir)
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda"}
    assert state["tokenizer"] == {**meta["tokenizer"], "vocab_size": vocab_size, "eot_token": None}
    assert state["scaler"] == {}  # float32 on CPU: no loss scaling

    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val/loss" in r]
    assert [r["iter"] for r in evals] == list(range(0, MAX_ITERS + 1, 10))
    assert evals[-1]["val/loss"] < evals[0]["val/loss"] - 0.5  # it learns
    assert evals[0]["val/loss"] == pytest.approx(math.log(vocab_size), abs=0.1)  # an untrained model is uniform
    assert state["best_val_loss"] == pytest.approx(min(r["val/loss"] for r in evals))
    best = ckpt.load_checkpoint(out_dir / "best.pt")
    best_eval = min(evals, key=lambda r: r["val/loss"])
    assert best["iter_num"] == best_eval["iter"]
    bpb = best_eval["val/loss"] / math.log(2) * meta["splits"]["val"]["tokens"] / meta["splits"]["val"]["text_bytes"]
    assert best_eval["val/bpb"] == pytest.approx(bpb)
    assert [r["iter"] for r in records if "lr" in r] == list(range(0, MAX_ITERS, 5))


@pytest.mark.heavy  # the reference run
def test_sigterm_finishes_the_step_saves_and_exits_cleanly(
    reference: tuple, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = tmp_path / "out"
    args = tiny_train_args(data_dir, out_dir, **RUN)
    process = start_train(args)
    wait_for_checkpoint(process, out_dir / "ckpt.pt", min_iter=10)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr  # a clean stop with SIGTERM's conventional code
    assert "Traceback" not in stderr
    stopped = [line for line in stdout.splitlines() if line.startswith("stopped by SIGTERM after")]
    assert len(stopped) == 1 and "continue with --init_from=resume" in stopped[0]
    steps = int(stopped[0].split("after ")[1].split(" steps")[0])
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt")["iter_num"] == steps < MAX_ITERS

    result = run_in_process(train.main, [*args, "--init_from=resume"], capsys)
    assert result.returncode == 0, result.stderr
    assert f"resumed from step {steps} of {out_dir / 'ckpt.pt'} (best val loss " in result.stdout
    # Exact, dropout and gradient accumulation included: the weights and the optimizer's state.
    resumed, uninterrupted = ckpt.load_checkpoint(out_dir / "ckpt.pt"), ckpt.load_checkpoint(reference[0] / "ckpt.pt")
    assert resumed["iter_num"] == MAX_ITERS
    assert_same_weights(resumed["model"], uninterrupted["model"])
    assert_same_weights(resumed["optimizer"]["state"][0], uninterrupted["optimizer"]["state"][0])
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def wait_for_line(process: subprocess.Popen, fragment: str) -> list[str]:
    """Read the run's stdout until a line holding `fragment`; returns the lines read."""
    lines = []
    while not lines or fragment not in lines[-1]:
        line = process.stdout.readline()
        assert line, f"the run ended before printing {fragment!r}: {lines} {process.communicate()}"
        lines.append(line)
    return lines


def test_ctrl_c_during_a_long_evaluation_stops_at_once_with_exit_code_130(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = tmp_path / "out"
    # A million evaluation batches per split: the step-0 evaluation alone would take hours.
    process = start_train(tiny_train_args(data_dir, out_dir, eval_iters=10**6))
    try:
        wait_for_line(process, " parameters | ")  # set up: the evaluation starts now
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)  # one signal is enough: no second Ctrl-C
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, stderr
    assert stderr == ""
    assert stdout.splitlines()[-1] == "stopped by SIGINT after 0 steps, before this run trained one: nothing saved"
    assert not (out_dir / "ckpt.pt").exists()  # nothing trained, nothing saved: the same command starts again
    again = run_in_process(train.main, tiny_train_args(data_dir, out_dir), capsys)
    assert again.returncode == 0, again.stderr


needs_default_sigterm = pytest.mark.skipif(
    signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, reason="SIGTERM is handled by whatever runs the tests"
)


def signal_on_call(monkeypatch: pytest.MonkeyPatch, name: str, signum: int, call: int = 1) -> None:
    """Make train.py's function `name` send this process `signum` as its `call`-th call starts (then run as it
    does): a signal at a known moment of a run in this process."""
    function, calls = getattr(train, name), []

    def signalling(*args, **kwargs):
        calls.append(name)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return function(*args, **kwargs)

    monkeypatch.setattr(train, name, signalling)


def test_ctrl_c_while_the_first_pass_is_timed_stops_at_once(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass timed for the forecast comes before any step (on a large model, minutes): a signal then stops the run
    at once, as during the first evaluation, and says nothing was trained."""
    out_dir = tmp_path / "out"
    timed = loop.forward_seconds

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return timed(*args, **kwargs)

    monkeypatch.setattr(loop, "forward_seconds", interrupted)
    result = run_in_process(train.main, tiny_train_args(data_dir, out_dir), capsys)
    assert result.returncode == 130, result.stderr
    lines = result.stdout.splitlines()
    assert "SIGINT received: stopping now (nothing trained yet to save)" in lines
    assert lines[-1] == "stopped by SIGINT after 0 steps, before this run trained one: nothing saved"
    assert not (out_dir / "ckpt.pt").exists()


def test_ctrl_c_during_set_up_stops_at_once(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the model (of a large one, minutes) comes before any step: a signal then stops the run at once."""
    out_dir = tmp_path / "out"
    create, calls = models.create_model, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        os.kill(os.getpid(), signal.SIGINT)
        return create(*args, **kwargs)

    monkeypatch.setattr(models, "create_model", interrupted)
    result = run_in_process(train.main, tiny_train_args(data_dir, out_dir), capsys)
    assert result.returncode == 130, result.stderr
    assert result.stdout.splitlines()[-1] == "SIGINT received: stopping now (nothing trained yet to save)"
    assert calls == [1] and not (out_dir / "ckpt.pt").exists()


def test_ctrl_c_saves_when_it_also_ended_the_reader_of_the_runs_output(data_dir: Path, tmp_path: Path) -> None:
    """`train.py ... | tee log` and a Ctrl-C: the terminal's signal ends tee too, and the run's next line meets a
    closed pipe; the run still finishes its step, saves and exits 130."""
    out_dir = tmp_path / "out"
    process = start_train(tiny_train_args(data_dir, out_dir, max_iters=10**6, eval_interval=10**6, log_interval=1))
    try:
        wait_for_line(process, "iter 2:")
        process.stdout.close()  # the reader has gone
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt")["iter_num"] >= 2


@needs_default_sigterm
def test_a_stop_while_an_evaluation_saves_saves_once_and_the_resumed_run_does_not_evaluate_again(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while step 2's evaluation writes its checkpoint: that checkpoint is the stop's (evaluated), not written
    a second time, and the resumed run goes on to step 4 with one evaluation of step 2 in its log."""
    out_dir = tmp_path / "out"
    save, saves = train.save, []

    def signalling(*args, **kwargs):
        saves.append(kwargs)
        if len(saves) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return save(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(train, "save", signalling)
        assert run_in_process(train.main, tiny_train_args(data_dir, out_dir), capsys).returncode == 143
    assert len(saves) == 1 and ckpt.load_checkpoint(out_dir / "ckpt.pt")["evaluated"] is not False
    resumed = run_in_process(train.main, [*tiny_train_args(data_dir, out_dir), "--init_from=resume"], capsys)
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in records if "val/loss" in r] == [0, 2, 4]


@needs_default_sigterm
def test_a_run_stopped_during_an_evaluation_does_it_when_it_resumes(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM as the step-2 evaluation starts: the run saves step 2 unevaluated, and the resumed run evaluates it
    first, so its evaluations and best.pt are an uninterrupted run's."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert run_in_process(train.main, tiny_train_args(data_dir, whole), capsys).returncode == 0
    with monkeypatch.context() as patch:
        signal_on_call(patch, "evaluate", signal.SIGTERM, call=2)
        assert run_in_process(train.main, tiny_train_args(data_dir, cut), capsys).returncode == 143
    assert ckpt.load_checkpoint(cut / "ckpt.pt")["evaluated"] is False
    resumed = run_in_process(train.main, [*tiny_train_args(data_dir, cut), "--init_from=resume"], capsys)
    assert resumed.returncode == 0, resumed.stderr

    def evaluations(out_dir: Path) -> list[tuple[int, float]]:
        records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
        return [(r["iter"], r["val/loss"]) for r in records if "val/loss" in r]

    assert evaluations(cut) == evaluations(whole)  # steps 0, 2 and 4, with the same losses
    best_step = ckpt.load_checkpoint(whole / "best.pt")["iter_num"]
    assert ckpt.load_checkpoint(cut / "best.pt")["iter_num"] == best_step


@needs_default_sigterm
def test_sigterm_during_a_long_evaluation_stops_at_once_with_exit_code_143(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Ctrl-C case above with SIGTERM, in this process: the signal as the million-batch evaluation starts."""
    out_dir = tmp_path / "out"
    signal_on_call(monkeypatch, "evaluate", signal.SIGTERM)
    result = run_in_process(train.main, tiny_train_args(data_dir, out_dir, eval_iters=10**6), capsys)
    assert result.returncode == 143, result.stderr
    assert result.stderr == ""
    last = result.stdout.splitlines()[-1]
    assert last == "stopped by SIGTERM after 0 steps, before this run trained one: nothing saved"
    assert not (out_dir / "ckpt.pt").exists()  # nothing trained, nothing saved: the same command starts again
    again = run_in_process(train.main, tiny_train_args(data_dir, out_dir), capsys)
    assert again.returncode == 0, again.stderr


def compiling_under(process: subprocess.Popen, cache_dir: Path) -> bool:
    """Whether a compiler started by the run is compiling one of torch.compile's kernels (a .cpp in its cache)."""
    for child in psutil.Process(process.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(arg.startswith(str(cache_dir)) and arg.endswith(".cpp") for arg in child.cmdline()):
                return True
    return False


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_ctrl_c_while_compiling_is_a_clean_stop(data_dir: Path, tmp_path: Path) -> None:
    """A terminal's Ctrl-C goes to the whole process group: the compilers die of it too, mid-compilation."""
    cache_dir = tmp_path / "inductor"  # empty: every kernel is compiled afresh
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *tiny_train_args(data_dir, tmp_path / "out", compile=True)],
        cwd=REPO,
        env={**UNBUFFERED, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, as a terminal's foreground job has
    )
    try:
        deadline = time.monotonic() + 300
        while not compiling_under(process, cache_dir):
            assert process.poll() is None and time.monotonic() < deadline, "no kernel was compiled"
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 130, stderr[-3000:]
    assert stderr == ""  # no traceback, no compiler output
    assert stdout.splitlines()[-1].startswith("stopped by SIGINT")


@needs_default_sigterm
def test_a_long_run_says_how_long_before_its_first_evaluation_and_step(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "out"
    signal_on_call(monkeypatch, "say_forecast", signal.SIGTERM, call=2)  # stopped as it says the measured one
    args = tiny_train_args(data_dir, out_dir, max_iters=10**7, eval_interval=10**6)
    result = run_in_process(train.main, args, capsys)
    assert result.returncode == 143, result.stderr
    lines = result.stdout.splitlines()
    said = [line for line in lines if line.startswith("a step takes")]
    assert [line.split("(")[1].split(")")[0] for line in said] == ["estimated", "step 0, measured"]
    assert lines.index(said[0]) < min(i for i, line in enumerate(lines) if line.startswith("step 0: "))
    first_step_line = min(i for i, line in enumerate(lines) if line.startswith("iter 0:"))
    assert lines.index(said[1]) < first_step_line  # the measured one before the first step's line
    # Before: all 10**7 steps and 11 evaluations (0, 10**6, ..., 10**7); after step 0, one step and one fewer.
    for line, steps, evaluations in zip(said, ("10,000,000", "9,999,999"), (11, 10)):
        found = re.fullmatch(
            rf"a step takes (\S+) s \(.*\): {steps} steps and {evaluations} evaluations of .+ take about ([\d.]+) "
            r"(min|h|days); for minutes on a CPU start from config/train_corpus_cpu.py",
            line,
        )
        assert found, line
        step_s, total, unit = float(found[1]), float(found[2]), found[3]
        # printed rounded: the total to a tenth of its unit (minutes where a fast machine estimates a step under
        # 0.54 ms), the step to 3 significant digits
        expected = step_s * 10**7 / {"min": 60, "h": 3600, "days": 86400}[unit]
        assert total == pytest.approx(expected, abs=0.05 + 0.006 * expected)


@pytest.mark.heavy  # the reference run
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(reference: tuple, data_dir: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    shutil.copy(reference[0] / "ckpt.pt", out_dir / "ckpt.pt")
    before = (out_dir / "ckpt.pt").read_bytes()
    args = [*tiny_train_args(data_dir, out_dir, **RUN), *cli_args(max_iters=MAX_ITERS + 20, learning_rate=1e6)]
    args += ["--grad_clip=0", "--decay_lr=False"]
    with pytest.raises(UserError, match=r"NaN or infinite at iter \d+; stopped without saving; the last good"):
        train.main([*args, "--init_from=resume"])
    assert (out_dir / "ckpt.pt").read_bytes() == before
    assert sorted(p.name for p in out_dir.iterdir()) == ["ckpt.pt", "log.jsonl"]


def test_shape_settings_a_started_model_does_not_take_are_named(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Resuming or fine-tuning keeps the model's own shape: settings that describe another one are named in a note
    (the same ones, as the run's own config file gives them, are not)."""
    out_dir = tmp_path / "out"
    assert run_in_process(train.main, tiny_train_args(data_dir, out_dir), capsys).returncode == 0
    again = [*tiny_train_args(data_dir, out_dir, max_iters=6), "--init_from=resume"]
    resumed = run_in_process(train.main, again, capsys)
    assert resumed.returncode == 0 and "note:" not in resumed.stdout
    wider = run_in_process(train.main, [*again[:-1], "--max_iters=8", "--n_layer=3", "--n_embd=32", again[-1]], capsys)
    note = "note: the model's shape comes from init_from=resume; not used: n_layer=3 (the model's: 1), n_embd=32 (the model's: 16)"
    assert wider.returncode == 0 and note in wider.stdout.splitlines()
    changed = run_in_process(
        train.main, [*again[:-1], "--max_iters=9", "--batch_size=3", "--seed=5", again[-1]], capsys
    )
    note = "note: resumed with settings other than the run's: seed 1337 -> 5, batch_size 2 -> 3"
    assert changed.returncode == 0 and note in changed.stdout.splitlines()
    tuned = tiny_train_args(data_dir, tmp_path / "tuned", n_layer=2)
    fine_tuned = run_in_process(train.main, [*tuned, f"--init_from={out_dir}"], capsys)
    assert fine_tuned.returncode == 0
    assert (
        f"note: the model's shape comes from init_from={out_dir}; not used: n_layer=2 (the model's: 1)"
        in fine_tuned.stdout
    )
    longer = tiny_train_args(data_dir, tmp_path / "longer", block_size=32)  # the model attends over 16 positions
    longer_run = run_in_process(train.main, [*longer, f"--init_from={out_dir}"], capsys)
    assert longer_run.returncode == 0 and "not used: block_size=32 (the model's: 16)" in longer_run.stdout


@pytest.mark.heavy  # the reference run
def test_resume_refuses_data_from_another_tokenizer(reference: tuple, tmp_path: Path) -> None:
    other = tmp_path / "other_data"
    make_char_data(other, text="xyz " * 5000)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    shutil.copy(reference[0] / "ckpt.pt", out_dir / "ckpt.pt")
    with pytest.raises(UserError, match="trained with another tokenizer"):
        train.main([*tiny_train_args(other, out_dir, **RUN), "--init_from=resume"])


@pytest.mark.heavy  # the reference run
def test_eval_only_reports_estimate_and_whole_split_and_writes_nothing(
    reference: tuple, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    shutil.copy(reference[0] / "ckpt.pt", out_dir / "ckpt.pt")
    args = [*tiny_train_args(data_dir, out_dir, **RUN), "--dropout=0", "--init_from=resume"]
    assert train.main([*args, "--eval_only", "--eval_full_split"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("eval (4 batches per split): train loss")
    meta = json.loads((data_dir / "meta.json").read_text())
    assert lines[-1].startswith(f"eval (whole val split, {meta['splits']['val']['tokens']:,} tokens): val loss")
    full_loss = float(lines[-1].split("val loss ")[1].split(" |")[0])
    last_eval = json.loads((reference[0] / "log.jsonl").read_text().splitlines()[-1])
    assert full_loss == pytest.approx(last_eval["val/loss"], abs=0.15)  # the estimate is close to the exact value
    assert sorted(p.name for p in out_dir.iterdir()) == ["ckpt.pt"]
    other = "muon" if ckpt.load_checkpoint(out_dir / "ckpt.pt")["config"]["optimizer"] == "adamw" else "adamw"
    assert train.main([*args, "--eval_only", f"--optimizer={other}"]) == 0  # nothing trains: any optimizer
    assert capsys.readouterr().out.splitlines()[-1] == lines[-2]


# ----------------------------------------------------------------------------- fine-tuning and wandb


def test_finetune_from_a_hugging_face_directory_crops_the_context(data_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    pretrained = GPT(GPTConfig(block_size=64, vocab_size=80, n_layer=1, n_head=2, n_embd=16, bias=True))
    write_hf(pretrained, tmp_path / "hf")
    out_dir = tmp_path / "out"
    args = [*tiny_train_args(data_dir, out_dir, **RUN), *cli_args(init_from=tmp_path / "hf", max_iters=4)]
    args += ["--eval_interval=4", "--block_size=16"]
    assert train.main(args) == 0
    state = ckpt.load_checkpoint(out_dir / "ckpt.pt")
    assert state["model_args"]["block_size"] == 16 and state["model_args"]["vocab_size"] == 80
    assert state["model_args"]["dropout"] == 0.1 and state["model"]["transformer.wpe.weight"].shape == (16, 16)

    small = GPT(GPTConfig(block_size=64, vocab_size=40, n_layer=1, n_head=2, n_embd=16, bias=True))
    write_hf(small, tmp_path / "hf_small")
    with pytest.raises(UserError, match=r"data's vocab_size \(\d+\) is larger than the model's \(40\)"):
        train.main([*tiny_train_args(data_dir, tmp_path / "out2", **RUN), f"--init_from={tmp_path / 'hf_small'}"])


def test_wandb_offline_run_is_written(data_dir: Path, tmp_path: Path) -> None:
    wandb_dir = tmp_path / "wandb_root"
    wandb_dir.mkdir()
    args = [
        *tiny_train_args(data_dir, tmp_path / "out", **RUN),
        "--max_iters=10",
        "--wandb_log",
        "--wandb_run_name=tiny",
    ]
    env = clean_env(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true")
    result = run_script("train.py", *args, env=env)
    assert result.returncode == 0, result.stderr
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))  # the run's log of metrics


def test_muon_optimizer_trains_and_resumes(data_dir: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    args = [*tiny_train_args(data_dir, out_dir, **RUN), *cli_args(optimizer="muon", muon_lr=0.02, max_iters=10)]
    args.append("--lr_decay_iters=14")
    assert train.main(args) == 0
    state = ckpt.load_checkpoint(out_dir / "ckpt.pt")
    muon_groups = [g for g in state["optimizer"]["param_groups"] if g.get("muon")]
    assert len(muon_groups) == 1 and muon_groups[0]["lr_scale"] == pytest.approx(0.02 / 3e-3)
    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    assert records[-1]["val/loss"] < records[0]["val/loss"]
    assert train.main([*args, "--max_iters=14", "--init_from=resume"]) == 0
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt")["iter_num"] == 14


def test_a_resumed_run_takes_the_optimizer_settings_it_is_given(data_dir: Path, tmp_path: Path) -> None:
    """Loading the optimizer's state brings back its moments, not the saved run's betas, weight decay or Muon rate:
    those given to the resumed run apply, as its note and its checkpoint's config say."""
    out_dir = tmp_path / "out"
    args = [*tiny_train_args(data_dir, out_dir, **RUN), *cli_args(optimizer="muon", muon_lr=0.02, max_iters=4)]
    assert train.main(args) == 0
    changed = cli_args(max_iters=6, init_from="resume", muon_lr=0.001, muon_momentum=0.9, weight_decay=0.0, beta2=0.5)
    assert train.main([*args, *changed]) == 0
    state = ckpt.load_checkpoint(out_dir / "ckpt.pt")
    groups = state["optimizer"]["param_groups"]
    muon = [group for group in groups if group.get("muon")]
    adam = [group for group in groups if not group.get("muon")]
    assert [(group["lr_scale"], group["momentum"]) for group in muon] == [(pytest.approx(0.001 / 3e-3), 0.9)]
    assert adam and all(group["betas"][1] == 0.5 and group["weight_decay"] == 0.0 for group in adam)
    assert (state["config"]["muon_lr"], state["config"]["beta2"]) == (0.001, 0.5)


def test_mfu_uses_a_peak_the_caller_gives(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """On a device with no known peak, --peak_flops turns 'mfu n/a' into a figure consistent with ms/iter."""
    args = [*tiny_train_args(data_dir, tmp_path / "out", **RUN), "--max_iters=4", "--log_interval=1"]
    assert train.main([*args, "--eval_interval=100", "--peak_flops=1e9"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("iter 3:"))
    ms_per_iter = float(line.split("|")[2].split()[0])
    mfu = float(line.split("mfu ")[1].rstrip("%")) / 100
    # FLOPs per token by hand: 6 per parameter (the position embedding excluded: a lookup, no compute) plus
    # 12 * n_layer * n_embd * block_size for the attention scores. Parameters of the tiny model (n_embd 32,
    # no biases, the token embedding tied to the head): per block 2 LayerNorm gains (2*32), qkv (32*96),
    # the attention projection (32*32), the MLP (32*128 + 128*32); then the final LayerNorm and the embedding.
    vocab_size = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    block = 2 * 32 + 32 * 96 + 32 * 32 + 32 * 128 + 128 * 32
    parameters = 2 * block + 32 + vocab_size * 32
    flops_per_token = 6 * parameters + 12 * 2 * 32 * 32
    tokens_per_iter = 4 * 2 * 32  # batch_size x gradient_accumulation_steps x block_size
    expected = flops_per_token * tokens_per_iter / (ms_per_iter / 1000) / 1e9
    assert mfu == pytest.approx(expected, rel=0.05)  # ms/iter is printed rounded to 0.1 ms


def test_ema_is_evaluated_and_saved_as_the_model_and_resumes_exactly(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ema = cli_args(optimizer="muon", muon_lr=0.02, lr_decay_iters=14, ema_decay=0.8, ema_start=4)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert train.main([*tiny_train_args(data_dir, whole, **RUN), *ema, "--max_iters=14"]) == 0
    saved = ckpt.load_checkpoint(whole / "ckpt.pt")
    assert not torch.equal(saved["model"]["lm_head.weight"], saved["trained_model"]["lm_head.weight"])
    # The logged val loss is the saved "model"'s (the average), as --eval_only measures it from the checkpoint.
    logged = [json.loads(line) for line in (whole / "log.jsonl").read_text().splitlines()][-1]["val/loss"]
    capsys.readouterr()
    assert train.main([*tiny_train_args(data_dir, whole, **RUN), *ema, "--eval_only=True", "--init_from=resume"]) == 0
    assert f"val loss {logged:.4f}" in capsys.readouterr().out

    # Stopped at step 10 (the average 6 steps old) and resumed to 14: the same average and trained weights.
    assert train.main([*tiny_train_args(data_dir, parts, **RUN), *ema, "--max_iters=10"]) == 0
    assert train.main([*tiny_train_args(data_dir, parts, **RUN), *ema, "--max_iters=14", "--init_from=resume"]) == 0
    resumed = ckpt.load_checkpoint(parts / "ckpt.pt")
    assert_same_weights(resumed["model"], saved["model"])
    assert_same_weights(resumed["trained_model"], saved["trained_model"])
