"""gptkit.core.progress: the byte progress bar of downloads and data preparation is a nicety, never in the way."""

from __future__ import annotations

import sys

import pytest

from gptkit.core import progress


def test_no_bar_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    assert progress.byte_progress_bar("download x") is None


def test_the_bar_stays_silent_off_a_terminal(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("tqdm")
    bar = progress.byte_progress_bar("tokenising", 2048, smoothing=0.1)
    bar.update(1024)
    bar.set_postfix_str("1.00M tok/s", refresh=False)
    assert bar.disable  # stderr is captured here, not a terminal: nothing is drawn
    bar.close()
    assert capsys.readouterr().err == ""
