"""A training run's output directory: one run at a time, and no earlier run replaced without being asked.

Two ways to lose work are closed here. A second training into the same out_dir would interleave checkpoints and
log lines with the first: `RunDirLock` holds an exclusive lock on out_dir for the whole run, one the kernel drops
when the process dies (even by kill -9), so a crash never leaves a stale lock. Re-running a from-scratch command
would replace the earlier run's checkpoints: `resolve_init_from` refuses unless the user says resume, auto or
overwrite. A fresh start removes what an earlier run left (`remove_earlier_run`), so that nothing of it is read
as the new run's; `open_run_log` does both, in that order, before the run's log is opened. Readers (sampling,
evaluation, serving) take no lock: checkpoints are replaced atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from types import TracebackType
from typing import Any

from gptkit.core.errors import UserError, describe_os_error
from gptkit.train.curves import CURVES_NAME
from gptkit.train.runlog import LOG_NAME, SUMMARY_NAME, RunLog
from gptkit.weights.checkpoint import BEST_NAME, LATEST_NAME, remove_stale_temporaries

# What a training run writes into its out_dir. The latest checkpoint comes first: once it is gone, nothing
# resumes the earlier run, even if removing the rest is cut short.
RUN_FILES = (LATEST_NAME, BEST_NAME, LOG_NAME, CURVES_NAME, SUMMARY_NAME)

INIT_CHOICES_HELP = (
    "scratch | resume (out_dir/ckpt.pt) | auto (resume if out_dir has a checkpoint) | gpt2* | HF dir or hub name "
    "(owner/name) | .gguf file or owner/name:TAG (a hub repository's, e.g. :Q4_K_M) | "
    "a checkpoint file or out_dir to fine-tune from (its weights, a fresh optimizer)"
)


def resolve_init_from(init_from: str, out_dir: str | os.PathLike, overwrite: bool) -> str:
    """What to start from: `auto` becomes resume or scratch by whether out_dir holds a checkpoint (what preemptible
    and elastic jobs need); a fresh start over an earlier run's checkpoint is a UserError unless `overwrite`."""
    directory = Path(out_dir)
    existing = [directory / name for name in (LATEST_NAME, BEST_NAME) if (directory / name).exists()]
    if init_from == "auto" and (directory / LATEST_NAME).exists():
        return "resume"
    if existing and init_from not in ("resume", "auto") and _is_replaced(Path(init_from), directory):
        raise UserError(
            f"--init_from={init_from} is the run in --out_dir={out_dir}, whose checkpoints a new run replaces (the "
            "model it starts from among them); write the new run to another --out_dir"
        )
    if init_from != "resume" and existing and not overwrite:  # auto over a lone best.pt too: it would be removed
        ways = (
            "continue it with --init_from=resume (or auto)"
            if (directory / LATEST_NAME).exists()  # a lone best.pt has no optimizer state to resume: fine-tune from it
            else f"fine-tune from it with --init_from={existing[0]} and another --out_dir"
        )
        raise UserError(
            f"{existing[0]} holds an earlier run that init_from={init_from} would replace; {ways}, write elsewhere "
            "with another --out_dir, or replace it with --overwrite=True"
        )
    return "scratch" if init_from == "auto" else init_from


def _is_replaced(path: Path, directory: Path) -> bool:
    """Whether `path` (a run's folder or file that exists) is `directory` itself, whose checkpoint a model source
    names, or one of the files a new run there replaces (RUN_FILES)."""
    if not path.exists():
        return False
    target, folder = path.resolve(), directory.resolve()
    return target == folder or (target.parent == folder and target.name in RUN_FILES)


def remove_earlier_run(out_dir: str | os.PathLike) -> list[str]:
    """Delete the files an earlier run wrote into `out_dir` (RUN_FILES), before a fresh start writes its own:
    otherwise its log.jsonl would continue the old one (and curves.png and plot.py draw both as one run), and its
    best.pt stand as the new run's best until the new run saves. Returns the names removed. Call it holding the
    RunDirLock, after resolve_init_from allowed the fresh start."""
    removed = []
    for name in RUN_FILES:
        path = Path(out_dir) / name
        if path.is_file():
            path.unlink()
            removed.append(name)
    return removed


def open_run_log(
    out_dir: str, held: contextlib.ExitStack, *, master: bool, writes: bool, fresh: bool, wandb: dict[str, Any] | None
) -> tuple[RunLog, list[str]]:
    """The run's log, and the names of the files of an earlier run that a fresh start (`fresh`) removed. A run that
    `writes` (training, not --eval_only) takes out_dir's lock in rank 0 (`master`) first, and `held` keeps it: before
    the first write, after every check. `wandb`: RunLog's. A run that writes nothing gets no log file."""
    replaced = []
    if master and writes:
        held.enter_context(RunDirLock(out_dir))
        if fresh:
            replaced = remove_earlier_run(out_dir)  # resolve_init_from allowed it (overwrite, or no checkpoint)
        remove_stale_temporaries(Path(out_dir))  # a run killed while saving leaves its temporary file behind
    return RunLog(master, Path(out_dir) if writes else None, wandb), replaced


class RunDirLock:
    """While held, no other training run can write into `out_dir`: an exclusive advisory flock on the directory.

    Locking the directory itself leaves no lock file among the run's outputs. The holder's process id, which the
    refusal names, is read from the kernel's lock table (/proc/locks on Linux).
    """

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.out_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise UserError(f"cannot use out_dir {self.out_dir}: {describe_os_error(exc)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(fd)
            os.close(fd)
            raise UserError(
                f"out_dir {self.out_dir} is in use by another training run (process {holder}); wait for it to end, "
                "stop it, or choose another --out_dir"
            ) from None
        self._fd = fd
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


def lock_holder(fd: int) -> str:
    """The process id holding a flock on the file behind `fd`, from /proc/locks ("unknown" where unreadable).

    Its lines read `N: FLOCK ADVISORY WRITE PID MAJOR:MINOR:INODE START END`, device numbers in hex.
    """
    info = os.fstat(fd)
    file_id = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        table = Path("/proc/locks").read_text(encoding="ascii", errors="replace")
    except OSError:
        return "unknown"
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == file_id:
            return fields[4]
    return "unknown"
