"""train.py across processes: 2 CPU processes (gloo), with DDP and with FSDP2, must train exactly like one process
that does all the micro-batches itself, and write checkpoints any of them can resume; a signal to one process stops
them all, and under torchrun a job with a killed worker ends, relaunched or restarted, where it would have ended."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import train
from gptkit.core import distributed
from gptkit.weights import checkpoint as ckpt
from helpers import (
    REPO,
    TINY_MODEL,
    clean_env,
    free_port,
    items_from_text,
    make_char_data,
    sample_text,
    tiny_train_args,
    write_items,
)

MAX_ITERS = 20
# A 2-layer, 32-wide model, 4 micro-batches of 4 per step (whatever the number of processes), dropout on.
RUN = {
    **TINY_MODEL,
    "batch_size": 4,
    "gradient_accumulation_steps": 4,
    "dropout": 0.1,
    "max_iters": MAX_ITERS,
    "eval_interval": 10,
    "eval_iters": 5,
    "log_interval": 2,
    "learning_rate": 3e-3,
    "warmup_iters": 5,
    "lr_decay_iters": MAX_ITERS,
    "min_lr": 3e-4,
}
EMA = ("--ema_decay=0.8", "--ema_start=12")  # an average from step 12 on: evaluated and saved in place of the weights

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # 2 gloo processes


def train_in(processes: int, data_dir: Path, out_dir: Path, *extra: str) -> str:
    """train.py with this file's run in one process (train.main in this one) or in two (train_in_two_processes);
    returns what it printed."""
    assert processes in (1, 2)
    args = [str(arg) for arg in (*tiny_train_args(data_dir, out_dir, **RUN), *extra)]
    if processes == 2:
        return train_in_two_processes(args)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train.main(args) == 0
    return printed.getvalue()


def train_in_two_processes(args: list[str], while_running: Callable[[subprocess.Popen], None] | None = None) -> str:
    """train.py `args` in 2 gloo processes, each with the variables torchrun gives its workers (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT): rank 0 is train.main in this process, hosting the rendezvous as under
    any launcher but torchrun, and rank 1 a `python train.py`, which `while_running` gets on a thread meanwhile.
    Returns what both printed. This starts one Python and torch where torchrun starts three (itself and 2
    workers); the test of a killed worker launches torchrun itself, which restarts the workers."""
    rendezvous = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    # rank 1 writes to files, not pipes: a full pipe nobody reads while rank 0 trains would stall them both
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        rank_1 = subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *args],
            cwd=REPO,
            env=clean_env(RANK="1", LOCAL_RANK="1", **rendezvous),
            stdout=out,
            stderr=err,
        )
        watcher = threading.Thread(target=while_running or (lambda process: None), args=(rank_1,), daemon=True)
        watcher.start()
        printed, code = io.StringIO(), None
        try:
            with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
                for name, value in {"RANK": "0", "LOCAL_RANK": "0", **rendezvous}.items():
                    patch.setenv(name, value)
                # a rank 1 that never joins fails the test in minutes, not after the default half hour
                patch.setattr(distributed, "default_pg_timeout", datetime.timedelta(minutes=5))
                code = train.main(args)
        finally:
            if code is None:  # rank 0 failed: stop rank 1, which would wait for it
                rank_1.kill()
            rank_1.wait(timeout=300)
            watcher.join(timeout=300)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            print(f"rank 1's stderr: {stderr[-3000:]}", file=sys.stderr)  # pytest shows it when the test fails
    assert code == 0 and rank_1.returncode == 0
    assert "Traceback" not in stderr
    return printed.getvalue() + stdout


def log_entries(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]


def losses(out_dir: Path) -> list[tuple[int, str, float]]:
    """(iter, metric, value) for every logged loss, in order."""
    rows = []
    for record in log_entries(out_dir):
        rows += [(record["iter"], key, record[key]) for key in ("train/loss", "val/loss") if key in record]
    return rows


def assert_same_curve(a: Path, b: Path) -> None:
    curve_a, curve_b = losses(a), losses(b)
    assert [row[:2] for row in curve_a] == [row[:2] for row in curve_b]
    assert len(curve_a) == MAX_ITERS // 2 + 2 * (MAX_ITERS // 10 + 1)
    for (_, _, value_a), (_, _, value_b) in zip(curve_a, curve_b):
        assert value_a == pytest.approx(value_b, abs=1e-4)


def assert_close_weights(a: Path, b: Path, key: str = "model") -> None:
    """The checkpoints' weights (`key`: model, or an EMA run's trained_model) agree to float rounding."""
    weights_a = ckpt.load_checkpoint(a / "ckpt.pt")[key]
    weights_b = ckpt.load_checkpoint(b / "ckpt.pt")[key]
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The runs the tests compare, all evaluating HellaSwag too, each against one process doing all 4 micro-batches
    of a step: `ddp`, 2 DDP processes (2 micro-batches each) with an EMA, against `ema`, one process with it; and
    `fsdp`, 2 FSDP processes, which continue the step-10 checkpoint of `single` (one process stopped there and
    continued to step 20 itself)."""
    root = tmp_path_factory.mktemp("ddp")
    data = root / "data"
    make_char_data(data)
    items = write_items(root / "items.jsonl", items_from_text(sample_text(), 21, 60, 12, seed=3))
    tasks = ("--eval_tasks=hellaswag", f"--hellaswag_path={items}")  # 21 items: the processes get 11 and 10
    outs = {name: root / name for name in ("single", "fsdp", "ema", "ddp")}
    train_in(1, data, outs["single"], *tasks, "--max_iters=10")
    shutil.copytree(outs["single"], outs["fsdp"])  # the one-process run moves to 2 FSDP processes
    train_in(1, data, outs["single"], *tasks, "--init_from=resume")
    train_in(2, data, outs["fsdp"], *tasks, "--init_from=resume", "--parallel=fsdp")
    train_in(1, data, outs["ema"], *tasks, *EMA)
    printed = train_in(2, data, outs["ddp"], *tasks, *EMA)
    assert "2 process(es)" in printed and printed.count("done:") == 1  # only rank 0 reports
    return {**outs, "data": data}


