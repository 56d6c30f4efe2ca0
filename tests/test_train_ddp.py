"""train.py across processes: 2 CPU processes (gloo) under torchrun, with DDP and with FSDP2, must train exactly
like one process that does all the micro-batches itself, and write checkpoints any of them can resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from gptkit.eval import hellaswag
from gptkit.weights import checkpoint as ckpt
from helpers import REPO, TINY_MODEL, clean_env, make_char_data, sample_text, tiny_train_args, write_items

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


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # 2 gloo processes


def train_in(processes: int, data_dir: Path, out_dir: Path, *extra: str) -> subprocess.CompletedProcess | None:
    """train.py with this file's run: in one process (processes=1: train.main in this one, which saves starting
    Python and torch; the launch is not what these tests check) or under torchrun in two CPU processes (gloo)."""
    assert processes in (1, 2)
    args = [*tiny_train_args(data_dir, out_dir, **RUN), *extra]
    if processes == 1:
        assert train.main([str(arg) for arg in args]) == 0
        return None
    launcher = [*TORCHRUN, str(REPO / "train.py")]
    result = subprocess.run([*launcher, *args], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
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
    items = write_items(root / "items.jsonl", hellaswag.items_from_text(sample_text(), 21, 60, 12, seed=3))
    tasks = ("--eval_tasks=hellaswag", f"--hellaswag_path={items}")  # 21 items: the processes get 11 and 10
    outs = {name: root / name for name in ("single", "ddp", "fsdp")}
    train_in(1, root / "data", outs["single"], *tasks)
    ddp = train_in(2, root / "data", outs["ddp"], *tasks)
    assert "2 process(es)" in ddp.stdout and ddp.stdout.count("done:") == 1  # only rank 0 reports
    train_in(2, root / "data", outs["fsdp"], "--parallel=fsdp", *tasks)
    return {**outs, "data": root / "data"}


def test_ddp_matches_one_process_with_twice_the_accumulation(runs: dict[str, Path]) -> None:
    assert_same_curve(runs["single"], runs["ddp"])
    assert_close_weights(runs["single"], runs["ddp"])
    assert sorted(p.name for p in runs["ddp"].iterdir()) == ["best.pt", "ckpt.pt", "log.jsonl", "summary.json"]


def test_evaluation_tasks_split_over_processes_count_every_item_once(runs: dict[str, Path]) -> None:
    """HellaSwag during training: each process scores its share of the items, and the reduced counts equal what one
    process finds scoring them all (same choices: the weights agree to float rounding)."""
    figures = {}
    for name in ("single", "ddp", "fsdp"):
        entries = [json.loads(line) for line in (runs[name] / "log.jsonl").read_text().splitlines()]
        figures[name] = [
            (e["iter"], e["hellaswag/n"], e["hellaswag/acc"], e["hellaswag/acc_norm"])
            for e in entries
            if "hellaswag/acc" in e
        ]
    assert [row[:2] for row in figures["single"]] == [(0, 21), (10, 21), (20, 21)]
    assert figures["ddp"] == figures["single"] and figures["fsdp"] == figures["single"]


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
        train_in(processes, runs["data"], tmp_path / source, *more, *extra)
        assert ckpt.load_checkpoint(tmp_path / source / "ckpt.pt")["iter_num"] == MAX_ITERS + 4
    assert_close_weights(tmp_path / "fsdp", tmp_path / "single")


def test_an_ema_under_ddp_matches_one_process(runs: dict[str, Path], tmp_path: Path) -> None:
    """Every process keeps the same average of its replica: evaluated and saved as in one process."""
    ema = ("--ema_decay=0.8", "--ema_start=12")
    train_in(1, runs["data"], tmp_path / "single", *ema)
    train_in(2, runs["data"], tmp_path / "ddp", *ema)
    assert_same_curve(tmp_path / "single", tmp_path / "ddp")
    single, ddp = (ckpt.load_checkpoint(tmp_path / name / "ckpt.pt") for name in ("single", "ddp"))
    for key in ("model", "trained_model"):
        for name, value in single[key].items():
            torch.testing.assert_close(ddp[key][name], value, atol=1e-5, rtol=1e-4)
    assert not torch.equal(single["model"]["lm_head.weight"], single["trained_model"]["lm_head.weight"])


def worker_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the torchrun worker of `rank` (a child of the launcher whose environment has RANK=rank)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = (proc / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue  # the process ended meanwhile
            if parent == launcher.pid and f"RANK={rank}".encode() in environ:
                return int(proc.name)
        time.sleep(0.05)
    raise AssertionError(f"no worker of rank {rank} under torchrun (pid {launcher.pid})")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds torchrun's workers in /proc")
def test_a_signal_to_one_process_stops_all_of_them_at_the_same_step(runs: dict[str, Path], tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    args = [*tiny_train_args(runs["data"], out_dir, **RUN), "--max_iters=1000000"]  # only the signal ends it
    launcher = subprocess.Popen(
        [*TORCHRUN, str(REPO / "train.py"), *args],
        cwd=REPO,
        env=clean_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out_dir / "ckpt.pt").exists():  # written atomically: it exists only when complete
            assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        os.kill(worker_pid(launcher, rank=1), signal.SIGTERM)  # rank 0, which saves, gets no signal
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stderr[-3000:]
    stopped = [line for line in stdout.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1, stdout[-2000:]
    steps = int(stopped[0].split("after ")[1].split(" steps")[0])
    assert stopped[0] == (
        f"stopped by a signal to another process after {steps} steps | saved {out_dir / 'ckpt.pt'}; "
        "continue with --init_from=resume"
    )
    assert (steps - 1) % RUN["log_interval"] == 0  # processes agree to stop at log steps only
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt")["iter_num"] == steps


# Test-only fault, loaded by Python at start-up (sitecustomize): the worker of rank KILL_RANK dies by SIGKILL when it
# first draws training micro-batch KILL_AT_BATCH or later, once (KILL_MARKER records that it happened).
KILL_HOOK = """
import os
if os.environ.get("RANK") == os.environ.get("KILL_RANK") and not os.path.exists(os.environ["KILL_MARKER"]):
    from gptkit.data import loader

    _real_batch = loader.BatchSampler.batch

    def _batch(self, index):
        if self.purpose == loader.PURPOSE_TRAIN and index >= int(os.environ["KILL_AT_BATCH"]):
            open(os.environ["KILL_MARKER"], "w").close()
            os.kill(os.getpid(), 9)
        return _real_batch(self, index)

    loader.BatchSampler.batch = _batch
