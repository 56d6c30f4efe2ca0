"""plot.py's command line: run directories as plain arguments, typed settings with "did you mean", a --help that
lists every key under a whole description, and mistakes as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import plot
from helpers import assert_one_line_error, run_main


def write_log(out_dir: Path, steps: int = 5) -> Path:
    """A run's log.jsonl as train.py writes it: a training line per step and an evaluation at the last one."""
    out_dir.mkdir(parents=True)
    lines = [
        {"iter": i, "train/loss": 4.0 - 0.3 * i, "lr": 1e-3, "tokens": 64 * i, "time": 0.5 * i} for i in range(steps)
    ]
    lines.append({"iter": steps - 1, "val/loss": 3.1, "tokens": 64 * (steps - 1), "time": 0.5 * steps})
    (out_dir / "log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out_dir


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.heavy  # draws two figures with matplotlib
def test_runs_are_plain_arguments_and_flags_take_either_form(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = write_log(tmp_path / "a"), write_log(tmp_path / "b", steps=8)
    code, out, _ = run_main(plot.main, [str(a)], capsys)
    assert code == 0 and out.strip() == f"wrote {a / 'curves.png'}" and is_png(a / "curves.png")
    both = tmp_path / "both.png"
    code, out, _ = run_main(plot.main, [str(a), "--out", str(both), str(b), "--title=two runs"], capsys)
    assert code == 0 and out.strip() == f"wrote {both}" and is_png(both)
    assert run_main(plot.main, [str(a)], capsys)[0] == 0  # the run's own drawing is redrawn


def test_an_existing_out_file_is_kept_unless_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = write_log(tmp_path / "a")
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"a drawing of the user's")
    code, _, err = run_main(plot.main, [str(a), f"--out={mine}"], capsys)
    assert_one_line_error(code, err, f"--out={mine} exists; pass --overwrite=True")
    assert mine.read_bytes() == b"a drawing of the user's"
    code, _, err = run_main(plot.main, [str(a), f"--out={tmp_path}"], capsys)
    assert_one_line_error(code, err, f"--out={tmp_path} is a directory")
    code, _, err = run_main(plot.main, [str(a), f"--out={tmp_path / 'curves.txt'}"], capsys)
    assert_one_line_error(code, err, "the drawing is a PNG; name a file ending in .png")
    assert not (tmp_path / "curves.txt").exists()
    code, _, err = run_main(plot.main, [str(a), f"--out={mine / 'c.png'}"], capsys)
    assert_one_line_error(code, err, f"--out={mine / 'c.png'}: {mine} is a file, not a directory")
    assert run_main(plot.main, [str(a), f"--out={mine}", "--overwrite=True"], capsys)[0] == 0 and is_png(mine)


def test_a_mistyped_setting_is_one_line_that_names_the_right_one(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = write_log(tmp_path / "a")
    code, _, err = run_main(plot.main, [str(a), "--titel=x"], capsys)
    assert_one_line_error(code, err, "unknown setting 'titel'", "did you mean --title?")
    code, _, err = run_main(plot.main, [], capsys)
    assert_one_line_error(code, err, "give the out_dir of at least one training run")
    assert not (a / "curves.png").exists()


def test_help_has_a_whole_description_and_every_key(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run_main(plot.main, ["--help"], capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0] == "usage: python plot.py OUT_DIRS ... [--key=value ...]"
    assert lines[2] == plot.DESCRIPTION and lines[2].endswith(".")
    assert all(f"--{key}  " in out for key in ("out_dirs", "out", "title", "overwrite"))
