"""Evaluation tasks beyond the loss: HellaSwag, scored as build-nanogpt scores it, in one process or many.

An item is a context and a few endings, one of them right (HellaSwag's JSONL: `ctx`, `endings`, `label`). Each
ending is appended to the context (with a space before it) and the model's cross-entropy is taken over the
ending's tokens only: `acc` counts the items where the right ending has the lowest summed loss, `acc_norm` those
where it has the lowest mean loss per token. Rows are padded into batches; under torchrun each process scores
its share of the batches and the counts are summed over the processes.

The model is any module whose `model(idx, targets)` returns (logits for every position, loss), with a
`config.block_size` (model.py's GPT, or the DDP/FSDP/compiled module wrapping it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gptkit.core.distributed import Processes, reduce_numbers
from gptkit.core.errors import UserError
from gptkit.core.fileio import atomic_write_json, git_blob_sha1, read_utf8_text
from gptkit.core.settings import setting

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_VAL_ITEMS = 10_042  # the canonical validation file's items: a shorter download is incomplete
# The git blob id of data/hellaswag_val.jsonl in rowanz/hellaswag (master, unchanged since 2019): the checksum of
# the canonical download, read from the repository's tree.
HELLASWAG_VAL_GIT_BLOB = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"
TASKS = ("hellaswag",)
PAD_MULTIPLE = 32  # padded row lengths are rounded up to this: few distinct shapes for torch.compile


@dataclass(frozen=True, kw_only=True)
class Item:
    """One multiple-choice item: the context, its candidate endings, and the index of the right one."""

    context: str
    endings: tuple[str, ...]
    label: int


def parse_tasks(text: str) -> list[str]:
    """The task names of a comma-separated list; UserError for an unknown one."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise UserError(f"unknown evaluation task {unknown[0]!r}; known tasks: {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def item_from_record(record: Any, where: str) -> Item:
    """An Item from one decoded JSON record (ctx, endings, label); UserError naming `where` when it is not one."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with ctx, endings and label")
    missing = [key for key in ("ctx", "endings", "label") if key not in record]
    if missing:
        raise UserError(f"{where}: missing field {missing[0]!r} (HellaSwag items have ctx, endings and label)")
    context, endings, label = record["ctx"], record["endings"], record["label"]
    if not isinstance(context, str) or not context:
        raise UserError(f"{where}: ctx must be a non-empty string")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) and e for e in endings):
        raise UserError(f"{where}: endings must be a list of at least 2 non-empty strings")
    if isinstance(label, str) and label.isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise UserError(f"{where}: label must be the index of the right ending (0 to {len(endings) - 1})")
    return Item(context=context, endings=tuple(endings), label=label)


def read_items(path: str | os.PathLike) -> list[Item]:
    """The items of a HellaSwag-format JSONL file (one object per line; blank lines are skipped)."""
    items = []
    try:
        text = read_utf8_text(path)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; give a HellaSwag JSONL file or URL") from None
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line {number} is not valid JSON ({exc.msg}); give a JSONL file") from None
        items.append(item_from_record(record, f"{path} line {number}"))
    if not items:
        raise UserError(f"{path} holds no items; give a HellaSwag JSONL file")
    return items


def hellaswag_items(source: str = "", cache_dir: str | os.PathLike | None = None, limit: int | None = None) -> list:
    """HellaSwag validation items: from `source` (a local JSONL file or an http(s) URL, cached), or by default
    downloaded once from the canonical URL into the cache; the first `limit` of them when given.

    The canonical copy must hold all 10,042 items and have the git blob id the repository lists for the file; a
    truncated or different file is refused and removed from the cache, so the next run downloads it again."""
    from gptkit.core import download  # here, not at the top: requests is slow to import and few runs download

    path = download.resolve_source(source or HELLASWAG_URL, cache_dir=cache_dir)
    try:
        items = read_items(path)
    except UserError:
        if not source:
            path.unlink(missing_ok=True)
        raise
    if not source and len(items) != HELLASWAG_VAL_ITEMS:
        path.unlink(missing_ok=True)
        raise UserError(
            f"{HELLASWAG_URL} gave {len(items)} items, expected {HELLASWAG_VAL_ITEMS}; the download is damaged or "
            "the file changed (removed from the cache: run again, or pass --hellaswag_path=FILE)"
        )
    if not source and git_blob_sha1(path) != HELLASWAG_VAL_GIT_BLOB:
        path.unlink(missing_ok=True)
        raise UserError(
            f"{HELLASWAG_URL} is not the published file (its git blob id is not {HELLASWAG_VAL_GIT_BLOB[:12]}...; "
            "removed from the cache): run again, or pass --hellaswag_path=FILE"
        )
    return items[:limit] if limit else items


# ----------------------------------------------------------------------------- scoring


def encode_item(tokenizer: Any, item: Item, max_tokens: int) -> list[tuple[list[int], int]] | None:
    """For each ending: (context + " " + ending tokens, index of the ending's first token), cut to the last
    `max_tokens` tokens (the context's start goes first; an ending longer than the window loses its end).
    None when the tokenizer cannot encode the item (a character-level vocabulary without one of its characters)."""
    try:
        context = tokenizer.encode(item.context)  # no bos, as the harness's scorer (and build-nanogpt's) scores it
        endings = [tokenizer.encode(" " + ending) for ending in item.endings]
    except UserError:
        return None
    rows = []
    for ending in endings:
        ending = ending[: max_tokens - 1]
        kept_context = context[-(max_tokens - len(ending)) :]
        rows.append((kept_context + ending, len(kept_context)))
    return rows


def block_size_of(model: torch.nn.Module) -> int:
    """The context length of a model, or of the model inside a DDP wrapper."""
    return getattr(model, "module", model).config.block_size


@torch.no_grad()
def score_rows(
    model: torch.nn.Module, rows: Sequence[tuple[list[int], int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each (tokens, start) row: the summed cross-entropy of tokens[start:] given what precedes them, the
    number of those tokens, and whether each of them is the model's most likely next token. One forward pass."""
    width = max(len(tokens) for tokens, _ in rows) - 1
    width = min(-(-width // PAD_MULTIPLE) * PAD_MULTIPLE, block_size_of(model)) if width > 0 else 1
    inputs = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), width), -1, dtype=torch.long)
    for row, (tokens, start) in enumerate(rows):
        inputs[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
        targets[row, start - 1 : len(tokens) - 1] = torch.tensor(tokens[start:])
    inputs, targets = inputs.to(device), targets.to(device)
    logits, _ = model(inputs, targets)
    logits = logits.float()
    losses = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-1, reduction="none")
    scored = targets >= 0
    greedy = (logits.argmax(-1) == targets) | ~scored
    return losses.sum(1).cpu(), scored.sum(1).cpu(), greedy.all(1).cpu()


@dataclass(kw_only=True)
class Counts:
    """The tallies of one task: items scored, right by summed loss, right by mean loss, skipped (unencodable)."""

    n: int = 0
    correct: int = 0
    correct_norm: int = 0
    skipped: int = 0

    def as_list(self) -> list[float]:
        return [self.n, self.correct, self.correct_norm, self.skipped]

    def result(self) -> dict[str, Any]:
        acc = self.correct / self.n if self.n else math.nan
        acc_norm = self.correct_norm / self.n if self.n else math.nan
        return {"acc": acc, "acc_norm": acc_norm, "n": self.n, "skipped": self.skipped}


def choices(model: torch.nn.Module, encoded: list[list[tuple[list[int], int]]], device: torch.device) -> list[tuple]:
    """(choice by summed loss, choice by mean loss) of each encoded item, scored together in one pass."""
    rows = [row for item_rows in encoded for row in item_rows]
    sums, counts, _ = score_rows(model, rows, device)
    picks, first = [], 0
    for item_rows in encoded:
        item_sums, item_counts = sums[first : first + len(item_rows)], counts[first : first + len(item_rows)]
        picks.append((int(item_sums.argmin()), int((item_sums / item_counts).argmin())))
        first += len(item_rows)
    return picks


def score_items(
    model: torch.nn.Module,
    tokenizer: Any,
    items: Sequence[Item],
    device: torch.device,
    batch_size: int = 16,
    procs: Processes | None = None,
    precision: contextlib.AbstractContextManager | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Counts:
    """The counts over `items`, `batch_size` items per forward pass, the batches shared round-robin among the
    processes (every process makes the same number of passes, as FSDP needs) and the counts summed over them.
    `on_batch(items)` is called after each batch this process scores (a progress bar). The model is left in the
    mode it was in."""
    procs = procs or Processes()
    precision = precision or contextlib.nullcontext()
    batches = [items[start : start + batch_size] for start in range(0, len(items), batch_size)]
    counts = Counts()
    was_training = model.training
    model.eval()
    for round_start in range(0, len(batches), procs.world_size):
        index = round_start + procs.rank
        batch = batches[min(index, len(batches) - 1)]  # a process without a batch this round repeats the last one
        encoded = [encode_item(tokenizer, item, block_size_of(model) + 1) for item in batch]
        kept = [(item, rows) for item, rows in zip(batch, encoded) if rows is not None]
        with precision:  # a pass even when no item could be encoded: every process makes the same passes
            picks = choices(model, [rows for _, rows in kept] or [[([0, 0], 1)]], device)
        if index >= len(batches):
            continue
        counts.skipped += len(batch) - len(kept)
        for (item, _), (pick, pick_norm) in zip(kept, picks):
            counts.n += 1
            counts.correct += pick == item.label
            counts.correct_norm += pick_norm == item.label
        if on_batch is not None:
            on_batch(len(batch))
    model.train(was_training)
    n, correct, correct_norm, skipped = (int(v) for v in reduce_numbers(counts.as_list(), device, procs))
    return Counts(n=n, correct=correct, correct_norm=correct_norm, skipped=skipped)


def evaluate_tasks(
    model: torch.nn.Module,
    tokenizer: Any,
    items_by_task: dict[str, Sequence[Item]],
    device: torch.device,
    batch_size: int = 16,
    procs: Processes | None = None,
    precision: contextlib.AbstractContextManager | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """{task: {"acc", "acc_norm", "n", "skipped"}} for each task's items (see score_items)."""
    results = {}
    for task, items in items_by_task.items():
        counts = score_items(model, tokenizer, items, device, batch_size, procs, precision, on_batch)
        results[task] = counts.result()
    return results


def path_setting(used_by: str = "") -> Any:
    """--hellaswag_path, as eval.py and train.py (`used_by`: its eval_tasks) take it."""
    return setting(
        "",
        f"{used_by}HellaSwag JSONL file or URL (ctx, endings, label); empty: the canonical validation set, downloaded "
        "once",
    )


def load_task_items(tasks: Sequence[str], hellaswag_path: str = "", limit: int | None = None) -> dict[str, list[Item]]:
    """The items of each task (see hellaswag_items for where they come from)."""
    return {task: hellaswag_items(hellaswag_path, limit=limit) for task in tasks if task == "hellaswag"}


def log_entry(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Flat figures for log.jsonl and wandb: {"hellaswag/acc": ..., "hellaswag/acc_norm": ..., "hellaswag/n": items
    scored, ...}."""
    return {
        f"{task}/{key}": value
        for task, result in results.items()
        for key, value in result.items()
        if key in ("acc", "acc_norm", "n")
    }


def summary_line(results: dict[str, dict[str, Any]]) -> str:
    """One line: each task's acc and acc_norm and how many items were scored (and skipped, when any)."""
    parts = []
    for task, result in results.items():
        skipped = f", {result['skipped']} skipped" if result.get("skipped") else ""
        parts.append(f"{task} acc {result['acc']:.4f} acc_norm {result['acc_norm']:.4f} (n={result['n']}{skipped})")
    return " | ".join(parts)


def write_json(path: str | os.PathLike, results: dict[str, Any]) -> None:
    """The results as a JSON file, written atomically (its directory created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, results)


class TrainingTasks:
    """The evaluation tasks of a training run (train.py's eval_tasks): their items, read once (rank 0 downloads
    first, the other processes then read its cached copy), scored at the evaluations whose step is a multiple of
    `interval` and at the end."""

    def __init__(
        self,
        *,
        tasks: str,
        interval: int | None,
        limit: int | None,
        hellaswag_path: str,
        tokenizer_meta: dict,
        batch_size: int,
        procs: Processes,
    ) -> None:
        from gptkit.data.tokenizer import tokenizer_from_meta

        self.names, self.interval, self.batch_size, self.procs = parse_tasks(tasks), interval, batch_size, procs
        self.items: dict[str, list[Item]] = {}
        self.tokenizer = tokenizer_from_meta(tokenizer_meta) if self.names else None
        if self.names and procs.master:
            self.items = load_task_items(self.names, hellaswag_path, limit)
        if self.names and procs.distributed:
            torch.distributed.barrier()  # rank 0 has the file in the cache now (torchrun stops us if it failed)
        if self.names and not procs.master:
            self.items = load_task_items(self.names, hellaswag_path, limit)

    def run(self, model: torch.nn.Module, iter_num: int, at_end: bool, precision: Any, log: Any) -> dict[str, float]:
        """The tasks' figures for the log entry of step `iter_num` (nothing when they are not due), and their line
        said on `log` (a gptkit.train.runlog.RunLog). Every process must call it (the counts are reduced)."""
        if not self.names or not (at_end or self.interval is None or iter_num % self.interval == 0):
            return {}
        device = next(model.parameters()).device
        results = evaluate_tasks(model, self.tokenizer, self.items, device, self.batch_size, self.procs, precision)
        log.say(f"step {iter_num}: {summary_line(results)}")
        return log_entry(results)
