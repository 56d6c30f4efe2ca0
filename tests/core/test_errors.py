"""gptkit/core/errors.py: run_cli reports a user's mistake in one line (exit 2), lets a bug's full traceback through
(exit 1), and turns SIGTERM into a clean exit 143 after the program's cleanup, like Ctrl-C's 130.

The end-to-end cases (worker processes, temporary files) are in tests/data/test_prepare_corpus.py and
tests/data/test_prepare_fineweb.py; train.py's own SIGTERM handling in tests/test_train.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gptkit.core.errors import EXIT_TERMINATED, Terminated, sigterm_raises
from gptkit.core.signals import StopRequest
from helpers import REPO, clean_env, run_main

needs_default_sigterm = pytest.mark.skipif(
    signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, reason="SIGTERM is handled by whatever runs the tests"
)

# A script as train.py is written: main() behind run_cli. The first argument picks what goes wrong. torch is
# imported by the one case that needs it, so that the others start in a fraction of a second.
FAILING_SCRIPT = textwrap.dedent(
    """
    import errno, os, sys
    from gptkit.core.errors import UserError, run_cli

    def forward(x):
        import torch

        return torch.nn.Linear(8, 4)(x)  # an edited model whose shapes no longer fit

    def main(argv):
        what = argv[0]
        if what == "bug":
            import torch

            forward(torch.zeros(2, 5))
        if what == "bad_fd":
            os.fstat(10**6)
        if what == "user":
            raise UserError("batch_size must be a positive integer,\\n got 0")
        if what == "disk_full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "out/ckpt.pt")
        if what == "pipe":
            for _ in range(100_000):
                print("x" * 100)
        print("done", argv[1:])
        return 0

    run_cli(main)
    """
)


@pytest.fixture(scope="module")
def failing_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    script = tmp_path_factory.mktemp("script") / "failing.py"
    script.write_text(FAILING_SCRIPT)
    return script


def run_script_file(script: Path, *args: str, stdout: object = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=clean_env(PYTHONPATH=str(REPO)),  # the script lives outside the repository
        timeout=120,
    )


def test_a_bug_shows_its_full_traceback_and_exits_1(failing_script: Path) -> None:
    result = run_script_file(failing_script, "bug")
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    # the frames down to the failing line of the script, then torch's own error as the last line
    assert "in main\n    forward(torch.zeros(2, 5))" in result.stderr
    assert "in forward\n    return torch.nn.Linear(8, 4)(x)" in result.stderr
    assert lines[-1].startswith("RuntimeError: ") and "(2x5 and 8x4)" in lines[-1]


def test_an_os_error_that_is_a_bug_shows_its_traceback(failing_script: Path) -> None:
    result = run_script_file(failing_script, "bad_fd")  # EBADF: the program's mistake, not the user's
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert result.stderr.strip().splitlines()[-1] == "OSError: [Errno 9] Bad file descriptor"


def test_user_mistakes_are_one_line_and_exit_2(failing_script: Path) -> None:
    user = run_script_file(failing_script, "user")
    assert (user.returncode, user.stdout) == (2, "")
    assert user.stderr == "error: batch_size must be a positive integer, got 0\n"
    disk = run_script_file(failing_script, "disk_full")
    assert (disk.returncode, disk.stdout) == (2, "")
    hint = "free some disk space or choose another output directory"
    assert disk.stderr == f"error: No space left on device (out/ckpt.pt); {hint}\n"


def test_main_sees_every_argument(failing_script: Path) -> None:
    result = run_script_file(failing_script, "none", "--debug")  # run_cli keeps no flag of its own
    assert (result.returncode, result.stdout, result.stderr) == (0, "done ['--debug']\n", "")


def test_a_closed_pipe_ends_quietly(failing_script: Path) -> None:
    reader = subprocess.Popen(["head", "-n", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    result = run_script_file(failing_script, "pipe", stdout=reader.stdin)
    reader.stdin.close()
    assert reader.stdout.read() == b"x" * 100 + b"\n"
    reader.wait(timeout=60)
    assert (result.returncode, result.stderr) == (141, "")  # as shells report a writer whose reader left


def wait_for_signal() -> None:
    time.sleep(10)  # a handler that raises ends the sleep at once
    raise AssertionError("SIGTERM did not stop the program")


@needs_default_sigterm
def test_sigterm_runs_cleanup_then_exits_143(capsys: pytest.CaptureFixture) -> None:
    cleaned = []

    def main(argv: list[str]) -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for_signal()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM cannot cut the cleanup short
            cleaned.append(True)
        return 0

    code, out, err = run_main(main, [], capsys)
    assert (code, out, err, cleaned) == (EXIT_TERMINATED, "", "terminated by SIGTERM\n", [True])
    assert EXIT_TERMINATED == 143 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


@needs_default_sigterm
def test_except_exception_does_not_swallow_sigterm() -> None:
    with pytest.raises(Terminated), sigterm_raises():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for_signal()
        except Exception:  # what library code often does around I/O
            pytest.fail("Terminated was caught as an Exception")


@needs_default_sigterm
def test_train_py_stop_request_still_takes_sigterm(capsys: pytest.CaptureFixture) -> None:
    def main(argv: list[str]) -> int:
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signal_name == "SIGTERM"  # a request to stop after the step, not an exception
        return 0

    code, out, _ = run_main(main, [], capsys)
    assert code == 0 and out.startswith("SIGTERM received: finishing this step")


CHILD_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from gptkit.core.errors import run_cli

    def main(argv):
        if argv == ["ignored"]:  # started with SIGTERM ignored (e.g. by nohup-like launchers): it stays ignored
            os.kill(os.getpid(), signal.SIGTERM)
            return 0
        ready, started = os.pipe()
        pid = os.fork()  # a forked child inherits the handler but none of the program's cleanup
        if pid == 0:
            os.write(started, b"x")  # Python forgets a signal that arrives before it has finished forking
            time.sleep(30)
            os._exit(0)
        os.read(ready, 1)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
        return 0

    run_cli(main)
    """
)


@needs_default_sigterm
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_still_dies_of_sigterm_and_an_ignored_sigterm_stays_ignored() -> None:
    command = [sys.executable, "-c", CHILD_SCRIPT]
    forked = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=60)
    assert (forked.returncode, forked.stdout, forked.stderr) == (0, "True\n", "")
    ignored = subprocess.run(
        [*command, "ignored"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env(),
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN),
    )
    assert (ignored.returncode, ignored.stderr) == (0, "")


# Two unreachable reference cycles, one left by the script's imports and one by its main; main collects and says
# which of them the collector found.
FREEZING_SCRIPT = textwrap.dedent(
    """
    import gc, weakref
    from gptkit.core.errors import freeze_what_the_imports_made, run_cli

    class Node:
        pass

    def unreachable_cycle():
        node = Node()
        node.itself = node
        return weakref.ref(node)

    gc.collect()  # no automatic collection can come before run_cli: too few objects are made after this one
    left_by_the_imports = unreachable_cycle()

    def main(argv):
        left_by_main = unreachable_cycle()
        freeze_what_the_imports_made()  # a second call, as a test process makes: freezes nothing more
        gc.collect()
        print(left_by_the_imports() is None, left_by_main() is None)
        return 0

    run_cli(main)
    """
)


def test_run_cli_freezes_what_the_imports_made_once(tmp_path: Path) -> None:
    script = tmp_path / "freezing.py"
    script.write_text(FREEZING_SCRIPT)
    result = run_script_file(script)
    assert (result.returncode, result.stdout, result.stderr) == (0, "False True\n", "")
