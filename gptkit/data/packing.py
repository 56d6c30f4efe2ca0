"""Conversations packed into training rows: little compute spent on padding, and every batch reproducible.

A row holds whole conversations one after another, up to block_size + 1 tokens (inputs and the shifted targets),
and the rest padding. Rows are filled best-fit, as nanochat does: from a window of the upcoming conversations, the
longest that still fits goes in next, so short conversations fill the gaps long ones leave. A conversation longer
than a row (data prepared for a longer context) is cut to the row.

Each epoch visits the conversations in an order seeded by (seed, purpose, epoch) and packs them into a plan of rows
once (ids and lengths only: a few integers per conversation). Batch i is rows i*B ... i*B+B-1 of the epochs' plans
laid end to end, so a batch is a pure function of (seed, purpose, i), as the token-window sampler's are
(gptkit.data.loader): resume and the split over processes work unchanged. Targets are -1 wherever the loss mask is
0 (system and user turns, the template's markers, padding), so only assistant tokens are learnt.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass

import numpy as np
import torch

from gptkit.data.conversations import ConversationSplit

BEST_FIT_WINDOW = 256  # upcoming conversations the packer chooses from
PAD_ID = 0  # any id will do: padding is never a target, and causal attention never lets it reach a real one


@dataclass(frozen=True, kw_only=True)
class RowPlan:
    """One epoch's rows: row r holds conversations order[bounds[r]:bounds[r+1]]; counted[r] targets are trained."""

    order: np.ndarray
    bounds: np.ndarray
    counted: np.ndarray

    def __len__(self) -> int:
        return len(self.bounds) - 1


def pack_rows(
    lengths: np.ndarray, order: np.ndarray, row_tokens: int, window: int = BEST_FIT_WINDOW
) -> list[list[int]]:
    """Best-fit packing of conversations (taken in `order`) into rows of `row_tokens`: lists of conversation ids.

    A window of the next `window` conversations is kept; each row takes the longest one that still fits, again and
    again, and is closed when none does. Conversations longer than a row count as a full row.
    """
    sizes = np.minimum(lengths, row_tokens)
    upcoming = iter(order.tolist())
    waiting: list[tuple[int, int, int]] = []  # (-size, arrival, id): heapq pops the longest, oldest first
    arrivals = 0
    rows: list[list[int]] = []
    while True:
        for conversation in upcoming:
            heapq.heappush(waiting, (-int(sizes[conversation]), arrivals, conversation))
            arrivals += 1
            if len(waiting) >= window:
                break
        if not waiting:
            return rows
        rows.append(_fill_row(waiting, row_tokens))


def _fill_row(waiting: list[tuple[int, int, int]], row_tokens: int) -> list[int]:
    row, space, skipped = [], row_tokens, []
    while waiting and space > 0:
        entry = heapq.heappop(waiting)
        if -entry[0] <= space:
            row.append(entry[2])
            space += entry[0]
        else:
            skipped.append(entry)  # too long for what is left of this row: it waits for the next
    for entry in skipped:
        heapq.heappush(waiting, entry)
    return row


