"""A model's own chat template: the Jinja of a Hugging Face tokenizer (tokenizer_config.json's `chat_template` or a
chat_template.jinja file), rendered and tokenized as transformers' `apply_chat_template(..., tokenize=True,
sanitize_control_tokens=True)` does.

Rendering uses transformers' environment: a sandbox with trim_blocks and lstrip_blocks, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII characters, loop controls and the `{% generation %}` tag, with the
tokenizer's named special tokens (bos_token, eos_token, ...) as variables. A control token (a special token, or an
added token the template writes) typed inside a message is encoded as the characters it is made of, never as the
token: only the template itself writes control tokens (the prompt-injection boundary of gptkit.data.chat).

The loss mask comes from rendering prefixes of the conversation: assistant turn i spans the tokens between
render(messages[:i], add_generation_prompt=True) and render(messages[:i + 1]), up to and including the first
reply-stop token (the template's end of turn); both renderings must be prefixes of the whole conversation's
tokens, or the turns cannot be told apart and the conversation is refused. One exception: a template may open the
last turn with more than the same turn gets when others follow (Qwen3's thinking block); the turn then runs to its
first reply stop, and must end as the last turn rendered alone ends.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np

from gptkit.core.errors import UserError
from gptkit.data.chat import ChatError, check_messages

TEMPLATE_NAME = "jinja"
# transformers' markers around a control token typed in a message (Unicode private use plane 15).
CONTROL_START, CONTROL_END = "\U000f0000", "\U000f0001"
# The conversation whose assistant turn shows the template's end of turn.
PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})
PREFIX_FIX = "the chat template must render each turn the same whatever follows it"
# What rendering a template can raise when the template or the conversation is at fault (not a bug of ours).
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class ChatTextEncoder(Protocol):
    """What the template needs of a tokenizer: text with and without reading added tokens in it."""

    def encode_without_added(self, text: str) -> list[int]: ...

    def encode_with_added(self, text: str) -> list[int]: ...


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body: the mask here
    comes from prefixes, so templates without the tag get one too."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.datetime.now().strftime(date_format)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled as transformers compiles it; jinja2.TemplateSyntaxError when it is not valid Jinja."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def template_literals(source: str) -> str:
    """The template's literal text and string constants, joined by NULs (where transformers looks for the added
    tokens the template writes)."""
    tree = compile_template(source).environment.parse(source)
    literals = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(sorted(literals))


def control_tokens(source: str, added_tokens: dict[str, tuple[int, bool]]) -> dict[str, int]:
    """The added tokens a message may not produce: the special ones, and those the template writes (whitespace
    tokens apart). `added_tokens` maps each added token's text to (id, special)."""
    literals = template_literals(source)
    return {
        text: token_id
        for text, (token_id, special) in added_tokens.items()
        if special or (text in literals and not text.isspace())
    }


def _mark(value: Any, pattern: re.Pattern) -> Any:
    # A control token typed in a message is wrapped in the markers, so the encoder reads it as text.
    if isinstance(value, str):
        value = value.replace(CONTROL_START, "").replace(CONTROL_END, "")
        return pattern.sub(lambda match: CONTROL_START + match.group(0) + CONTROL_END, value)
    if isinstance(value, dict):
        return {key: _mark(item, pattern) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(item, pattern) for item in value]
    return value


def _first_control_after_reply(text: str, special: dict[str, int]) -> int | None:
    """The control token the probe's rendered `text` writes first after the assistant's reply: its end of turn. The
    first control token of the turn may open it instead (Qwen3's <think> before the reply). None if not found."""
    reply = text.rfind(PROBE[1]["content"])
    if reply < 0:
        return None
    after = reply + len(PROBE[1]["content"])
    found = [(text.find(token, after), -len(token), token) for token in special if text.find(token, after) >= 0]
    return special[min(found)[2]] if found else None


