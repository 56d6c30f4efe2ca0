"""Training curves as a picture: the log.jsonl of one or more runs drawn with matplotlib (headless, Agg).

One row per quantity (train and val loss, val bits per byte, learning rate, DPO's accuracy and margin, GRPO's reward
and pass@1, each evaluation task's accuracies),
one column per x axis (steps, tokens seen, wall time since the run's first entry); each run has its colour and
its label in the legend. plot.py draws runs from the command line; train.py refreshes out_dir/curves.png at
evaluations, at most every CURVES_EVERY_S seconds, and at the end of the run.
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptkit.core.errors import UserError
from gptkit.core.fileio import atomic_write_bytes
from gptkit.train.runlog import LOG_NAME

CURVES_NAME = "curves.png"
# A picture takes about a second to draw: at every evaluation of a short run that is a tenth of the run (the demo's
# five evaluations in a minute), and a refresh more often than this shows someone watching nothing new.
CURVES_EVERY_S = 30.0
X_AXES = (("iter", "step"), ("tokens", "tokens"), ("time", "wall time (minutes)"))
FIXED_PANELS = (
    ("loss", ("train/loss", "val/loss")),
    ("val bits per byte", ("val/bpb",)),
    ("learning rate", ("lr",)),
    # post-training (--objective=dpo, grpo): shown when a run logs them
    ("preference accuracy (DPO)", ("train/accuracy", "val/accuracy")),
    ("reward margin (DPO)", ("train/margin", "val/margin")),
    ("reward (GRPO)", ("train/reward", "val/reward")),
    ("pass@1 (GRPO)", ("train/pass", "val/pass@1")),
)


@dataclass(kw_only=True)
class RunCurves:
    """One run's series: {metric: {iter: (value, tokens or None, seconds since the first entry or None)}}."""

    label: str
    series: dict[str, dict[int, tuple[float, float | None, float | None]]] = field(default_factory=dict)


def read_log(path: Path) -> list[dict[str, Any]]:
    """The entries of a log.jsonl; a last line cut short (a run killed while writing) is skipped."""
    if not path.is_file():
        raise UserError(f"{path} does not exist; give the out_dir of a training run (it writes {LOG_NAME})")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    entries = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise UserError(f"{path} line {number} is not valid JSON; is it a training run's {LOG_NAME}?") from None
        if isinstance(entry, dict) and isinstance(entry.get("iter"), int):
            entries.append(entry)
    return entries


def run_curves(entries: list[dict[str, Any]], label: str) -> RunCurves:
    """The series of one run's entries. Training lines (with "lr") give train/loss and lr, evaluations (with
    "val/loss") the rest; after a resume a step logged twice keeps its later entry."""
    curves = RunCurves(label=label)
    start = next((e["time"] for e in entries if isinstance(e.get("time"), (int, float))), None)
    for entry in entries:
        evaluation = "val/loss" in entry
        seconds = entry["time"] - start if start is not None and isinstance(entry.get("time"), (int, float)) else None
        for key, value in entry.items():
            if key in ("iter", "tokens", "time", "mfu", "tokens_per_s") or not isinstance(value, (int, float)):
                continue
            if key == "train/loss" and evaluation:
                continue  # the evaluation's estimate: the training lines draw this curve
            point = (float(value), entry.get("tokens"), seconds)
            curves.series.setdefault(key, {})[entry["iter"]] = point
    return curves


def panels_for(runs: list[RunCurves]) -> list[tuple[str, tuple[str, ...]]]:
    """The rows to draw: the fixed quantities any run has, then one row per evaluation task."""
    present = {key for run in runs for key in run.series}
    panels = [(title, keys) for title, keys in FIXED_PANELS if present & set(keys)]
    tasks = sorted({key.split("/")[0] for key in present if key.split("/")[-1] in ("acc", "acc_norm")} - {"val"})
    panels += [(f"{task} accuracy", (f"{task}/acc", f"{task}/acc_norm")) for task in tasks]
    return panels


def labels_for(out_dirs: list[Path]) -> list[str]:
    """Each run's label: its directory's name, or the whole path where two names are the same."""
    names = [d.resolve().name or str(d) for d in out_dirs]
    return [str(d) if names.count(name) > 1 else name for d, name in zip(out_dirs, names)]


def plot_runs(out_dirs: list[str | os.PathLike], destination: str | os.PathLike, title: str | None = None) -> Path:
    """Draw the curves of the runs in `out_dirs` into the PNG file `destination` (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed, safe inside training runs
    import matplotlib.pyplot as plt

    paths = [Path(d) for d in out_dirs]
    runs = [run_curves(read_log(p / LOG_NAME), label) for p, label in zip(paths, labels_for(paths))]
    panels = panels_for(runs)
    if not panels:
        raise UserError(f"no curves to draw: the {LOG_NAME} of {', '.join(map(str, paths))} holds no entries yet")
    figure, axes = plt.subplots(len(panels), len(X_AXES), figsize=(5 * len(X_AXES), 3 * len(panels)), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (panel_title, keys) in enumerate(panels):
        for column, (x_index, x_label) in enumerate(X_AXES):
            axis = axes[row][column]
            for number, run in enumerate(runs):
                for style, key in zip(("-", "--"), keys):
                    draw(axis, run, key, x_index, colours[number % len(colours)], style)
            axis.set_title(panel_title, fontsize=9)
            axis.set_xlabel(x_label, fontsize=8)
            axis.grid(alpha=0.3)
            if axis.lines:
                axis.legend(fontsize=7)
    figure.suptitle(title or ", ".join(run.label for run in runs))
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=80)
    plt.close(figure)
    atomic_write_bytes(destination, image.getvalue())  # a crash mid-write leaves the previous picture whole
    return Path(destination)


def draw(axis: Any, run: RunCurves, key: str, x_index: str, colour: str, style: str) -> None:
    """One run's `key` against the x axis `x_index` (iter, tokens or time); nothing where the log lacks that x."""
    points = sorted(run.series.get(key, {}).items())
    xs, ys = [], []
    for iteration, (value, tokens, seconds) in points:
        x = {"iter": iteration, "tokens": tokens, "time": seconds / 60 if seconds is not None else None}[x_index]
        if x is not None:
            xs.append(x)
            ys.append(value)
    if xs:
        axis.plot(xs, ys, style, color=colour, label=f"{run.label} {key}", marker="." if len(xs) < 30 else None)


def refresh_curves(out_dir: str | os.PathLike, enabled: bool, drawn_at: float, at_end: bool) -> float:
    """train.py's out_dir/curves.png, drawn again from its log.jsonl (when `enabled`: rank 0 with curves=True).

    drawn_at: time.monotonic() of the last picture (or of the run's start); before the end (`at_end` False) a
    picture is drawn only CURVES_EVERY_S after it. Returns the new drawn_at: now if it drew, else drawn_at.
    A picture is a nicety: without matplotlib, or if drawing fails, the run goes on and says why once.
    """
    now = time.monotonic()
    if not enabled or (not at_end and now - drawn_at < CURVES_EVERY_S):
        return drawn_at
    try:
        plot_runs([out_dir], Path(out_dir) / CURVES_NAME)
    except (ImportError, UserError, OSError, ValueError) as exc:
        if not getattr(refresh_curves, "warned", False):
            print(f"warning: could not draw {Path(out_dir) / CURVES_NAME} ({exc}); training goes on", flush=True)
            refresh_curves.warned = True  # type: ignore[attr-defined]
    return now
