"""Prompt sets for generation with verifiable rewards (GRPO training, eval.py's generative tasks).

A prompt file is JSONL: one record per line with `prompt`, text (one user turn) or a message list (the conversation
so far), and any other fields a reward reads (the built-in ones read `answer`, gptkit.data.rewards). With a chat
tokenizer a prompt is rendered with the chat template, ending in the assistant's marker; with a plain tokenizer
the prompt text is encoded as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptkit.core.errors import UserError
from gptkit.core.fileio import read_utf8_text
from gptkit.data.chat import ChatError
from gptkit.data.tokenizer import no_chat_reason, prompt_opening


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One prompt: its token ids, its record (what rewards read) and where it came from (file:line)."""

    ids: list[int]
    sample: dict
    where: str


def load_prompts(path: str | Path, tokenizer: Any, context: int | None = None) -> list[Prompt]:
    """Every record of a prompt file, rendered for `tokenizer`; UserError naming file:line for a bad record, or for a
    prompt that leaves no room for a token in a model's `context`."""
    path = Path(path)
    try:
        # lines end at "\n" alone (JSON strings may hold U+2028, which splitlines would end a line at)
        lines = read_utf8_text(path).split("\n")
    except OSError as exc:
        raise UserError(f"cannot read the prompt file {path} ({exc})") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
                prompts.append(Prompt(ids=render(record, tokenizer), sample=record, where=where))
            except (json.JSONDecodeError, ChatError, UserError) as exc:  # UserError: text the tokenizer cannot encode
                raise UserError(f"{where}: {exc}") from None
            except RecursionError:
                raise UserError(f"{where}: not valid JSON (nested too deeply)") from None
            if context is not None and len(prompts[-1].ids) >= context:
                raise UserError(
                    f"{where}: the prompt is {len(prompts[-1].ids)} tokens, and the model's context holds {context} "
                    "with the completion; shorten it"
                )
    if not prompts:
        raise UserError(f"{path} holds no prompt")
    return prompts


def render(record: Any, tokenizer: Any) -> list[int]:
    """A record's prompt as ids; ChatError when it has none."""
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), (str, list)) or not record["prompt"]:
        raise ChatError("a prompt record needs a 'prompt' field: text or a list of messages")
    prompt = record["prompt"]
    chat = getattr(tokenizer, "chat", None)
    if chat is None:
        if not isinstance(prompt, str):
            none = "message-list prompts need a chat model's tokenizer (prepare_data/chat.py)"
            raise ChatError(no_chat_reason(tokenizer, none))
        return prompt_opening(tokenizer) + list(tokenizer.encode(prompt))
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return chat.render_prompt(messages, tokenizer)


def completion_text(tokenizer: Any, completion: list[int]) -> str:
    """A completion's text: its tokens up to a stop token (a chat reply's end of turn), decoded."""
    chat = getattr(tokenizer, "chat", None)
    stops = set(chat.reply_stops) if chat is not None else {getattr(tokenizer, "eot_token", None)}
    cut = next((i for i, token in enumerate(completion) if token in stops), len(completion))
    return tokenizer.decode(completion[:cut])