def test_ddp_with_an_ema_matches_one_process_with_twice_the_accumulation(runs: dict[str, Path]) -> None:
    """Every process keeps the same average of its replica: trained, evaluated and saved as in one process."""
    assert_same_curve(runs["ema"], runs["ddp"])
    assert_close_weights(runs["ema"], runs["ddp"])  # the average
    assert_close_weights(runs["ema"], runs["ddp"], key="trained_model")
    assert sorted(p.name for p in runs["ddp"].iterdir()) == ["best.pt", "ckpt.pt", "log.jsonl", "summary.json"]
    saved = ckpt.load_checkpoint(runs["ema"] / "ckpt.pt")
    assert not torch.equal(saved["model"]["lm_head.weight"], saved["trained_model"]["lm_head.weight"])


def test_evaluation_tasks_split_over_processes_count_every_item_once(runs: dict[str, Path]) -> None:
    """HellaSwag during training: each process scores its share of the items, and the reduced counts equal what one
    process finds scoring them all (same choices: the weights agree to float rounding). The FSDP run's figures
    at steps 0 and 10 are the one-process run's it continues."""
    figures = {}
    for name in ("single", "fsdp", "ema", "ddp"):
        figures[name] = [
            (e["iter"], e["hellaswag/n"], e["hellaswag/acc"], e["hellaswag/acc_norm"])
            for e in log_entries(runs[name])
            if "hellaswag/acc" in e
        ]
    assert [row[:2] for row in figures["single"]] == [(0, 21), (10, 21), (20, 21)]
    assert figures["fsdp"] == figures["single"] and figures["ddp"] == figures["ema"]
    assert [row[:2] for row in figures["ema"]] == [(0, 21), (10, 21), (20, 21)]


def test_fsdp_continues_a_one_process_checkpoint_as_one_process_does_and_saves_its_format(
    runs: dict[str, Path],
) -> None:
    assert_same_curve(runs["single"], runs["fsdp"])
    assert_close_weights(runs["single"], runs["fsdp"])
    single_state = ckpt.load_checkpoint(runs["single"] / "ckpt.pt")
    fsdp_state = ckpt.load_checkpoint(runs["fsdp"] / "ckpt.pt")
    assert fsdp_state["iter_num"] == single_state["iter_num"] == MAX_ITERS
    assert fsdp_state["optimizer"]["state"].keys() == single_state["optimizer"]["state"].keys()
    assert [g["params"] for g in fsdp_state["optimizer"]["param_groups"]] == [
        g["params"] for g in single_state["optimizer"]["param_groups"]
    ]