@dataclass(frozen=True, kw_only=True)
class JinjaChatTemplate:
    """A Hugging Face chat template with what tokenizing it needs: the variables it is rendered with (the named
    special tokens), the control tokens (text -> id), the end-of-turn id and the ids that end a reply."""

    source: str
    variables: dict[str, str]
    special_tokens: dict[str, int]
    end_of_turn: int
    reply_stops: tuple[int, ...]
    name: str = TEMPLATE_NAME
    begin: None = None  # the template writes its own opening (e.g. bos_token)
    _pattern: re.Pattern = field(init=False, repr=False, compare=False)
    _markers: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        longest_first = sorted(self.special_tokens, key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!) never matches
        markers = re.compile(f"{CONTROL_START}({pattern.pattern}){CONTROL_END}|[{CONTROL_START}{CONTROL_END}]")
        object.__setattr__(self, "_pattern", pattern)
        object.__setattr__(self, "_markers", markers)

    @classmethod
    def build(
        cls,
        source: str,
        variables: dict[str, str],
        added_tokens: dict[str, tuple[int, bool]],
        tokenizer: ChatTextEncoder,
        extra_stops: Sequence[int] = (),
    ) -> JinjaChatTemplate:
        """The template of a tokenizer: compiled, its control tokens found, and its end of turn read from how it
        renders a short conversation (the first control token after the assistant's reply text). ChatError when the
        template is not valid Jinja, fails on that conversation, or ends a turn with no control token."""
        try:
            compile_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatError(f"the chat template is not valid Jinja (line {exc.lineno}: {exc.message})") from None
        special = control_tokens(source, added_tokens)
        probe = cls(source=source, variables=dict(variables), special_tokens=special, end_of_turn=-1, reply_stops=())
        try:
            start, end, ids = probe.turn_span(list(PROBE), 1, probe.ids_of(list(PROBE), False, tokenizer), tokenizer)
        except UserError as exc:  # the template's own text (its newlines) is beyond the vocabulary
            raise ChatError(f"the chat template's own text cannot be tokenized: {exc}") from None
        controls = set(special.values())
        ends = [token_id for token_id in ids[start:end] if token_id in controls]
        if not ends:
            raise ChatError("the chat template ends an assistant turn with no special token: a reply could not stop")
        end_of_turn = _first_control_after_reply(probe.render_text(list(PROBE), False), special)
        end_of_turn = end_of_turn if end_of_turn in ends else ends[0]
        stops = tuple(dict.fromkeys([end_of_turn, *extra_stops]))
        return cls(
            source=source, variables=dict(variables), special_tokens=special, end_of_turn=end_of_turn, reply_stops=stops
        )

    @property
    def ids(self) -> list[int]:
        """The control tokens' ids."""
        return list(self.special_tokens.values())

    def render_text(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The template's text for `messages`, control tokens typed in them wrapped in the markers; ChatError when
        the template refuses the conversation (its raise_exception, or any failure rendering it)."""
        marked = _mark([dict(message) for message in messages], self._pattern)
        try:
            return compile_template(self.source).render(
                messages=marked,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except _RENDER_ERRORS as exc:
            raise ChatError(
                f"the model's chat template refuses the conversation: {exc}", reason="refused by the chat template"
            ) from None

    def encode_text(self, text: str, tokenizer: ChatTextEncoder) -> list[int]:
        """Ids of rendered text: control tokens the template wrote are tokens, marked ones are text (transformers'
        encode_marked_chat)."""
        pieces = self._markers.split(text)  # text, marked token (None: a lone marker), text, ...
        ids = tokenizer.encode_with_added(pieces[0])
        newline = tokenizer.encode_with_added("\n") if len(pieces) > 1 else []
        for index, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = index % 2 == 1
            encode = tokenizer.encode_without_added if as_text else tokenizer.encode_with_added
            # After a newline, so a SentencePiece tokenizer adds no prefix space mid-text; then the newline goes.
            piece_ids = encode("\n" + piece)
            piece_ids = piece_ids[len(newline) :] if piece_ids[: len(newline)] == newline else encode(piece)
            ids += piece_ids
        return ids

    def ids_of(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, tokenizer: ChatTextEncoder):
        """The ids of `messages` rendered (with or without the assistant's opening after them)."""
        return self.encode_text(self.render_text(messages, add_generation_prompt), tokenizer)

    def turn_span(
        self, messages: Sequence[dict[str, Any]], index: int, ids: list[int], tokenizer: ChatTextEncoder
    ) -> tuple[int, int, list[int]]:
        """(start, end, ids): where assistant message `index` lies in `ids`, the whole conversation's ids. ChatError
        when the renderings of the conversation up to it are not prefixes of `ids` (but see _end_as_last_turn)."""
        before = self.ids_of(messages[:index], True, tokenizer)
        through = self.ids_of(messages[: index + 1], False, tokenizer)
        if ids[: len(before)] == before and ids[: len(through)] == through and len(through) > len(before):
            return len(before), len(through), ids
        end = self._end_as_last_turn(before, through, ids) if ids[: len(before)] == before else None
        if end is None:
            raise ChatError(
                f"the chat template renders the conversation up to message {index} differently from its start in the "
                f"whole conversation, so the assistant's turn cannot be told apart; {PREFIX_FIX}",
                reason="template renders prefixes differently",
            )
        return len(before), end, ids

    def _end_as_last_turn(self, before: list[int], through: list[int], ids: list[int]) -> int | None:
        """Where an assistant turn that opens at len(before) ends in `ids`, for a template that renders the last turn
        with more at its opening than the same turn followed by others (Qwen3 gives the last reply a thinking block,
        earlier ones none): just past its first reply stop, when the turn up to there is how the last turn, rendered
        alone (`through`), ends. None when it is not."""
        stops = set(self.reply_stops)
        ours = next((p for p in range(len(before), len(ids)) if ids[p] in stops), None)
        last = next((p for p in range(len(before), len(through)) if through[p] in stops), None)
        if ours is None or last is None or ours > last or through[: len(before)] != before:
            return None
        turn = ids[len(before) : ours + 1]
        return ours + 1 if through[last + 1 - len(turn) : last + 1] == turn else None

    def render(self, messages: Sequence[Any], tokenizer: ChatTextEncoder) -> tuple[np.ndarray, np.ndarray]:
        """A whole conversation for training: (ids int64, mask uint8), the mask 1 on each assistant turn up to and
        including its first reply-stop token. ChatError when the conversation is invalid (check_messages), has no
        assistant turn, or the template refuses it or renders its prefixes differently."""
        check_messages(messages)
        if not any(message["role"] == "assistant" for message in messages):
            raise ChatError(
                "the conversation has no assistant turn: there is nothing to learn from it", reason="no assistant turn"
            )
        ids = self.ids_of(messages, False, tokenizer)
        mask = np.zeros(len(ids), dtype=np.uint8)
        stops = set(self.reply_stops)
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start, end, _ = self.turn_span(messages, index, ids, tokenizer)
            last = next((position for position in range(start, end) if ids[position] in stops), end - 1)
            mask[start : last + 1] = 1
        return np.asarray(ids, dtype=np.int64), mask

    def render_prompt(
        self, messages: Sequence[Any], tokenizer: ChatTextEncoder, add_generation_prompt: bool = True
    ) -> list[int]:
        """The conversation so far followed by the assistant's opening: the prompt whose continuation, up to a
        reply stop, is the next reply. ChatError when the messages are invalid or the template refuses them."""
        check_messages(messages)
        return self.ids_of(messages, add_generation_prompt, tokenizer)

    def to_jinja(self, begin: str = "") -> str:
        """The template's Jinja, as the model ships it (it writes its own opening, so `begin` is unused)."""
        return self.source

    def to_meta(self) -> dict[str, Any]:
        """The "chat" object of a tokenizer's description: everything rendering needs, the Jinja included."""
        return {
            "template": self.name,
            "source": self.source,
            "variables": dict(self.variables),
            "special_tokens": dict(self.special_tokens),
            "end_of_turn": self.end_of_turn,
            "reply_stops": list(self.reply_stops),
        }

    @classmethod
    def from_meta(cls, record: Any, where: str) -> JinjaChatTemplate:
        """The template a "chat" object describes; ChatError naming `where` when it is malformed."""
        check_record(record, where)
        return cls(
            source=record["source"],
            variables=dict(record["variables"]),
            special_tokens=dict(record["special_tokens"]),
            end_of_turn=record["end_of_turn"],
            reply_stops=tuple(record["reply_stops"]),
        )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_record(record: Any, where: str) -> None:
    """ChatError naming `where` unless `record` is a well-formed Jinja "chat" object."""
    ok = isinstance(record, dict) and record.get("template") == TEMPLATE_NAME and isinstance(record.get("source"), str)
    ok = (
        ok
        and isinstance(record.get("variables"), dict)
        and all(isinstance(v, str) for v in record["variables"].values())
    )
    ok = ok and isinstance(record.get("special_tokens"), dict) and all(map(_is_id, record["special_tokens"].values()))
    ok = ok and _is_id(record.get("end_of_turn"))
    ok = ok and isinstance(record.get("reply_stops"), list) and all(map(_is_id, record["reply_stops"]))
    if not ok:
        raise ChatError(
            f"{where}: the Jinja 'chat' object needs 'source', 'variables', 'special_tokens', 'end_of_turn' and "
            "'reply_stops'"
        )
