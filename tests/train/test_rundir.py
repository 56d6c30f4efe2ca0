"""gptkit.train.rundir: an out_dir lock held against a real second process, released by kill -9; init_from rules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gptkit.core.errors import UserError
from gptkit.train.rundir import RunDirLock, resolve_init_from

HOLDER = """
import sys, time
from gptkit.train.rundir import RunDirLock
with RunDirLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def hold_lock_in_another_process(out_dir: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(out_dir)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_the_lock_is_refused_to_a_second_holder_and_released_on_exit_and_by_kill_9(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    this_process = rf"\(process {os.getpid()}\)"
    with RunDirLock(out_dir), pytest.raises(UserError, match=this_process), RunDirLock(out_dir):
        pass  # held: even a second holder in the same process is refused
    holder = hold_lock_in_another_process(out_dir)  # released on exit: another process takes it
    try:
        with pytest.raises(UserError) as error, RunDirLock(out_dir):
            pass
        assert f"(process {holder.pid})" in str(error.value) and "another --out_dir" in str(error.value)
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel alone drops the lock
        holder.wait(10)
    with RunDirLock(out_dir):
        assert list(out_dir.iterdir()) == []  # the lock leaves no file behind
        with pytest.raises(UserError, match="in use"), RunDirLock(out_dir):
            pass  # and it is taken again here


def test_an_out_dir_that_cannot_be_created_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(UserError, match="cannot use out_dir"), RunDirLock(tmp_path / "file" / "out"):
        pass


@pytest.mark.parametrize(
    ("files", "init_from", "overwrite", "expected"),
    [
        ([], "auto", False, "scratch"),
        (["ckpt.pt"], "auto", False, "resume"),
        ([], "scratch", False, "scratch"),
        (["ckpt.pt", "best.pt"], "scratch", True, "scratch"),
        (["ckpt.pt"], "resume", False, "resume"),
        ([], "gpt2", False, "gpt2"),
    ],
)
def test_init_from_is_resolved(tmp_path: Path, files: list[str], init_from: str, overwrite: bool, expected: str):
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    assert resolve_init_from(init_from, tmp_path, overwrite) == expected


@pytest.mark.parametrize(
    ("name", "init_from"), [("ckpt.pt", "scratch"), ("best.pt", "scratch"), ("ckpt.pt", "gpt2"), ("best.pt", "auto")]
)
def test_a_fresh_start_over_an_earlier_run_is_refused(tmp_path: Path, name: str, init_from: str) -> None:
    (tmp_path / name).write_bytes(b"x")
    with pytest.raises(UserError) as error:
        resolve_init_from(init_from, tmp_path, overwrite=False)
    message = str(error.value)
    assert str(tmp_path / name) in message
    # A lone best.pt holds no optimizer state to resume: the way on is to fine-tune from it.
    on = "--init_from=resume" if name == "ckpt.pt" else f"--init_from={tmp_path / name} and another --out_dir"
    assert all(way in message for way in (on, "another --out_dir", "--overwrite=True"))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_new_run_starting_from_its_own_out_dir_is_refused_even_with_overwrite(tmp_path: Path, overwrite: bool):
    """--overwrite deletes the earlier run's checkpoints: when the new run starts from them, its starting model."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "best.pt").write_bytes(b"x")
    for init_from in (run, run / "best.pt", tmp_path / "run" / ".." / "run"):
        with pytest.raises(UserError, match=r"is the run in --out_dir=.*write the new run to another --out_dir"):
            resolve_init_from(str(init_from), run, overwrite)
    assert resolve_init_from(str(run / "best.pt"), tmp_path / "elsewhere", overwrite) == str(run / "best.pt")
    (run / "hf").mkdir()  # an export kept in the run's folder: a new run there removes only the run's own files
    (run / "hf" / "config.json").write_text("{}")
    if overwrite:
        assert resolve_init_from(str(run / "hf"), run, overwrite) == str(run / "hf")
