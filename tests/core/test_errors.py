"""gptkit/core/errors.py: run_cli turns SIGTERM into a clean exit 143 after the program's cleanup, like Ctrl-C's 130.

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

import pytest

from gptkit.core.errors import EXIT_TERMINATED, Terminated, sigterm_raises
from gptkit.core.signals import StopRequest
from helpers import REPO, clean_env, run_main

pytestmark = pytest.mark.skipif(
    signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, reason="SIGTERM is handled by whatever runs the tests"
)


def wait_for_signal() -> None:
    time.sleep(10)  # a handler that raises ends the sleep at once
    raise AssertionError("SIGTERM did not stop the program")


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


def test_except_exception_does_not_swallow_sigterm() -> None:
    with pytest.raises(Terminated), sigterm_raises():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for_signal()
        except Exception:  # what library code often does around I/O
            pytest.fail("Terminated was caught as an Exception")


def test_train_py_stop_request_still_takes_sigterm(capsys: pytest.CaptureFixture) -> None:
    def main(argv: list[str]) -> int:
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signal_name == "SIGTERM"  # a request to stop after the step, not an exception
        return 0

    code, out, _ = run_main(main, [], capsys)
    assert code == 0 and out.startswith("SIGTERM received: finishing this step")


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture) -> None:
    def main(argv: list[str]) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for_signal()
        return 0

    with pytest.raises(Terminated):
        run_main(main, ["--debug"], capsys)


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
