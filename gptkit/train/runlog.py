"""What a training run reports: lines on stdout, the same numbers in out_dir/log.jsonl and (optionally) wandb.

The line formats live here, one function each, so that train.py says what it reports and this module how.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from gptkit.core.errors import UserError, say_unless_unread
from gptkit.core.fileio import named_os_error

LOG_NAME = "log.jsonl"
READ_BACK = 1 << 16  # bytes read at a time looking back for the last line's end
SUMMARY_NAME = "summary.json"  # a finished run's figures, for scripts and benchmarks


class RunLog:
    """Rank 0's report of a run. Other processes (`master` False) say and record nothing.

    With an `out_dir`, each record is one JSON object per line in out_dir/log.jsonl (opened for appending: after
    a resume, entries for steps redone after the checkpoint appear again, and the later one is the one that
    counts) and, with `wandb` (start_wandb's project, name and config), a wandb run gets it too. Without an
    `out_dir` (an evaluation-only run) only lines are printed and nothing is created.
    """

    def __init__(self, master: bool, out_dir: Path | None = None, wandb: dict[str, Any] | None = None) -> None:
        self.master = master
        self.file = None
        self.wandb_run = None
        self.tokens_per_iter: int | None = None  # when set, records also get "tokens" (iter × it) and "time" (Unix)
        if not master or out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if wandb is not None:
            self.wandb_run = start_wandb(**wandb, directory=os.environ.get("WANDB_DIR", str(out_dir)))
        self.path = out_dir / LOG_NAME
        cut_to_whole_lines(self.path)
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run

    def say(self, text: str) -> None:
        """Print one line (rank 0 only), at once: runs are watched live and may be killed any time. A run whose
        output pipe closes goes on (and saves when stopped) without its lines."""
        if self.master:
            say_unless_unread(text)

    def record(self, entry: dict[str, Any]) -> None:
        """Append `entry` (which has "iter") to log.jsonl and log it to wandb at step entry["iter"]."""
        if self.tokens_per_iter is not None:  # the x axes of gptkit.train.curves's tokens and wall-time curves
            entry = {**entry, "tokens": entry["iter"] * self.tokens_per_iter, "time": round(time.time(), 3)}
        if self.file is not None:
            try:
                self.file.write(json.dumps(entry) + "\n")
                self.file.flush()
            except OSError as exc:  # a full disk: said of this file (the next run drops what was half written)
                raise named_os_error(exc, self.path) from exc
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in entry.items() if k != "iter" and v is not None}, step=entry["iter"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def cut_to_whole_lines(path: Path) -> None:
    """Drop a last record cut short (a full disk, a kill mid-write), so that what is appended starts a line."""
    with contextlib.suppress(FileNotFoundError), open(path, "r+b") as log:
        size = log.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - READ_BACK)
            log.seek(start)
            newline = log.read(end - start).rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        if end < size:
            log.seek(end)
            last = log.read()
            if _is_json(last):  # a whole record whose newline the cut took: kept
                log.write(b"\n")
            else:
                log.truncate(end)


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False
    return True


def start_wandb(project: str, name: str | None, config: dict[str, Any], directory: str) -> Any:
    """A wandb run (wandb is imported only here: it is slow to import); UserError when it cannot start."""
    try:
        import wandb
    except ImportError:
        raise UserError("--wandb_log=True needs the wandb package: pip install wandb") from None
    try:
        return wandb.init(project=project, name=name, config=config, dir=directory)
    except Exception as exc:  # wandb raises its own error types for login and network problems
        raise UserError(
            f"wandb could not start ({type(exc).__name__}: {exc}); run `wandb login` or set WANDB_MODE=offline"
        ) from exc


# ----------------------------------------------------------------------------- the lines a run prints


def format_bpb(bpb: float | None) -> str:
    """The val bits-per-byte suffix of an evaluation line (empty when the data has no byte counts)."""
    return f" | val bpb {bpb:.4f}" if bpb is not None else ""


def header_line(parameters: int, device: str, dtype: str, processes: int, step_size: str, data_dir: str) -> str:
    """The run's first line; `step_size` says what a step processes (the objective's step_size)."""
    return f"{parameters / 1e6:.2f}M parameters | {device} {dtype} | {processes} process(es) | {step_size} | data {data_dir}"


STANDARD_FIGURES = ("iter", "train/loss", "val/loss", "val/bpb", "lr", "mfu", "tokens_per_s")


def eval_line(result: dict[str, Any], saved: str = "") -> str:
    """An evaluation during training; `result` has iter, train/loss, val/loss and val/bpb (a loss may be None:
    GRPO has none), and maybe an objective's figures (figures_note); `saved` is saved_note's."""
    parts = [
        f"{split} loss {result[f'{split}/loss']:.4f}"
        for split in ("train", "val")
        if result[f"{split}/loss"] is not None
    ]
    figures = figures_note(result)
    body = " | ".join(parts) + figures + format_bpb(result["val/bpb"]) + saved
    # GRPO without --grpo_eval_prompts has no figure at all: the line still says what happened
    return f"step {result['iter']}: " + (body.removeprefix(" | ") or "no figures to evaluate")


def figures_note(entry: dict[str, Any]) -> str:
    """An objective's own figures of a log entry (e.g. "train/accuracy"), as " | train accuracy 0.8125 ..."."""
    extra = [(key, value) for key, value in entry.items() if key not in STANDARD_FIGURES and value is not None]
    return "".join(f" | {key.replace('/', ' ')} {value:.4f}" for key, value in extra)