"""


def run_killing_rank_1_at_step_15(tmp_path: Path, data_dir: Path, launcher: list[str]) -> tuple[Path, Path, list]:
    """The kill hook armed for rank 1 at step 15 (after the step-10 checkpoint); returns (marker, out_dir, command)."""
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text(KILL_HOOK)
    marker, out_dir = tmp_path / "killed", tmp_path / "out"
    # The repository after the hook: the hook imports gptkit before Python puts the script's directory first, and
    # must find this checkout's package, not an installed one.
    hooked = os.pathsep.join([str(tmp_path / "hooks"), str(REPO)])
    env = clean_env(PYTHONPATH=hooked, KILL_RANK="1", KILL_MARKER=str(marker))
    env["KILL_AT_BATCH"] = str(15 * RUN["gradient_accumulation_steps"])
    command = [*launcher, str(REPO / "train.py"), *tiny_train_args(data_dir, out_dir, **RUN), "--init_from=auto"]
    return marker, out_dir, [command, env]


def assert_resumed_to_the_uninterrupted_weights(out_dir: Path, uninterrupted_dir: Path) -> None:
    entries = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    assert [e["iter"] for e in entries if "val/loss" in e] == [0, 10, 20]  # resumed after step 10, not from 0
    restarted = ckpt.load_checkpoint(out_dir / "ckpt.pt")
    uninterrupted = ckpt.load_checkpoint(uninterrupted_dir / "ckpt.pt")
    assert restarted["iter_num"] == uninterrupted["iter_num"] == MAX_ITERS
    for key, tensor in uninterrupted["model"].items():
        assert torch.equal(restarted["model"][key], tensor), key


def test_torchrun_max_restarts_after_a_killed_worker_ends_with_the_uninterrupted_weights(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """An elastic job: rank 1 is SIGKILLed at step 15, torchrun (--max-restarts=1) stops the other worker and starts
    both again with the same command, --init_from=auto; they resume from the step-10 checkpoint and end exactly
    where the uninterrupted run did."""
    launcher = [*TORCHRUN, "--max-restarts=1", "--monitor-interval=0.5"]
    marker, out_dir, (command, env) = run_killing_rank_1_at_step_15(tmp_path, runs["data"], launcher)
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert marker.exists()  # the fault really happened, so only the restart can have finished the job
    assert_resumed_to_the_uninterrupted_weights(out_dir, runs["ddp"])


def test_a_relaunch_with_init_from_auto_after_a_killed_worker_ends_with_the_uninterrupted_weights(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """What a preemptible job does without an elastic launcher: rank 1 is SIGKILLed at step 15, the job fails, and
    the same command is launched again with --init_from=auto. It must end exactly where the uninterrupted run did."""
    marker, out_dir, (command, env) = run_killing_rank_1_at_step_15(tmp_path, runs["data"], TORCHRUN)
    killed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0 and marker.exists()  # the fault really happened, and the job failed
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt")["iter_num"] == 10
    relaunched = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert relaunched.returncode == 0, relaunched.stdout[-2000:] + relaunched.stderr[-3000:]
    assert_resumed_to_the_uninterrupted_weights(out_dir, runs["ddp"])
