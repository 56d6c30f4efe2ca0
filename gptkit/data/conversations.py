"""Chat data on disk: each split's tokens plus two side streams, read back as conversations.

A chat data directory (prepare_data/chat.py) holds, per split, the rendered conversations one after another in
`<split>.bin` (as any token data), their loss masks in `<split>.mask.bin` (one uint8 per token, 1 where the token
is trained on), and where each conversation starts in `<split>.conversations.bin` (a little-endian uint64 token
offset per conversation). meta.json lists the side files as "mask_files" and "conversations_files".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gptkit.core.errors import UserError
from gptkit.data.loader import TokenStream, open_split
from gptkit.data.meta import SIDE_STREAMS, read_meta


def is_chat_data(meta: dict) -> bool:
    """Whether a data directory's meta.json describes chat data (a tokenizer with a chat template)."""
    return "chat" in meta["tokenizer"]


@dataclass(frozen=True, kw_only=True)
class ConversationSplit:
    """One split of chat data: the token stream, its loss mask (a stream of the same length) and where each
    conversation starts."""

    tokens: TokenStream
    mask: TokenStream
    starts: np.ndarray  # int64, one per conversation, increasing; the last conversation ends at len(tokens)
    lengths: np.ndarray = field(init=False)  # tokens of each conversation, derived from starts once

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", np.diff(np.append(self.starts, len(self.tokens))))

    def __len__(self) -> int:
        return len(self.starts)

    def conversation(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Conversation `index` as (ids int64, mask int64)."""
        start, length = int(self.starts[index]), int(self.lengths[index])
        return self.tokens.read_windows([start], length)[0], self.mask.read_windows([start], length)[0]


def open_conversations(data_dir: str | os.PathLike, split: str, meta: dict | None = None) -> ConversationSplit:
    """Open split `split` of a chat data directory; UserError when it is not chat data or its files disagree."""
    directory = Path(data_dir)
    meta = read_meta(directory) if meta is None else meta
    if not is_chat_data(meta):
        raise UserError(f"{directory} holds plain text tokens, not conversations; prepare it with prepare_data/chat.py")
    tokens = open_split(directory, split, meta)
    side = {name: _open_side(directory, meta, split, name) for name in SIDE_STREAMS}
    if len(side["mask"]) != len(tokens):
        raise UserError(
            f"{directory}: split {split!r} has {len(tokens)} tokens but {len(side['mask'])} mask values; prepare it again"
        )
    if len(tokens) and side["mask"].read_windows([0], len(tokens))[0].max() > 1:  # 2 would weigh a token twice
        raise UserError(f"{directory}: split {split!r} has loss-mask values other than 0 and 1; prepare it again")
    starts = (
        side["conversations"].read_windows([0], len(side["conversations"]))[0]
        if len(side["conversations"])
        else np.zeros(0, np.int64)
    )
    if len(starts) != meta["splits"][split]["documents"] or (
        len(starts) and (starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= len(tokens))
    ):
        raise UserError(f"{directory}: split {split!r} conversation offsets are damaged; prepare the data again")
    return ConversationSplit(tokens=tokens, mask=side["mask"], starts=starts)


def _open_side(directory: Path, meta: dict, split: str, name: str) -> TokenStream:
    files = meta["splits"][split].get(f"{name}_files")
    if not isinstance(files, list) or not files:
        raise UserError(f"{directory}/meta.json: split {split!r} lists no {name} file; prepare the data again")
    dtype = np.dtype(SIDE_STREAMS[name]).newbyteorder("<")
    paths, lengths = [], []
    for file_name in files:
        path = directory / file_name
        if Path(file_name).is_absolute() or ".." in Path(file_name).parts or not path.is_file():
            raise UserError(f"{path} (split {split!r}) is missing; prepare the data again")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise UserError(f"{path} is not a whole number of {SIDE_STREAMS[name]} values; prepare the data again")
        paths.append(path)
        lengths.append(size // dtype.itemsize)
    return TokenStream(name=f"{split}.{name}", paths=tuple(paths), lengths=tuple(lengths), dtype=dtype)