def saved_note(latest: Path, best: Path | None = None) -> str:
    """The end of a line after a save: the latest checkpoint, and the best one when it was written too."""
    return f" | saved {latest}" + (f" and {best}" if best is not None else "")


def progress_line(entry: dict[str, Any], seconds_per_iter: float) -> str:
    """A training step; `entry` has iter, train/loss, lr, mfu (None: unknown) and tokens_per_s."""
    mfu = f"{entry['mfu']:.1%}" if entry["mfu"] is not None else "n/a"
    return (
        f"iter {entry['iter']}: loss {entry['train/loss']:.4f} | lr {entry['lr']:.2e} | "
        f"{seconds_per_iter * 1000:.1f} ms/iter | {entry['tokens_per_s']:,.0f} tok/s | mfu {mfu}{figures_note(entry)}"
    )


def estimate_line(batches: int, result: dict[str, Any]) -> str:
    """An evaluation-only run's estimate from `batches` batches per split."""
    return (
        f"eval ({batches} batches per split): train loss {result['train/loss']:.4f} | "
        f"val loss {result['val/loss']:.4f}{format_bpb(result['val/bpb'])}"
    )


def full_split_line(tokens: int, loss: float, bpb: float | None) -> str:
    """The exact loss over the whole val split of `tokens` tokens."""
    return f"eval (whole val split, {tokens:,} tokens): val loss {loss:.4f}{format_bpb(bpb)}"


def resumed_line(steps: int, checkpoint: Path, best_val_loss: float) -> str:
    """A resumed run: where it continues from."""
    best = f" (best val loss {best_val_loss:.4f})" if math.isfinite(best_val_loss) else ""  # GRPO has no loss
    return f"resumed from step {steps} of {checkpoint}{best}"


def replaced_line(out_dir: Path, names: list[str]) -> str:
    """A fresh start that removed an earlier run's files."""
    return f"replaced the earlier run in {out_dir}: removed {', '.join(names)}"


def shortened_warmup_line(asked: int, max_iters: int, warmup: int) -> str:
    """A warmup that would not have ended before the run does, shortened."""
    return (
        f"warmup_iters={asked} does not end before max_iters={max_iters}: warming up over {warmup} steps instead "
        "(a tenth of max_iters), so the learning rate reaches its peak"
    )


def stopped_line(signal_name: str | None, steps: int, saved: str | None) -> str:
    """A run stopped by a signal (`signal_name` None: the signal went to another process); `saved` is saved_note's,
    None when the run stopped before training a step (nothing to save)."""
    who = signal_name or "a signal to another process"
    if saved is None:
        return f"stopped by {who} after {steps} steps, before this run trained one: nothing saved"
    return f"stopped by {who} after {steps} steps{saved}; continue with --init_from=resume"


def nothing_left_line(steps: int, max_iters: int, checkpoint: Path) -> str:
    """A run resumed with no step left to train."""
    return (
        f"{checkpoint} is at step {steps} of max_iters={max_iters}: nothing left to train, its results stand; "
        "raise --max_iters to train on"
    )


def cut_short_line(signal_name: str | None, failure: str) -> str:
    """A run stopped by a signal whose work in progress failed because of it (e.g. a compiler process killed by
    the same Ctrl-C)."""
    return (
        f"stopped by {signal_name}: the work it interrupted ended in {failure}; nothing saved since the last "
        "checkpoint, continue with --init_from=auto"
    )


def done_line(steps: int, best_val_loss: float, out_dir: Path, best_saved: bool = True) -> str:
    """The last line of a run. `best_saved`: whether best.pt holds the best val loss; it does not when the weights
    the run began from (step 0, never saved) scored best, which a fine-tune that only got worse shows."""
    best = f", best val loss {best_val_loss:.4f}" if math.isfinite(best_val_loss) else ""  # GRPO has no loss
    if best and not best_saved:
        best += " (the weights it began from, not saved: ckpt.pt holds the last step)"
    return f"done: {steps} iters{best}, checkpoints in {out_dir}"
