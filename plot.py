"""Draw training curves: train and val loss, val bits per byte, learning rate and evaluation tasks of one or more
runs, against steps, tokens and wall time, in one PNG.

python plot.py out-shakespeare-char                                  # → out-shakespeare-char/curves.png
python plot.py out-a out-b --out=compare.png                         # runs overlaid, labelled by directory
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gptkit.core.errors import UserError, run_cli
from gptkit.core.fileio import check_writable_parent
from gptkit.core.settings import parse_settings, setting, setting_list
from gptkit.train.curves import CURVES_NAME, plot_runs

DESCRIPTION = "Draw the training curves of one or more runs (their out_dir/log.jsonl) into one PNG."


@dataclass(kw_only=True)
class PlotSettings:
    out_dirs: list[str] = setting_list([], "training output directories (log.jsonl); also given as plain arguments")
    out: str = setting("", f"the PNG to write, a new file (empty: OUT_DIR/{CURVES_NAME} of the first run, redrawn)")
    title: str = setting("", "the figure's title (empty: the runs' names)")
    overwrite: bool = setting(False, "replace an existing --out file")

    def validate(self) -> None:
        if not self.out_dirs:
            raise UserError("give the out_dir of at least one training run, e.g. python plot.py out-shakespeare-char")
        if self.out and Path(self.out).is_dir():
            raise UserError(f"--out={self.out} is a directory; name a PNG file")
        if self.out and Path(self.out).suffix.lower() != ".png":
            raise UserError(f"--out={self.out}: the drawing is a PNG; name a file ending in .png")
        if self.out:
            check_writable_parent(Path(self.out), "--out")
        # A run's own curves.png is train.py's drawing of its log, redrawn at every evaluation; another file may be
        # the user's.
        if self.out and Path(self.out).exists() and not self.overwrite:
            raise UserError(f"--out={self.out} exists; pass --overwrite=True to replace it, or name a new file")


def main(argv: list[str]) -> int:
    cfg = parse_settings(PlotSettings, argv, prog="plot.py", description=DESCRIPTION, positional="out_dirs")
    destination = cfg.out or f"{cfg.out_dirs[0]}/{CURVES_NAME}"
    path = plot_runs(cfg.out_dirs, destination, cfg.title or None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
