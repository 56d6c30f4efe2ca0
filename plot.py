"""Draw training curves: train and val loss, val bits per byte, learning rate and evaluation tasks of one or more
runs, against steps, tokens and wall time, in one PNG.

python plot.py out-shakespeare-char                                  # → out-shakespeare-char/curves.png
python plot.py out-a out-b --out=compare.png                         # runs overlaid, labelled by directory
"""

from __future__ import annotations

import argparse

from gptkit.core.errors import run_cli
from gptkit.train.curves import CURVES_NAME, plot_runs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plot.py", description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="training output directories (log.jsonl)")
    parser.add_argument("--out", default=None, help=f"the PNG to write (default: OUT_DIR/{CURVES_NAME} of the first)")
    parser.add_argument("--title", default=None, help="the figure's title (default: the runs' names)")
    args = parser.parse_args(argv)
    destination = args.out or f"{args.out_dirs[0]}/{CURVES_NAME}"
    path = plot_runs(args.out_dirs, destination, args.title)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
