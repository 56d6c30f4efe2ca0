"""Generated token ids to text, one sample at a time: UTF-8 safe, cut at the first stop string.

sample.py prints what `TextStream.push` returns as tokens come; the server (gptkit.serve.app) streams it to clients.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from gptkit.data.tokenizer import Tokenizer


class TextStream:
    """Turns generated token ids into text for one sample: UTF-8 safe, and cut at the first stop string.

    `push` takes the next token id and returns the text that is now safe to print: a multi-byte character split
    across tokens is held back until complete, and so is any tail that could still become a stop string. A stop
    token (end of text, a chat template's end of turn) ends the sample and is not shown.
    """

    def __init__(self, tokenizer: Tokenizer, stops: list[str], stop_tokens: Iterable[int] = ()) -> None:
        self.tokenizer, self.stops, self.stop_tokens = tokenizer, stops, frozenset(stop_tokens)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.printed, self.done = "", 0, False
        self.hold_back = max((len(s) for s in stops), default=1) - 1

    def push(self, token: int) -> str:
        if self.done:
            return ""
        if token in self.stop_tokens:
            return self.finish()
        self.text += self.decoder.decode(self.tokenizer.decode_bytes([token]))
        positions = [self.text.find(stop, max(0, self.printed - self.hold_back)) for stop in self.stops]
        found = [p for p in positions if p >= 0]
        if found:
            self.text, self.done = self.text[: min(found)], True  # what follows the stop string is dropped
            return self.finish()
        safe_end = max(self.printed, len(self.text) - self.hold_back)
        piece, self.printed = self.text[self.printed : safe_end], safe_end
        return piece

    def finish(self) -> str:
        """Mark the sample complete and return the text not yet printed."""
        if not self.done:
            self.text += self.decoder.decode(b"", final=True)  # an incomplete character at the end shows as U+FFFD
            self.done = True
        piece, self.printed = self.text[self.printed :], len(self.text)
        return piece
