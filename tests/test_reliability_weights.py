"""Weights that hold NaN: every script that loads a model refuses them in one line naming the file and the tensor.

A tiny trained run whose ckpt.pt gets a NaN written into one weight (its best.pt stays clean) is given to sample.py
(the default decoding and --decode=eager), eval.py, export.py, serve.py and train.py (--init_from=FILE and resume):
exit code 2, one line `error: checkpoint .../ckpt.pt: weight NAME holds NaN in 1 of its N values; ...`, nothing
written. Each script's `main` runs in this process (sample.py's real process, exit code and one line:
tests/test_reliability_train.py::test_malicious_checkpoint_refused_end_to_end).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import eval as eval_script
import export
import sample
import serve
import train
from gptkit.weights.checkpoint import save_checkpoint
from helpers import (
    assert_one_line_error,
    make_char_data,
    run_main,
    sample_text,
    tiny_train_args,
)

POISONED = "transformer.h.0.mlp.c_fc.weight"


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root of data/ and run/, a tiny trained run whose ckpt.pt holds one NaN in POISONED."""
    root = tmp_path_factory.mktemp("poisoned")
    make_char_data(root / "data", text=sample_text(20_000))
    assert train.main(tiny_train_args(root / "data", root / "run")) == 0
    path = root / "run" / "ckpt.pt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["model"][POISONED][3, 5] = float("nan")
    save_checkpoint(path, checkpoint)  # a new file: best.pt, which may have been the same file, keeps its weights
    return root


def refusal(root: Path) -> str:
    """What the one line says about the poisoned checkpoint."""
    return f"error: checkpoint {root / 'run' / 'ckpt.pt'}: weight {POISONED} holds NaN in 1 of its 1024 values; "


def files_under(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


LATEST = ["--checkpoint=latest"]
SCRIPTS = {
    "sample": (sample.main, [*LATEST, "--device=cpu", "--start=the", "--max_new_tokens=5"]),
    "sample_eager": (sample.main, [*LATEST, "--device=cpu", "--start=the", "--max_new_tokens=5", "--decode=eager"]),
    "eval": (eval_script.main, [*LATEST, "--device=cpu"]),
    "serve": (serve.main, [*LATEST, "--device=cpu", "--port=0"]),
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_that_run_a_model_refuse_nan_weights_in_one_line(poisoned, script, capsys, monkeypatch):
    monkeypatch.setattr(serve, "serve", lambda app, sock, access_log: None)  # were the model served, return at once
    main, args = SCRIPTS[script]
    code, out, err = run_main(main, [f"--out_dir={poisoned / 'run'}", *args], capsys)
    line = assert_one_line_error(code, err, refusal(poisoned), "use another checkpoint")
    assert line.startswith(refusal(poisoned)) and out == ""


@pytest.mark.parametrize("export_format", ["hf", "gguf"])
def test_export_refuses_nan_weights_and_writes_nothing(poisoned, export_format, tmp_path, capsys):
    destination = tmp_path / "export"
    args = [f"--out_dir={poisoned / 'run'}", *LATEST, f"--format={export_format}", f"--export_dir={destination}"]
    code, _, err = run_main(export.main, args, capsys)
    assert_one_line_error(code, err, refusal(poisoned))
    assert not destination.exists() and list(tmp_path.iterdir()) == []


def test_train_refuses_nan_weights_to_start_from_or_resume(poisoned, tmp_path, capsys):
    """--init_from=FILE writes no run; resume leaves every file of the run as it was."""
    data = poisoned / "data"
    fresh = tmp_path / "fresh"
    args = tiny_train_args(data, fresh, init_from=poisoned / "run" / "ckpt.pt")
    code, _, err = run_main(train.main, args, capsys)
    assert_one_line_error(code, err, refusal(poisoned))
    assert not (fresh / "ckpt.pt").exists() and not (fresh / "best.pt").exists()
    resumed = tmp_path / "run"
    shutil.copytree(poisoned / "run", resumed)
    before = files_under(resumed)
    code, _, err = run_main(train.main, tiny_train_args(data, resumed, init_from="resume", max_iters=6), capsys)
    assert_one_line_error(code, err, f"checkpoint {resumed / 'ckpt.pt'}: weight {POISONED} holds NaN in 1 of")
    assert files_under(resumed) == before
