"""Preference pairs for DPO: TRL's preference records rendered with the chat template, and batches of pairs.

A record (JSONL line or parquet row) is one of TRL's preference forms:

- `{"prompt": "...", "chosen": "...", "rejected": "..."}`: a user turn and two candidate replies;
- `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`: a conversation so far and two candidate
  continuations (assistant turns);
- `{"chosen": [messages], "rejected": [messages]}` (implicit prompt): two whole conversations; the messages they
  share from the start are the prompt.

On disk a preference data directory is chat data (gptkit.data.conversations) whose conversations come in pairs:
conversation 2i is pair i's chosen one, 2i + 1 its rejected one, and the loss mask covers only the candidate
replies (never the prompt). meta.json's source records "pairs": true.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gptkit.core.errors import UserError
from gptkit.data.chat import ChatError
from gptkit.data.conversations import ConversationSplit, open_conversations
from gptkit.data.meta import read_meta
from gptkit.data.packing import PAD_ID, masked_targets
from gptkit.data.prepare.chat_inputs import _as_messages
from gptkit.data.prepare.chat_prepare import (
    LONGER_THAN_BLOCK,
    NO_ASSISTANT_LEFT,
    ChatResult,
    ChatWorker,
    Rendered,
    check_size,
)
from gptkit.data.prepare.items import conversation_key, is_val_document

CANDIDATES = ("chosen", "rejected")


def is_preference_data(meta: dict) -> bool:
    """Whether a data directory's meta.json describes preference pairs (prepare_data/preferences.py)."""
    return isinstance(meta.get("source"), dict) and meta["source"].get("pairs") is True