class PackedBatches:
    """Packed (x, y) batches of a ConversationSplit, with the same interface as loader.BatchSampler.

    `counted(index)` is the number of trained targets in batch `index`, known without reading its tokens: the
    training step divides its summed loss by the count over all its micro-batches. `shuffle=False` packs the
    conversations in file order (one epoch of it: the full-split evaluation).
    """

    def __init__(
        self,
        split: ConversationSplit,
        batch_size: int,
        block_size: int,
        seed: int,
        purpose: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.split, self.batch_size, self.row_tokens = split, batch_size, block_size + 1
        self.seed, self.purpose, self.shuffle = seed, purpose, shuffle
        self.position = 0
        self.lengths = split.lengths
        self.trained = _trained_per_conversation(split, self.row_tokens)
        self._plans: dict[int, RowPlan] = {}
        self._epoch_starts = [0]  # the first global row of each epoch planned so far
        self._planning = threading.Lock()  # the training loop and its prefetching thread both ask for rows

    def plan(self, epoch: int) -> RowPlan:
        """The rows of `epoch` (planned on first use, the last few kept)."""
        if epoch not in self._plans:
            count = len(self.lengths)
            order = np.arange(count)
            if self.shuffle:
                order = np.random.default_rng((self.seed, self.purpose, epoch)).permutation(count)
            rows = pack_rows(self.lengths, order, self.row_tokens)
            bounds = np.cumsum([0] + [len(row) for row in rows])
            flat = np.fromiter((c for row in rows for c in row), dtype=np.int64, count=int(bounds[-1]))
            counted = np.add.reduceat(self.trained[flat], bounds[:-1]) if len(rows) else np.zeros(0, np.int64)
            self._plans = {key: value for key, value in self._plans.items() if key >= epoch - 2}
            self._plans[epoch] = RowPlan(order=flat, bounds=bounds, counted=counted)
        return self._plans[epoch]

    def rows_per_epoch(self) -> int:
        """Rows of epoch 0 (later epochs differ by a few)."""
        with self._planning:
            return len(self.plan(0))

    def _locate(self, row: int) -> tuple[int, int]:
        # (epoch, row within it) of a global row; epochs are planned in order as far as needed.
        while self._epoch_starts[-1] <= row:
            epoch = len(self._epoch_starts) - 1
            self._epoch_starts.append(self._epoch_starts[-1] + len(self.plan(epoch)))
        epoch = int(np.searchsorted(self._epoch_starts, row, side="right")) - 1
        return epoch, row - self._epoch_starts[epoch]

    def _rows(self, index: int) -> list[tuple[RowPlan, int]]:
        first = index * self.batch_size
        with self._planning:
            return [(self.plan(epoch), at) for epoch, at in map(self._locate, range(first, first + self.batch_size))]

    def counted(self, index: int) -> int:
        """Trained targets in batch `index`."""
        return int(sum(plan.counted[at] for plan, at in self._rows(index)))

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` as int64 CPU tensors x, y (batch_size, block_size); y is -1 where nothing is learnt."""
        tokens = np.full((self.batch_size, self.row_tokens), PAD_ID, dtype=np.int64)
        mask = np.zeros((self.batch_size, self.row_tokens), dtype=np.int64)
        for row, (plan, at) in enumerate(self._rows(index)):
            filled = 0
            for conversation in plan.order[plan.bounds[at] : plan.bounds[at + 1]].tolist():
                start = [int(self.split.starts[conversation])]
                take = min(int(self.lengths[conversation]), self.row_tokens - filled)
                tokens[row, filled : filled + take] = self.split.tokens.read_windows(start, take)[0]
                mask[row, filled : filled + take] = self.split.mask.read_windows(start, take)[0]
                filled += take
        return torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(masked_targets(tokens, mask))

    def padding_share(self) -> float:
        """The share of epoch 0's row positions that hold padding."""
        with self._planning:
            plan = self.plan(0)
        used = np.minimum(self.lengths[plan.order], self.row_tokens).sum()
        return 1.0 - float(used) / (len(plan) * self.row_tokens)

    def state_dict(self) -> dict[str, int]:
        """The sampler's state as plain ints (safe for torch.load(weights_only=True))."""
        return {"seed": self.seed, "purpose": self.purpose, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved state: same seed and purpose, same position."""
        self.seed, self.purpose, self.position = int(state["seed"]), int(state["purpose"]), int(state["position"])
        with self._planning:
            self._plans, self._epoch_starts = {}, [0]


def masked_targets(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The targets of rows of tokens (each next token), -1 wherever the loss mask is 0: those are never learnt,
    whatever token they hold."""
    return np.where(mask[:, 1:] > 0, rows[:, 1:], -1)


def _trained_per_conversation(split: ConversationSplit, row_tokens: int, chunk: int = 1 << 24) -> np.ndarray:
    """Mask-1 tokens of each conversation within its first row_tokens tokens; a conversation's first token is a
    marker (mask 0), so in a row these are exactly its trained targets. The mask is read a chunk at a time."""
    starts, lengths, count = split.starts, split.lengths, len(split.starts)
    trained = np.zeros(count, dtype=np.int64)
    first = 0
    while first < count:
        last = max(first + 1, int(np.searchsorted(starts, starts[first] + chunk, side="right")))
        end = int(starts[last - 1] + lengths[last - 1])
        window = split.mask.read_windows([starts[first]], end - int(starts[first]))[0]
        offsets = starts[first:last] - starts[first]
        trained[first:last] = np.add.reduceat(window, offsets)
        for conversation in np.flatnonzero(lengths[first:last] > row_tokens).tolist():
            at = int(offsets[conversation])
            trained[first + conversation] = int(window[at : at + row_tokens].sum())
        first = last
    return trained


class PackedEpoch:
    """Every conversation of a split once, packed in file order, as an indexable sequence of (x, y) batches: the
    exact per-token loss of the split (weight each batch's mean by its trained targets)."""

    def __init__(self, split: ConversationSplit, block_size: int, batch_size: int) -> None:
        self.batches = PackedBatches(split, batch_size, block_size, seed=0, shuffle=False)
        self.count = -(-self.batches.rows_per_epoch() // batch_size)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        x, y = self.batches.batch(index)
        rows = self.batches.rows_per_epoch() - index * self.batches.batch_size  # the last batch: no second epoch
        return (x[:rows], y[:rows]) if rows < len(x) else (x, y)
