"""The chat template: how a conversation becomes tokens and a loss mask, and how a prompt asks for the next reply.

A conversation is a list of messages `{"role": "system"|"user"|"assistant", "content": "..."}` (OpenAI's format).
It is rendered as

    [begin] <|user|> content <|end|> <|assistant|> content <|end|> ...

where `begin` is the tokenizer's end-of-text token (so packed conversations are told apart, as documents are in
pretraining) and the markers are special tokens added after the base vocabulary. Text is always encoded as ordinary
text: a user who types "<|end|>" gets the tokens of those characters, never the marker (the prompt-injection
boundary). The loss mask is 1 on every assistant turn's content and its end-of-turn token, the tokens a model must
learn to produce, and 0 elsewhere.

The template is recorded in the tokenizer's description (meta.json, and so every checkpoint trained on the data),
so every entry point renders exactly what training saw. A Hugging Face model brings its own template instead
(gptkit.data.jinja_chat.JinjaChatTemplate), used wherever this one is: render, render_prompt, reply_stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

TEMPLATE_NAME = "gptkit-chat-1"
ROLES = ("system", "user", "assistant")
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (*ROLE_MARKERS.values(), END_OF_TURN)


class ChatError(ValueError):
    """A conversation the template cannot render (a wrong role, empty content, ...): the message says which, and
    `reason` names the kind of problem in a few words (data preparation counts skipped conversations by it)."""

    def __init__(self, message: str, reason: str = "invalid conversation") -> None:
        super().__init__(message)
        self.reason = reason


class TextEncoder(Protocol):
    """What rendering needs of a tokenizer: ordinary text to ids."""

    def encode_array(self, text: str) -> np.ndarray: ...


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """The template's special tokens and their ids; `begin` is the id that opens a conversation (None: nothing)."""

    special_tokens: dict[str, int]  # marker text -> id, every one of SPECIAL_TOKENS
    begin: int | None
    name: str = TEMPLATE_NAME
    _role_ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        missing = [marker for marker in SPECIAL_TOKENS if marker not in self.special_tokens]
        if self.name != TEMPLATE_NAME or missing:
            raise ChatError(f"unknown chat template {self.name!r} (this version reads {TEMPLATE_NAME!r})")
        object.__setattr__(self, "_role_ids", {role: self.special_tokens[m] for role, m in ROLE_MARKERS.items()})

    @classmethod
    def for_vocabulary(cls, base_vocab_size: int, begin: int | None) -> ChatTemplate:
        """The template whose markers take the ids right after a base vocabulary of `base_vocab_size` tokens."""
        return cls(special_tokens={m: base_vocab_size + i for i, m in enumerate(SPECIAL_TOKENS)}, begin=begin)

    @property
    def end_of_turn(self) -> int:
        """The id that ends every turn: generation stops on it."""
        return self.special_tokens[END_OF_TURN]

    @property
    def reply_stops(self) -> tuple[int, ...]:
        """The ids that end a generated reply: the end of its turn, or a marker that would open another turn (a
        reply never holds one) and the begin id."""
        stops = [self.end_of_turn, *self._role_ids.values()]
        return tuple(stops + ([] if self.begin is None else [self.begin]))

    @property
    def ids(self) -> list[int]:
        """The markers' ids, in SPECIAL_TOKENS order."""
        return [self.special_tokens[marker] for marker in SPECIAL_TOKENS]

    def render(self, messages: Sequence[Any], tokenizer: TextEncoder) -> tuple[np.ndarray, np.ndarray]:
        """A whole conversation for training: (ids int64, mask uint8), both of one length. ChatError when the
        conversation is invalid (see check_messages) or has no assistant turn."""
        check_messages(messages)
        if not any(message["role"] == "assistant" for message in messages):
            raise ChatError(
                "the conversation has no assistant turn: there is nothing to learn from it", reason="no assistant turn"
            )
        pieces, masks = self._opening()
        for message in messages:
            ids = self._turn(message, tokenizer)
            pieces.append(ids)
            trained = message["role"] == "assistant"
            masks.append(np.concatenate([[0], np.full(len(ids) - 1, int(trained))]).astype(np.uint8))
        return np.concatenate(pieces).astype(np.int64), np.concatenate(masks)

    def render_prompt(
        self, messages: Sequence[Any], tokenizer: TextEncoder, add_generation_prompt: bool = True
    ) -> list[int]:
        """The conversation so far followed by the assistant's marker (without it when not
        `add_generation_prompt`): the prompt whose continuation, up to the end-of-turn id, is the next reply.
        ChatError when the messages are invalid."""
        check_messages(messages)
        pieces, _ = self._opening()
        pieces.extend(self._turn(message, tokenizer) for message in messages)
        pieces.append(np.array([self._role_ids["assistant"]] if add_generation_prompt else [], dtype=np.int64))
        return np.concatenate(pieces).astype(np.int64).tolist()

    def _opening(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if self.begin is None:
            return [], []
        return [np.array([self.begin], dtype=np.int64)], [np.zeros(1, dtype=np.uint8)]

    def _turn(self, message: dict[str, str], tokenizer: TextEncoder) -> np.ndarray:
        # marker, content, end: the mask of render() is 0 on the marker and follows the role on the rest.
        content = np.asarray(tokenizer.encode_array(message["content"]), dtype=np.int64)
        return np.concatenate([[self._role_ids[message["role"]]], content, [self.end_of_turn]])

    def to_jinja(self, begin: str) -> str:
        """The template as Jinja (Hugging Face's `chat_template`, GGUF's `tokenizer.chat_template`, vLLM's
        /tokenizer_info), `begin` being the text of the token a conversation opens with: rendered and then tokenized
        with special tokens, it gives the ids render (and, with add_generation_prompt, render_prompt) gives for the
        same messages."""
        markers = "{" + ", ".join(f"'{role}': '{marker}'" for role, marker in ROLE_MARKERS.items()) + "}"
        return (
            f"{{%- set markers = {markers} -%}}"
            f"{{{{- '{begin}' -}}}}"
            "{%- for message in messages -%}"
            "{%- if message['role'] not in markers -%}"
            "{{- raise_exception('role ' + message['role'] + ' is not system, user or assistant') -}}"
            "{%- elif message['role'] == 'system' and not loop.first -%}"
            "{{- raise_exception('only the first message may be a system message') -}}"
            "{%- endif -%}"
            f"{{{{- markers[message['role']] + message['content'] + '{END_OF_TURN}' -}}}}"
            "{%- endfor -%}"
            f"{{%- if add_generation_prompt -%}}{{{{- '{ROLE_MARKERS['assistant']}' -}}}}{{%- endif -%}}"
        )

    def to_meta(self) -> dict[str, Any]:
        """The "chat" object of a tokenizer's description."""
        return {"template": self.name, "special_tokens": dict(self.special_tokens), "begin": self.begin}

    @classmethod
    def from_meta(cls, record: Any, where: str) -> ChatTemplate:
        """The template a "chat" object describes; ChatError naming `where` when it is malformed."""
        ok = isinstance(record, dict) and isinstance(record.get("special_tokens"), dict)
        ids = list(record["special_tokens"].values()) if ok else []
        ok = ok and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        begin = record.get("begin") if ok else None
        ok = ok and (begin is None or (isinstance(begin, int) and not isinstance(begin, bool)))
        if not ok or len(set(ids)) != len(ids):
            raise ChatError(f"{where}: the 'chat' object needs 'template', 'special_tokens' (text -> id) and 'begin'")
        try:
            return cls(special_tokens=dict(record["special_tokens"]), begin=begin, name=record.get("template"))
        except ChatError as exc:
            raise ChatError(f"{where}: {exc}") from None


def check_messages(messages: Any) -> None:
    """ChatError naming the first problem: not a non-empty list of {role, content} objects, a role other than
    system/user/assistant, content that is not a non-empty string, or a system message after the first."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("'messages' must be a non-empty list of {role, content} objects", reason="no message list")
    for index, message in enumerate(messages):
        where = f"message {index}"
        if not isinstance(message, dict):
            raise ChatError(f"{where} is not an object with 'role' and 'content'", reason="not a message object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ChatError(f"{where} has role {role!r}; use system, user or assistant", reason="wrong role")
        if not isinstance(content, str) or not content:
            raise ChatError(f"{where} ({role}) has empty or non-text content", reason="empty content")
        if role == "system" and index > 0:
            raise ChatError(
                f"{where} is a system message; only the first message may be one", reason="system message not first"
            )