def preference_of(record: Any) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) message lists of a TRL preference record; chosen and rejected are the whole
    conversations (the prompt's messages first). ChatError naming the problem otherwise."""
    if isinstance(record, ChatError):
        raise record
    if not isinstance(record, dict):
        raise ChatError("not an object with 'prompt', 'chosen' and 'rejected'", reason="not a record")
    missing = [name for name in CANDIDATES if record.get(name) is None]
    if missing:
        fields = ", ".join(repr(name) for name in list(record)[:10]) or "none"
        raise ChatError(
            f"the preference record has no {' nor '.join(repr(m) for m in missing)} field (fields: {fields})",
            reason="no chosen or rejected",
        )
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if chosen == rejected:  # nothing to prefer: its loss is constant and its gradient zero
        raise ChatError("'chosen' and 'rejected' are the same reply", reason="chosen equals rejected")
    if prompt is None and isinstance(chosen, str) and isinstance(rejected, str):
        raise ChatError("text candidates need a 'prompt' field (text) they answer", reason="not a record")
    if all(isinstance(value, str) for value in (prompt, chosen, rejected)):
        user = [{"role": "user", "content": prompt}]
        return user, [*user, _reply(chosen)], [*user, _reply(rejected)]
    chosen, rejected = _as_messages(chosen), _as_messages(rejected)
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise ChatError("'chosen' and 'rejected' must both be text or both be message lists", reason="not a record")
    if prompt is None:  # implicit prompt: the messages both conversations start with
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:  # the replies answer different conversations: no preference between them
            raise ChatError("'chosen' and 'rejected' share no first message (the prompt)", reason="no shared prompt")
        return chosen[:shared], chosen, rejected
    prompt = _as_messages(prompt)
    if not isinstance(prompt, list):
        raise ChatError("'prompt' must be text when the candidates are text, else a message list", "not a record")
    if not prompt:  # as an implicit prompt sharing no message: the replies answer nothing
        raise ChatError("'prompt' holds no message: give the conversation both replies answer", "no shared prompt")
    return prompt, prompt + chosen, prompt + rejected


def preference_columns(names: list[str], field: str, source: str) -> list[str]:
    """The columns of a parquet file of preference records (chat_inputs.ColumnChoice); UserError without both
    candidates."""
    del field  # preference records have fixed fields
    missing = [name for name in CANDIDATES if name not in names]
    if missing:
        raise UserError(
            f"{source} has no column {' nor '.join(repr(m) for m in missing)} (columns: {', '.join(names)}); "
            "preference data needs 'chosen' and 'rejected' (and usually 'prompt')"
        )
    return [name for name in ("prompt", *CANDIDATES) if name in names]


def _reply(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


class PreferenceWorker(ChatWorker):
    """ChatWorker for preference records: each record gives two rendered conversations, chosen then rejected, in
    the same split; their masks cover the candidates' assistant turns only. A pair is cut or dropped as a whole."""

    def _add(self, record: Any, result: ChatResult) -> None:
        job = self.job
        prompt, *candidates = preference_of(record)
        sizes = [_text_bytes(messages) for messages in candidates]  # what render would take the tokenizer's memory for
        for size in sizes:
            check_size(size)
        for messages in candidates:
            if not any(m.get("role") == "assistant" for m in messages[len(prompt) :] if isinstance(m, dict)):
                raise ChatError("a candidate reply has no assistant turn", reason="no assistant turn")
        if job.tokenizer is None:
            for messages in candidates:
                result.chars.update(c for m in messages for c in m["content"])
            return
        rendered = []
        for messages, size in zip(candidates, sizes):
            ids, mask = job.tokenizer.chat.render(messages, job.tokenizer)
            if prompt:
                mask[: len(job.tokenizer.chat.render_prompt(prompt, job.tokenizer)) - 1] = 0
            rendered.append((ids, mask, size))
        limit = job.block_size + 1
        if any(len(ids) > limit for ids, _, _ in rendered):
            if job.too_long == "drop":
                result.dropped[LONGER_THAN_BLOCK] += 1
                return
            rendered = [(ids[:limit], mask[:limit], size) for ids, mask, size in rendered]
            if not all(mask.any() for _, mask, _ in rendered):
                result.dropped[NO_ASSISTANT_LEFT] += 1
                return
            result.cut += 1
        # Keyed by the prompt: every pair answering one prompt goes to one split.
        split = "val" if is_val_document(job.seed, job.val_fraction, conversation_key(prompt)) else "train"
        for ids, mask, size in rendered:
            result.conversations.append(Rendered(split=split, ids=ids, mask=mask, text_bytes=size))


def _text_bytes(messages: list[Any]) -> int:
    """The UTF-8 bytes of a candidate's texts, read before its messages are checked (rendering checks them)."""
    texts = [m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
    return sum(len(text.encode("utf-8", "replace")) for text in texts)


# ------------------------------------------------------------------------------------------- reading pairs


def open_pairs(data_dir: Any, split: str, meta: dict | None = None) -> ConversationSplit:
    """A split of preference data; UserError when the directory holds other data."""
    meta = read_meta(data_dir) if meta is None else meta
    if not is_preference_data(meta):
        raise UserError(
            f"{data_dir} holds no preference pairs; --objective=dpo trains on data from prepare_data/preferences.py"
        )
    split_data = open_conversations(data_dir, split, meta)
    if len(split_data) % 2:
        raise UserError(f"{data_dir}: split {split!r} holds an odd number of conversations; prepare it again")
    return split_data


class PairBatches:
    """Batches of preference pairs, with the interface of loader.BatchSampler (`batch(index)`, `position`,
    state_dict): batch i holds pair slots i*B ... i*B+B-1 of the epochs laid end to end, each epoch the pairs in an
    order seeded by (seed, purpose, epoch), so a batch is a pure function of its index (resume, any process count).
    `shuffle=False` takes the pairs in file order. Rows are cut to block_size + 1 tokens and padded to the batch's
    longest row."""

    def __init__(
        self, split: ConversationSplit, batch_size: int, block_size: int, seed: int, purpose: int = 0, shuffle=True
    ) -> None:
        self.split, self.batch_size, self.row_tokens = split, batch_size, block_size + 1
        self.seed, self.purpose, self.shuffle = seed, purpose, shuffle
        self.pairs = len(split) // 2
        self.position = 0
        self._orders: dict[int, np.ndarray] = {}
        if not self.pairs:
            raise UserError("the preference data holds no pair in this split")

    def _pair_at(self, slot: int) -> int:
        epoch, at = divmod(slot, self.pairs)
        if not self.shuffle:
            return at
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng((self.seed, self.purpose, epoch)).permutation(self.pairs)}
        return int(self._orders[epoch][at])

    def pair_indices(self, index: int) -> list[int]:
        """The pairs of batch `index`."""
        first = index * self.batch_size
        return [self._pair_at(slot) for slot in range(first, first + self.batch_size)]

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` as int64 CPU tensors x, y (2 * batch_size, T): chosen rows, then rejected rows."""
        pairs = self.pair_indices(index)
        conversations = [2 * p for p in pairs] + [2 * p + 1 for p in pairs]
        return rows_of(self.split, conversations, self.row_tokens)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "purpose": self.purpose, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.purpose, self.position = int(state["seed"]), int(state["purpose"]), int(state["position"])
        self._orders = {}


def rows_of(split: ConversationSplit, conversations: list[int], row_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversations as rows (x, y) cut to row_tokens tokens and padded to the longest; y -1 where unscored."""
    parts = [split.conversation(c) for c in conversations]
    width = max(min(len(ids), row_tokens) for ids, _ in parts)
    tokens = np.full((len(parts), width), PAD_ID, dtype=np.int64)
    mask = np.zeros((len(parts), width), dtype=np.int64)
    for row, (ids, row_mask) in enumerate(parts):
        take = min(len(ids), width)
        tokens[row, :take], mask[row, :take] = ids[:take], row_mask[:take]
    return torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(masked_targets(tokens, mask))


class PairEpoch:
    """Every pair of a split once, in file order, as an indexable sequence of (x, y) batches (at most `limit`
    batches): evaluation on a fixed set of pairs."""

    def __init__(self, split: ConversationSplit, batch_size: int, block_size: int, limit: int | None = None) -> None:
        self.split, self.batch_size, self.row_tokens = split, batch_size, block_size + 1
        self.count = -(-(len(split) // 2) // batch_size)
        if limit is not None:
            self.count = min(self.count, limit)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        pairs = range(index * self.batch_size, min((index + 1) * self.batch_size, len(self.split) // 2))
        conversations = [2 * p for p in pairs] + [2 * p + 1 for p in pairs]
        return rows_of(self.split, conversations, self.row_tokens)
