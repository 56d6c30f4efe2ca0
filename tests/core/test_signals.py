"""Tests for gptkit/core/signals.py: SIGINT and SIGTERM become a request to stop, handlers are restored after."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from gptkit.core.signals import StopRequest


def test_stop_request_turns_signals_into_a_flag_and_restores_handlers(capsys: pytest.CaptureFixture) -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        assert stop.signal_name is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # asking again with Ctrl-C means "now"
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert capsys.readouterr().out == "SIGTERM received: finishing this step, then saving a checkpoint\n"


def test_under_torchrun_a_repeated_ctrl_c_is_not_an_interrupt() -> None:
    before = signal.getsignal(signal.SIGINT)
    with StopRequest(force_on_repeat=False) as stop:  # torchrun passes a Ctrl-C on: each worker sees it twice
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_it_changes_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def enter_and_leave() -> None:
        with StopRequest() as stop:
            seen.append(signal.getsignal(signal.SIGTERM))
            seen.append(stop.signal_name)

    thread = threading.Thread(target=enter_and_leave)
    thread.start()
    thread.join()
    assert seen == [before, None] and signal.getsignal(signal.SIGTERM) is before


def test_at_once_the_first_signal_stops_now(capsys: pytest.CaptureFixture) -> None:
    """Before a run's first step (nothing to save) a signal interrupts whatever runs, a compilation too."""
    with StopRequest() as stop:
        stop.at_once = True
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
        assert (stop.signal_name, stop.signum) == ("SIGTERM", signal.SIGTERM)
    assert capsys.readouterr().out == "SIGTERM received: stopping now (nothing trained yet to save)\n"
