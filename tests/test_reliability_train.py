"""Faults during training and hostile checkpoints: kill -9 at seeded moments (also in the middle of a checkpoint
write), a full disk while saving, damaged and malicious checkpoints given to train.py and sample.py.

Faults inside a save are placed exactly by a `sitecustomize` module (FAULT_HOOK below) that Python loads in the
child process: it wraps the file object of the n-th checkpoint write so that it stops after a given number of
bytes and then kills the process with SIGKILL, or fails with ENOSPC as a full disk does. The code under test
(fileio.atomic_open, checkpoint.save_checkpoint, train.py) runs unchanged. docs/reliability.md lists every case.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sample
import train
from gptkit.core.errors import UserError
from gptkit.model import GPT, GPTConfig, config_to_dict
from gptkit.weights import checkpoint as ckpt
from helpers import (
    REPO,
    assert_one_line_error,
    clean_env,
    make_char_data,
    run_in_process,
    run_main,
    run_script,
    sample_text,
    tiny_train_args,
)

INTERVAL = 10  # eval_interval: a checkpoint every 10 steps
MAX_ITERS = 150  # where every resumed run (and the reference run) ends

FAULT_HOOK = '''
"""Test-only fault injection, imported by Python at start-up (sitecustomize).

FAULT=kill|enospc with FAULT_SAVE=n and FAULT_BYTES=b: the n-th checkpoint write (a .ckpt.pt.*.tmp or
.best.pt.*.tmp file) receives b bytes, then the process is killed with SIGKILL or the write fails with ENOSPC.
FAULT=kill_before_link with FAULT_SAVE=n: SIGKILL just before the n-th .ckpt.pt.link is renamed to ckpt.pt.
"""
import errno
import os
import signal

FAULT = os.environ.get("FAULT")


def _die():
    os.kill(os.getpid(), signal.SIGKILL)
    while True:
        signal.pause()


class _FaultyFile:
    def __init__(self, handle, budget):
        self._handle, self._budget = handle, budget

    def write(self, data):
        data = bytes(data)
        if len(data) <= self._budget:
            self._budget -= len(data)
            return self._handle.write(data)
        self._handle.write(data[: self._budget])
        self._handle.flush()
        os.fsync(self._handle.fileno())
        if FAULT == "kill":
            _die()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)


if FAULT:
    _target = int(os.environ["FAULT_SAVE"])
    _counts = {"write": 0, "link": 0}
    _fdopen, _replace = os.fdopen, os.replace

    def _checked_fdopen(fd, *args, **kwargs):
        handle = _fdopen(fd, *args, **kwargs)
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith((".ckpt.pt.", ".best.pt.")) and name.endswith(".tmp"):
            _counts["write"] += 1
            if FAULT in ("kill", "enospc") and _counts["write"] == _target:
                return _FaultyFile(handle, int(os.environ["FAULT_BYTES"]))
        return handle

    def _checked_replace(source, destination, *args, **kwargs):
        if os.path.basename(str(source)) == ".ckpt.pt.link":
            _counts["link"] += 1
            if FAULT == "kill_before_link" and _counts["link"] == _target:
                _die()
        return _replace(source, destination, *args, **kwargs)

    os.fdopen, os.replace = _checked_fdopen, _checked_replace
'''


# This file's runs: the helpers' tiny model, 4 sequences per step, a checkpoint every INTERVAL steps, a line per step.
RUN = {
    "batch_size": 4,
    "dropout": 0.0,
    "eval_interval": INTERVAL,
    "eval_iters": 2,
    "log_interval": 1,
    "learning_rate": 1e-2,
    "warmup_iters": 5,
    "lr_decay_iters": MAX_ITERS,
    "min_lr": 1e-3,
}


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())} if directory.exists() else {}


def temporaries(out_dir: Path) -> list[str]:
    return sorted(p.name for p in out_dir.iterdir() if p.name.startswith("."))


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


# hooks and data_dir are read only and made in a blink: the tests using them alone need not share a process.
@pytest.fixture(scope="session")
def hooks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hooks")
    (directory / "sitecustomize.py").write_text(FAULT_HOOK)
    return directory


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("data")
    make_char_data(directory, text=sample_text(30_000))
    return directory


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run every interrupted one is compared with (in this process: one thread, like the children)."""
    out_dir = tmp_path_factory.mktemp("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train.main(tiny_train_args(data_dir, out_dir, **RUN, max_iters=MAX_ITERS)) == 0
    finally:
        torch.set_num_threads(threads)
    return out_dir


# ----------------------------------------------------------------------------- kill -9

# The seeded moments of the kills: which save is cut after what share of its bytes, which of a resumed run's links
# of a new best.pt as ckpt.pt is cut, and how many steps after its resume a run is killed.
_moments = random.Random(20240611)
MID_WRITE_SAVE, MID_WRITE_SHARE = _moments.randrange(2, 9), _moments.uniform(0.02, 0.98)
BEFORE_LINK = _moments.randrange(1, 3)
AFTER_STEPS = _moments.randrange(INTERVAL, 3 * INTERVAL)


def fault(hooks: Path, kind: str, save: int, size: int | None = None) -> dict[str, str]:
    """The environment of a child that FAULT_HOOK kills (kind "kill": `size` bytes into its save-th checkpoint
    write; "kill_before_link": before its save-th link of best.pt as ckpt.pt)."""
    extra = {"FAULT_BYTES": str(size)} if size is not None else {}
    return clean_env(PYTHONPATH=str(hooks), FAULT=kind, FAULT_SAVE=str(save), **extra)


def start_train(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def killed_by_its_fault(args: list[str], env: dict[str, str]) -> str:
    """Run train.py until FAULT_HOOK kills it; returns its stdout."""
    process = start_train(args, env)
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:  # the fault did not fire: never leave the run behind
            process.kill()
            process.communicate()
    assert process.returncode == -signal.SIGKILL, stderr
    return stdout


def steps_done(stdout: str) -> int:
    """Steps the killed run finished, from its `iter k:` lines (log_interval=1)."""
    return 1 + max(int(m) for m in re.findall(r"^iter (\d+):", stdout, flags=re.MULTILINE))


def first_step(stdout: str) -> int:
    """The step a resumed run went on from: its first `iter k:` line."""
    return int(re.search(r"^iter (\d+):", stdout, flags=re.MULTILINE)[1])


def checkpoint_after_a_kill(out_dir: Path, done: int) -> int:
    """What every kill leaves once a checkpoint exists: ckpt.pt and best.pt load, at most one checkpoint interval of
    progress is lost, and sample.py finds a checkpoint whichever it asks for. Returns ckpt.pt's step."""
    saved = ckpt.load_checkpoint(out_dir / "ckpt.pt", required_keys=ckpt.RESUME_KEYS)["iter_num"]
    assert done - INTERVAL <= saved <= done < MAX_ITERS, "lost progress: at most one checkpoint interval"
    assert ckpt.load_checkpoint(out_dir / "best.pt")["iter_num"] <= done
    for which in ("best", "latest"):  # what sample.py would load
        assert ckpt.resolve_checkpoint(out_dir, which).name in ("best.pt", "ckpt.pt")
    return saved


@pytest.mark.heavy  # the reference run, then processes
def test_a_run_killed_at_every_kind_of_moment_resumes_and_ends_identical_to_an_uninterrupted_one(
    hooks: Path, data_dir: Path, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """One run killed with SIGKILL four times, each restart going on from what the kill left: during its very first
    save, in the middle of a later save, between writing a new best.pt and linking it as ckpt.pt, and after a
    seeded step (while it is paused there, a second training into its out_dir is refused and sampling from it
    works). The last resume ends with the uninterrupted run's checkpoints."""
    out_dir = tmp_path / "out"
    args = tiny_train_args(data_dir, out_dir, **RUN, max_iters=MAX_ITERS)
    resume = [*args, "--init_from=resume"]

    # Killed during the first save: no checkpoint, one temporary; resuming and sampling fail clearly, touching nothing.
    killed_by_its_fault(args, fault(hooks, "kill", save=1, size=3000))
    assert sorted(p.name for p in out_dir.iterdir() if not p.name.startswith(".")) == ["log.jsonl"]
    first_temporaries = temporaries(out_dir)
    assert len(first_temporaries) == 1
    before = snapshot(out_dir)
    code, _, stderr = run_main(train.main, resume, capsys)
    assert_one_line_error(code, stderr, "ckpt.pt does not exist; train first")
    code, _, stderr = run_main(sample.main, [f"--out_dir={out_dir}", "--device=cpu"], capsys)
    assert_one_line_error(code, stderr, f"no checkpoint in {out_dir}")
    assert snapshot(out_dir) == before, "failed commands touch nothing"

    # Started afresh and killed in the middle of a later save: the previous checkpoint is intact.
    size = (reference / "ckpt.pt").stat().st_size
    stdout = killed_by_its_fault(args, fault(hooks, "kill", save=MID_WRITE_SAVE, size=int(size * MID_WRITE_SHARE)))
    saved = checkpoint_after_a_kill(out_dir, steps_done(stdout))
    assert (saved, steps_done(stdout)) == ((MID_WRITE_SAVE - 1) * INTERVAL, MID_WRITE_SAVE * INTERVAL)
    stale = temporaries(out_dir)
    assert len(stale) == 1 and re.fullmatch(r"\.(ckpt|best)\.pt\.\w+\.tmp", stale[0])
    assert stale != first_temporaries, "starting afresh removed the first save's temporary"
    with pytest.raises(UserError, match="truncated, damaged or not a checkpoint"):
        ckpt.load_checkpoint(out_dir / stale[0])  # a temporary is never a checkpoint

    # Resumed, and killed between writing a new best.pt and linking it as ckpt.pt: best.pt is a step ahead.
    stdout = killed_by_its_fault(resume, fault(hooks, "kill_before_link", save=BEFORE_LINK))
    assert first_step(stdout) == saved, "resumed from ckpt.pt, not from a temporary"
    saved = checkpoint_after_a_kill(out_dir, steps_done(stdout))
    assert temporaries(out_dir) == [".ckpt.pt.link"], "the resume removed the cut save's temporary"
    assert ckpt.load_checkpoint(out_dir / "best.pt")["iter_num"] == steps_done(stdout) == saved + INTERVAL

    # Resumed with no end of its own (max_iters huge, the same schedule), paused after a seeded step, then killed.
    process = start_train([*resume, "--max_iters=1000000"], clean_env(PYTHONUNBUFFERED="1"))
    seen = []
    try:
        for line in process.stdout:
            seen.append(line)
            if line.startswith(f"iter {saved + AFTER_STEPS}:") or len(seen) > 10 * MAX_ITERS:  # the latter: a bug
                break
        # Paused, it still holds the out_dir's lock but no longer trains on a core the commands below need.
        process.send_signal(signal.SIGSTOP)
        second = run_in_process(train.main, [*args, "--init_from=auto"], capsys)
        assert_one_line_error(
            second.returncode, second.stderr, f"in use by another training run (process {process.pid})"
        )
        sampled = run_in_process(
            sample.main, [f"--out_dir={out_dir}", "--checkpoint=latest", "--max_new_tokens=5"], capsys
        )
        assert sampled.returncode == 0, sampled.stderr  # readers take no lock
    finally:
        process.kill()  # no clean-up: only the kernel can release its lock
        stdout = "".join(seen) + process.communicate()[0]
    assert process.returncode == -signal.SIGKILL
    assert first_step(stdout) == saved, "resumed from ckpt.pt, not from the complete .ckpt.pt.link"
    saved = checkpoint_after_a_kill(out_dir, steps_done(stdout))

    # Resumed to the end (the killed run's lock is gone): the uninterrupted run's checkpoints.
    final = run_in_process(train.main, resume, capsys)
    assert final.returncode == 0, final.stderr
    assert first_step(final.stdout) == saved
    assert temporaries(out_dir) == [], "stale temporaries were removed on resume"
    for name in ("ckpt.pt", "best.pt"):
        resumed, uninterrupted = ckpt.load_checkpoint(out_dir / name), ckpt.load_checkpoint(reference / name)
        assert resumed["iter_num"] == uninterrupted["iter_num"]
        assert same_weights(resumed["model"], uninterrupted["model"]), name


# ----------------------------------------------------------------------------- disk full


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(hooks: Path, data_dir: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    env = clean_env(PYTHONPATH=str(hooks), FAULT="enospc", FAULT_SAVE="3", FAULT_BYTES="5000")
    result = run_script("train.py", *tiny_train_args(data_dir, out_dir, **RUN, max_iters=MAX_ITERS), env=env)
    assert_one_line_error(result.returncode, result.stderr, "No space left on device; free some disk space")
    assert re.match(rf"error: cannot write checkpoint {re.escape(str(out_dir))}/(ckpt|best)\.pt: ", result.stderr)
    assert sorted(p.name for p in out_dir.iterdir()) == ["best.pt", "ckpt.pt", "log.jsonl"]  # no temporary left
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt", required_keys=ckpt.RESUME_KEYS)["iter_num"] == 2 * INTERVAL


def test_file_size_limit_of_the_os_during_a_save_keeps_the_previous_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    """A real write failure from the kernel (RLIMIT_FSIZE: EFBIG), no Python patched at all."""
    out_dir = tmp_path / "out"
    assert train.main(tiny_train_args(data_dir, out_dir, **RUN, max_iters=INTERVAL)) == 0
    before = snapshot(out_dir)
    limit = (out_dir / "ckpt.pt").stat().st_size // 2

    def limit_file_size() -> None:  # in the child, before exec: writes past `limit` bytes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = [*tiny_train_args(data_dir, out_dir, **RUN, max_iters=2 * INTERVAL), "--init_from=resume"]
    result = run_script("train.py", *args, preexec_fn=limit_file_size)
    assert_one_line_error(result.returncode, result.stderr, "File too large")
    assert result.stderr.startswith(f"error: cannot write checkpoint {out_dir}/")
    after = snapshot(out_dir)
    assert after.pop("log.jsonl").startswith(before.pop("log.jsonl"))  # the log only grew
    assert after == before  # checkpoints byte for byte as they were, no temporary left


# ----------------------------------------------------------------------------- damaged and malicious checkpoints


class RunsCode:
    """Unpickling this object would create `marker` (a stand-in for any code an attacker wants run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def other_model_state(good: dict, **changes: int) -> tuple[dict, dict]:
    """(state_dict, model_args) of a model shaped like the checkpoint's except for `changes`."""
    model = GPT(GPTConfig(**{**good["model_args"], **changes}))
    return model.state_dict(), config_to_dict(model.config)


def damage_checkpoint(path: Path, how: str, marker: Path) -> None:
    good = torch.load(path, weights_only=True)
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    elif how == "random_bytes":
        path.write_bytes(random.Random(0).randbytes(50_000))
    elif how == "weights_of_another_shape":
        torch.save({**good, "model": other_model_state(good, n_embd=32)[0]}, path)
    elif how == "optimizer_of_another_shape":
        weights, model_args = other_model_state(good, n_embd=32)
        torch.save({**good, "model": weights, "model_args": model_args}, path)
    elif how == "integer_weights":  # an int copy of the embedding would read as zeros
        model = {**good["model"], "transformer.wte.weight": good["model"]["transformer.wte.weight"].to(torch.int32)}
        torch.save({**good, "model": model}, path)
    elif how == "float_model_args":
        torch.save(
            {**good, "model_args": {**good["model_args"], "n_layer": float(good["model_args"]["n_layer"])}}, path
        )
    elif how == "impossible_model_args":
        torch.save({**good, "model_args": {**good["model_args"], "n_layer": 0}}, path)
    elif how == "damaged_training_state":
        torch.save({**good, "sampler": {"seed": 1}, "iter_num": "ten"}, path)
    elif how == "malicious_pickle_in_zip":
        torch.save({**good, "model": RunsCode(marker)}, path)
    elif how == "malicious_raw_pickle":
        # The legacy (non-zip) format: a bare pickle stream, protocol 2 as torch writes it.
        path.write_bytes(pickle.dumps({"model": RunsCode(marker), "model_args": {}}, protocol=2))


# (how the checkpoint is damaged, what train.py --init_from=resume says, what sample.py says; None: it works)
DAMAGES = [
    ("empty", "is empty; the file is damaged", "is empty; the file is damaged"),
    ("truncated", "truncated, damaged or not a checkpoint", "truncated, damaged or not a checkpoint"),
    ("random_bytes", "truncated, damaged or not a checkpoint", "truncated, damaged or not a checkpoint"),
    ("weights_of_another_shape", "transformer.wte.weight has shape", "but model_args give"),
    ("optimizer_of_another_shape", "optimizer state exp_avg has shape", None),
    ("impossible_model_args", "invalid model_args (n_layer must be a positive integer", "invalid model_args"),
    ("integer_weights", "transformer.wte.weight is stored as torch.int32, not floats", "not floats"),
    ("float_model_args", "invalid model_args (n_layer must be a whole number", "invalid model_args"),
    ("damaged_training_state", "has a damaged training state", None),
    ("malicious_pickle_in_zip", "asks to run code on load (posix.mkdir), which is refused", "which is refused"),
    ("malicious_raw_pickle", "asks to run code on load (posix.mkdir), which is refused", "which is refused"),
]


@pytest.fixture(scope="module")
def trained(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete training output (ckpt.pt, best.pt, log.jsonl) to copy and damage."""
    out_dir = tmp_path_factory.mktemp("trained")
    assert train.main(tiny_train_args(data_dir, out_dir, **RUN, max_iters=INTERVAL)) == 0
    return out_dir


@pytest.mark.parametrize(("how", "train_says", "sample_says"), DAMAGES, ids=[d[0] for d in DAMAGES])
def test_damaged_or_malicious_checkpoint_is_one_clear_line_in_train_and_sample(
    how: str,
    train_says: str,
    sample_says: str | None,
    trained: Path,
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    marker = tmp_path / "code_ran"
    for name in ("ckpt.pt", "log.jsonl"):
        (out_dir / name).write_bytes((trained / name).read_bytes())
    damage_checkpoint(out_dir / "ckpt.pt", how, marker)
    before = snapshot(out_dir)

    code, _, stderr = run_main(
        train.main, [*tiny_train_args(data_dir, out_dir, **RUN, max_iters=30), "--init_from=resume"], capsys
    )
    assert_one_line_error(code, stderr, train_says)
    assert str(out_dir / "ckpt.pt") in stderr  # names the file
    code, _, stderr = run_main(sample.main, [f"--out_dir={out_dir}", "--device=cpu", "--max_new_tokens=3"], capsys)
    if sample_says is None:
        assert code == 0, stderr  # the weights are fine: sampling needs nothing else
    else:
        assert_one_line_error(code, stderr, sample_says)
    assert not marker.exists()  # no code from the file ever ran
    assert snapshot(out_dir) == before  # nothing written, nothing removed


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_malicious_checkpoint_refused_end_to_end(script: str, trained: Path, data_dir: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    marker = tmp_path / "code_ran"
    (out_dir / "ckpt.pt").write_bytes((trained / "ckpt.pt").read_bytes())
    damage_checkpoint(out_dir / "ckpt.pt", "malicious_pickle_in_zip", marker)
    if script == "train.py":
        args = [*tiny_train_args(data_dir, out_dir, **RUN, max_iters=MAX_ITERS), "--init_from=resume"]
    else:
        args = [f"--out_dir={out_dir}", "--device=cpu"]
    result = run_script(script, *args)
    assert_one_line_error(result.returncode, result.stderr, "asks to run code on load")
    assert result.stdout == ""
    assert not marker.exists()
    assert sorted(p.name for p in out_dir.iterdir()) == ["ckpt.pt"]


# ----------------------------------------------------------------------------- re-runs and concurrent runs


def test_rerunning_a_scratch_command_is_refused_and_the_earlier_run_kept(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = tmp_path / "out"
    args = tiny_train_args(data_dir, out_dir, max_iters=4, eval_interval=2)
    assert run_in_process(train.main, args, capsys).returncode == 0
    before = snapshot(out_dir)
    again = run_in_process(train.main, args, capsys)
    assert_one_line_error(
        again.returncode,
        again.stderr,
        str(out_dir / "ckpt.pt"),
        "--init_from=resume",
        "another --out_dir",
        "--overwrite=True",
    )
    assert snapshot(out_dir) == before  # nothing written, log.jsonl included
    more = run_in_process(train.main, [*args, "--init_from=auto", "--max_iters=6", "--lr_decay_iters=6"], capsys)
    assert more.returncode == 0, more.stderr
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt")["iter_num"] == 6  # auto resumed the earlier run
    finished = snapshot(out_dir)
    again = run_in_process(train.main, [*args, "--init_from=auto", "--max_iters=6", "--lr_decay_iters=6"], capsys)
    assert again.returncode == 0, again.stderr
    assert "is at step 6 of max_iters=6: nothing left to train" in again.stdout
    assert snapshot(out_dir) == finished  # its summary.json and checkpoints stand
    fresh = run_in_process(train.main, [*args, "--max_iters=2", "--overwrite=True"], capsys)
    assert fresh.returncode == 0, fresh.stderr
    assert ckpt.load_checkpoint(out_dir / "ckpt.pt")["iter_num"] == 2  # replaced, as asked


def test_overwriting_a_run_leaves_nothing_of_it_to_be_read_as_the_new_one(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = tmp_path / "out"
    args = tiny_train_args(data_dir, out_dir, max_iters=4, eval_interval=2, curves=True)
    assert run_in_process(train.main, args, capsys).returncode == 0
    assert {"ckpt.pt", "best.pt", "log.jsonl", "curves.png", "summary.json"} <= set(snapshot(out_dir))
    # A new run that has not saved yet (here: none of its steps, max_iters=0) must not pass off the old files.
    fresh = run_in_process(train.main, [*args, "--max_iters=0", "--overwrite=True", "--curves=False"], capsys)
    assert fresh.returncode == 0, fresh.stderr
    assert f"replaced the earlier run in {out_dir}: removed ckpt.pt, best.pt, log.jsonl, curves.png, summary.json" in (
        fresh.stdout
    )
    assert sorted(snapshot(out_dir)) == ["log.jsonl", "summary.json"]
    entries = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    assert [entry["iter"] for entry in entries] == [0]  # the new run's step-0 evaluation alone
    assert json.loads((out_dir / "summary.json").read_text())["iters"] == 0
    sampled = run_in_process(sample.main, [f"--out_dir={out_dir}", "--device=cpu"], capsys)
    assert_one_line_error(sampled.returncode, sampled.stderr, "no checkpoint in")  # never the old model


def test_a_lone_best_checkpoint_is_not_removed_by_init_from_auto(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = tmp_path / "out"
    assert run_in_process(train.main, tiny_train_args(data_dir, out_dir), capsys).returncode == 0
    (out_dir / "ckpt.pt").unlink()
    before = snapshot(out_dir)
    again = run_in_process(train.main, tiny_train_args(data_dir, out_dir, init_from="auto"), capsys)
    message = f"fine-tune from it with --init_from={out_dir / 'best.pt'} and another --out_dir"
    assert_one_line_error(again.returncode, again.stderr, str(out_dir / "best.pt"), message, "--overwrite=True")
    assert "--init_from=resume" not in again.stderr  # there is no ckpt.pt to resume
    assert snapshot(out_dir) == before


def test_init_from_auto_starts_from_scratch_in_an_empty_out_dir(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    result = run_in_process(train.main, tiny_train_args(data_dir, tmp_path / "out", init_from="auto"), capsys)
    assert result.returncode == 0, result.stderr
    assert ckpt.load_checkpoint(tmp_path / "out" / "ckpt.pt")["iter_num"] == 4
