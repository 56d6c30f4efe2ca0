"""One exception type for problems the user can fix, and the entry-point wrapper that prints them.

Every script's `if __name__ == "__main__"` goes through `run_cli`, so a user-caused failure is one line on
stderr and exit code 2, never a traceback; a bug keeps its full traceback (it is the bug report) and exits 1.
SIGTERM (what schedulers, `timeout` and container stops send) unwinds the program like Ctrl-C, so its cleanup
runs: worker processes are shut down and temporary files removed, then one line and exit code 143.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn


class UserError(Exception):
    """A failure the user caused and can fix. The message is one line: what is wrong and how to fix it."""


EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as shells report a process ended by SIGTERM
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141, as shells report `yes | head`'s yes: the reader left, no bug


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so `except Exception` never swallows it while
    `finally` blocks and context managers still clean up on the way out."""


class _RaiseOnSigterm:
    """The SIGTERM handler run_cli installs: the first SIGTERM raises Terminated in the process that installed it.

    A repeated SIGTERM is ignored, so it cannot cut the cleanup short (kill -9 still ends everything). A child
    forked without exec inherits the handler but not the program's cleanup: there SIGTERM ends the process as it
    would without the handler.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.received = False

    def __call__(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not self.received:
            self.received = True
            raise Terminated


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM raises Terminated in the main thread (see `_RaiseOnSigterm`); the previous handler
    comes back on exit. Does nothing outside the main thread, where Python allows no handlers, or where SIGTERM
    is not at its default (e.g. ignored on purpose by whoever started us). A handler installed inside the block
    (train.py's StopRequest) takes precedence while it is active."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _RaiseOnSigterm())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# OSErrors the user's machine causes and the user can fix: a full disk or quota, permissions or a read-only
# filesystem, a missing or wrong path, a failing disk. Any other OSError (e.g. EBADF, EINVAL) is a bug.
USER_OS_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EIO,
    }
)


def silence_stdout() -> None:
    """Point stdout at the null device: its reader has gone, and later lines are to go nowhere, not to raise."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def say_unless_unread(text: str) -> None:
    """Print one line at once; where stdout's reader has gone (`train.py | tee log` and a Ctrl-C, which ends tee
    too), this and later lines go nowhere instead of raising, so that what the line reports (a stop, a save) still
    happens."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        silence_stdout()


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def describe_os_error(exc: OSError) -> str:
    """A one-line description of an OSError, with a hint for the common cases (disk full, permissions)."""
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    reason = exc.strerror or str(exc)
    hint = ""
    if exc.errno == errno.ENOSPC:
        hint = "; free some disk space or choose another output directory"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        hint = "; check the permissions or choose another path"
    elif exc.errno == errno.ENOENT:
        hint = "; check that the path exists"
    return f"{reason}{where}{hint}"


@functools.cache
def freeze_what_the_imports_made() -> None:
    """Take the objects alive now out of the garbage collector's sight, once per process.

    What a script's imports made (torch's modules and all their objects) lives as long as the process; the collector
    would visit all of it in each full collection, and again at exit. Once: a later call, in a process that ran a
    script's main before (a test process), would also freeze whatever that left behind. (Once by a cache, not by
    gc.get_freeze_count(), which walks every frozen object.)"""
    gc.freeze()


def run_cli(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> NoReturn:
    """Run `main(argv)` and exit with its return code; turn the user's failures into one line on stderr.

    UserError exits 2; an OSError the user can fix (USER_OS_ERRNOS: disk full, permissions, a missing path)
    exits 2 with its reason; Ctrl-C exits 130 and SIGTERM 143, each after the program's cleanup has run; a reader
    that went away (`| head`) 141, quietly. Any other exception is a bug: it propagates, so Python prints its full
    traceback and exits 1 (and `python -m pdb` can stop at it). With `argv` None the process is the script's own:
    once a Ctrl-C has stopped it, a further one ends its exit at once, quietly, not in a finalizer's traceback.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    freeze_what_the_imports_made()
    try:
        with sigterm_raises():
            code = main(args)
    except UserError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, as command-line tools do.
        silence_stdout()
        sys.exit(EXIT_BROKEN_PIPE)
    except KeyboardInterrupt:
        if argv is None:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Terminated:
        print("terminated by SIGTERM", file=sys.stderr)
        sys.exit(EXIT_TERMINATED)
    except OSError as exc:
        if exc.errno not in USER_OS_ERRNOS:
            raise
        print(f"error: {_one_line(describe_os_error(exc))}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except RuntimeError as exc:
        if not lost_a_peer(exc):
            raise
        rank = os.environ.get("RANK", "?")
        print(
            f"error: rank {rank} stops: another process of this run has stopped (its message says why)", file=sys.stderr
        )
        sys.exit(EXIT_INTERNAL_ERROR)
    sys.exit(code or 0)


# What a collective raises when a process it waits on has gone: gloo's and the TCP store's words.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")


def lost_a_peer(exc: RuntimeError) -> bool:
    """Whether `exc` is a collective of a torchrun run failing because another of its processes is gone: that
    process printed the cause (a user's mistake, or a bug with its traceback), so this one's traceback is noise."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and any(words in str(exc) for words in PEER_LOST)