def test_an_fsdp_checkpoint_continues_in_one_process(runs: dict[str, Path], tmp_path: Path) -> None:
    """The FSDP run's checkpoint, continued in one process, gives what the one-process run's does (the other way
    round, one process to FSDP, is how the FSDP run began)."""
    more = ["--init_from=resume", f"--max_iters={MAX_ITERS + 4}", f"--lr_decay_iters={MAX_ITERS + 4}"]
    for source in ("fsdp", "single"):
        (tmp_path / source).mkdir()
        (tmp_path / source / "ckpt.pt").write_bytes((runs[source] / "ckpt.pt").read_bytes())
        train_in(1, runs["data"], tmp_path / source, *more)
        assert ckpt.load_checkpoint(tmp_path / source / "ckpt.pt")["iter_num"] == MAX_ITERS + 4
    assert_close_weights(tmp_path / "fsdp", tmp_path / "single")


def test_a_signal_to_one_process_stops_all_of_them_at_the_same_step(runs: dict[str, Path], tmp_path: Path) -> None:
    """SIGTERM to rank 1 alone (rank 0, which saves, gets none): both stop after the same step, rank 0 saves there,
    and both exit with 0, so that torchrun sees no failure."""
    out_dir = tmp_path / "out"
    args = [*tiny_train_args(runs["data"], out_dir, **RUN), "--max_iters=1000000"]  # only the signal ends it

    def signal_rank_1(rank_1: subprocess.Popen) -> None:
        deadline = time.monotonic() + 120
        while not (out_dir / "ckpt.pt").exists() and rank_1.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until the first checkpoint, written atomically: it exists only when complete
        rank_1.send_signal(signal.SIGTERM)

    printed = train_in_two_processes(args, while_running=signal_rank_1)
    stopped = [line for line in printed.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1, printed[-2000:]
    steps = int(stopped[0].split("after ")[1].split(" steps")[0])
    assert stopped[0] == (
        f"stopped by a signal to another process after {steps} steps | saved {out_dir / 'ckpt.pt'}; "
        "continue with --init_from=resume"
    )
    assert (steps - 1) % RUN["log_interval"] == 0  # processes agree to stop at log steps only
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt")["iter_num"] == steps


# Test-only fault, loaded by Python at start-up (sitecustomize): the worker of rank KILL_RANK dies by SIGKILL when it
# first draws training micro-batch B or later, for the first B of KILL_AT_BATCHES (a comma-separated list) that has
# not killed a worker yet; the file KILL_MARKERS/killed-at-B records that it did.
KILL_HOOK = """
import os
batches = [int(batch) for batch in os.environ["KILL_AT_BATCHES"].split(",")]
markers = {batch: os.path.join(os.environ["KILL_MARKERS"], f"killed-at-{batch}") for batch in batches}
armed = [batch for batch in batches if not os.path.exists(markers[batch])]
if os.environ.get("RANK") == os.environ.get("KILL_RANK") and armed:
    from gptkit.data import loader

    _real_batch = loader.BatchSampler.batch

    def _batch(self, index):
        if self.purpose == loader.PURPOSE_TRAIN and index >= armed[0]:
            open(markers[armed[0]], "w").close()
            os.kill(os.getpid(), 9)
        return _real_batch(self, index)

    loader.BatchSampler.batch = _batch
"""


def killing_rank_1(tmp_path: Path, at_steps: tuple[int, ...]) -> dict[str, str]:
    """The environment of a torchrun job whose rank 1 is killed at each of `at_steps` in turn (KILL_HOOK), and
    the markers' directory, tmp_path/killed."""
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text(KILL_HOOK)
    (tmp_path / "killed").mkdir()
    # The repository after the hook: the hook imports gptkit before Python puts the script's directory first, and
    # must find this checkout's package, not an installed one.
    hooked = os.pathsep.join([str(tmp_path / "hooks"), str(REPO)])
    batches = ",".join(str(step * RUN["gradient_accumulation_steps"]) for step in at_steps)
    return clean_env(PYTHONPATH=hooked, KILL_RANK="1", KILL_MARKERS=str(tmp_path / "killed"), KILL_AT_BATCHES=batches)


def runs_of_rising_steps(steps: list[int]) -> list[list[int]]:
    """A log's step numbers cut where they fall back (where an attempt resumed from a checkpoint)."""
    runs: list[list[int]] = []
    for step in steps:
        if not runs or step <= runs[-1][-1]:
            runs.append([])
        runs[-1].append(step)
    return runs


def test_a_job_with_a_killed_worker_ends_relaunched_or_restarted_with_the_uninterrupted_weights(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A preemptible job's life: rank 1 is SIGKILLed at step 15 (after the step-10 checkpoint) and the job fails; the
    same command is launched again with --init_from=auto, now with --max-restarts=1, and its rank 1 is killed
    at step 17; torchrun stops the other worker and starts both again. Each attempt resumes from the step-10
    checkpoint, and the job ends exactly where the uninterrupted run (the `ddp` run: 2 DDP processes, an EMA)
    did."""
    env = killing_rank_1(tmp_path, at_steps=(15, 17))
    out_dir = tmp_path / "out"
    args = [*tiny_train_args(runs["data"], out_dir, **RUN), *EMA, "--init_from=auto"]
    killed = subprocess.run(
        [*TORCHRUN, str(REPO / "train.py"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode != 0 and sorted(os.listdir(tmp_path / "killed")) == ["killed-at-60"], "no fault at 15"
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt")["iter_num"] == 10, "the job's last checkpoint is step 10's"

    elastic = [*TORCHRUN, "--max-restarts=1", "--monitor-interval=0.5", str(REPO / "train.py"), *args]
    relaunched = subprocess.run(elastic, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert relaunched.returncode == 0, relaunched.stdout[-2000:] + relaunched.stderr[-3000:]
    # the second fault happened, so only torchrun's restart can have finished the job
    assert sorted(os.listdir(tmp_path / "killed")) == ["killed-at-60", "killed-at-68"]

    entries = log_entries(out_dir)
    steps = [e for e in entries if "lr" in e]  # the training steps' lines, not the evaluations'
    # what the three attempts logged: from step 0, then twice from the step-10 checkpoint, every other step. Rank 1
    # reads its next batch ahead, on a thread, and dies there: during the step before the one it is killed at, whose
    # line then comes or not as the threads happen to run (steps 0-12 or 0-14; 10-14 or 10-16); the last, to step 18.
    attempts = runs_of_rising_steps([e["iter"] for e in steps])
    assert [attempt[0] for attempt in attempts] == [0, 10, 10]
    assert all(attempt == list(range(attempt[0], attempt[-1] + 1, 2)) for attempt in attempts)
    assert attempts[0][-1] in (12, 14) and attempts[1][-1] in (14, 16) and attempts[2][-1] == 18
    uninterrupted = {e["iter"]: e["train/loss"] for e in log_entries(runs["ddp"]) if "lr" in e}
    # each step after the checkpoint went as in the uninterrupted run (a resumed attempt's first line, at step 10,
    # averages that step alone)
    resumed = [e for e in steps if e["iter"] > 10]
    assert all(e["train/loss"] == uninterrupted[e["iter"]] for e in resumed), "an attempt did not resume exactly"
    assert [e["iter"] for e in entries if "val/loss" in e] == [0, 10, 20]
    restarted = ckpt.load_checkpoint(out_dir / "ckpt.pt")
    expected = ckpt.load_checkpoint(runs["ddp"] / "ckpt.pt")
    assert restarted["iter_num"] == expected["iter_num"] == MAX_ITERS
    for key in ("model", "trained_model"):  # the average and the weights it averages
        for name, tensor in expected[key].items():
            assert torch.equal(restarted[key][name], tensor), f"{key} {name}"


def test_a_mistake_rank_0_alone_meets_is_its_one_line_and_rank_1_stops_in_one_line(tmp_path: Path) -> None:
    """Rank 0 cannot write its checkpoint (a file size limit: a mistake only rank 0 meets, as a full disk or a taken
    out_dir): its line says why; rank 1, whose next collective then fails, says in one line that it stops for
    another process, with no traceback, and neither waits for the other."""
    make_char_data(tmp_path / "data")
    args = [str(arg) for arg in tiny_train_args(tmp_path / "data", tmp_path / "out", **RUN)]
    rendezvous = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *args],
            cwd=REPO,
            env=clean_env(RANK=str(rank), LOCAL_RANK=str(rank), **rendezvous),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=limit_file_size if rank == 0 else None,
        )
        for rank in (0, 1)
    ]
    try:
        errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    best = tmp_path / "out" / "best.pt"
    assert (ranks[0].returncode, errors[0]) == (
        2,
        f"error: cannot write checkpoint {best}: File too large\n",
    )
    line = "error: rank 1 stops: another process of this run has stopped (its message says why)\n"
    assert (ranks[1].returncode, errors[1]) == (1, line)


def limit_file_size() -> None:
    """No file over 64 KB: the run's log fits, a checkpoint does not (Python ignores SIGXFSZ, so a write fails)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
