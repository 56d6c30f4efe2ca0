"""Ctrl-C and SIGTERM as a request to stop: the training loop finishes its step, saves and exits cleanly, with the
conventional exit code of the signal (130 after Ctrl-C, 143 after SIGTERM)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from gptkit.core.errors import say_unless_unread


class StopRequest:
    """While active, SIGINT and SIGTERM ask the training loop to stop after the current step and save.

    `signal_name` is the name of the signal received (None until then), `signum` its number (0 until then). With `force_on_repeat`, a second Ctrl-C
    stops at once (KeyboardInterrupt); under torchrun that is off, because torchrun passes a Ctrl-C on to its
    workers, which then see it twice. While `at_once` is set (nothing trained yet, so nothing to save: e.g. during
    the first step's compilation) the first signal stops at once too, as KeyboardInterrupt. The previous handlers
    come back on exit. Outside the main thread (where Python allows no signal handlers) it does nothing.
    """

    def __init__(self, force_on_repeat: bool = True) -> None:
        self.signal_name: str | None = None
        self.signum = 0
        self.force_on_repeat = force_on_repeat
        self.at_once = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None:
            if self.force_on_repeat and signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signal_name, self.signum = signal.Signals(signum).name, signum
        if self.at_once:
            say_unless_unread(f"{self.signal_name} received: stopping now (nothing trained yet to save)")
            raise KeyboardInterrupt
        say_unless_unread(f"{self.signal_name} received: finishing this step, then saving a checkpoint")


def exit_code(signum: int) -> int:
    """The exit code of a program that stopped cleanly on signal `signum`, as shells report one ended by it: 130
    after Ctrl-C (SIGINT), 143 after SIGTERM."""
    return 128 + signum
