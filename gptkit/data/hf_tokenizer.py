"""A Hugging Face model's own tokenizer: its tokenizer.json through the `tokenizers` package, with its chat template
(gptkit.data.jinja_chat), behind the interface of gptkit.data.tokenizer's tokenizers.

    tokenizer = load_hf_tokenizer("path/to/SmolLM2-135M-Instruct")   # tokenizer.json (+ tokenizer_config.json)

Ids are transformers' AutoTokenizer's with add_special_tokens=False: `encode` reads its text as ordinary text (a
special token's text gives the characters' tokens, never the token), and a conversation's ids are
`apply_chat_template(..., tokenize=True, sanitize_control_tokens=True)`'s. The record (meta.json's "tokenizer"
object, and so every checkpoint trained on the data) embeds tokenizer.json's text, its sha256, the named special
tokens and the chat template, so a run never depends on the directory it came from.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers

from gptkit.core.errors import UserError
from gptkit.data import bpe
from gptkit.data.bpe import UNKNOWN_ID_BYTES, gpt2_unicode_to_byte
from gptkit.data.chat import ChatError

if TYPE_CHECKING:
    from gptkit.data.jinja_chat import JinjaChatTemplate

KIND = "hf"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# The named special tokens transformers gives a chat template as variables (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RECORD_KEYS = ("kind", "name", "tokenizer_json", "tokenizer_json_sha256", "special_tokens_map")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


def is_hf_tokenizer_dir(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a Hugging Face tokenizer.json (and not the metadata of a BPE trained here, which
    shares the file name)."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file() or (Path(directory) / bpe.RANKS_FILENAME).exists():
        return False
    with path.open("rb") as file:
        return f'"format": "{bpe.FORMAT}"'.encode() not in file.read(200)  # a trained BPE's metadata opens so


# sha256 of GPT-2's vocabulary: its tokens' texts in id order, one a line, as tokenizer.json spells them (computed from
# tiktoken's GPT-2 files). A GPT-2 directory whose tokenizer.json holds it is tokenized with tiktoken's GPT-2 BPE.
GPT2_VOCABULARY_SHA256 = "e35a33a0b2250c932ffdafc4c3a3552aef0cc7af7a11e9ebfddf1d2a6517371f"


def is_gpt2_bpe(record: dict[str, Any]) -> bool:
    """Whether a tokenizer record (read_hf_record's) is GPT-2's BPE and nothing more: exactly GPT-2's vocabulary (a
    GPT-2 checkpoint's own, as the hub's gpt2 ... gpt2-xl and distilgpt2 ship it), no token added but its
    <|endoftext|>, no chat template. Another vocabulary in GPT-2's architecture, or GPT-2's with chat markers or a
    template (a chat fine-tune's export), is not."""
    if record.get("template_source") is not None:
        return False
    parsed = json.loads(record["tokenizer_json"])
    added = {token.get("content") for token in parsed.get("added_tokens") or [] if isinstance(token, dict)}
    model = parsed.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) and model.get("type") == "BPE" else None
    if not isinstance(vocab, dict) or len(vocab) != 50257 or not added <= {"<|endoftext|>"}:
        return False
    if not all(type(token_id) is int for token_id in vocab.values()):
        return False
    tokens = sorted(vocab, key=vocab.__getitem__)
    return bpe.sha256_text("\n".join(tokens)) == GPT2_VOCABULARY_SHA256


def load_hf_tokenizer(directory: str | os.PathLike) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory: tokenizer.json, the named special tokens of
    tokenizer_config.json and the chat template (chat_template.jinja, else tokenizer_config.json's
    `chat_template`; none: `chat` is None), reply stops extended by generation_config.json's eos_token_id.

    Its `vocab_size` is the tokenizer's (highest id + 1), which may be below the model's embedding rows. UserError
    (one line) for a missing or unreadable tokenizer.json, a tokenizer_config.json naming tokens tokenizer.json does
    not hold, or a chat template that is not valid Jinja or fails on a two-turn conversation.
    """
    return HFTokenizer(read_hf_record(directory), where=str(directory))


def read_hf_record(directory: str | os.PathLike) -> dict[str, Any]:
    """The record of the tokenizer in a Hugging Face directory (see load_hf_tokenizer), its chat template in the
    "template_source" and "extra_stops" keys that HFTokenizer turns into the "chat" object."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory holding a Hugging Face tokenizer (tokenizer.json)")
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        hint = (
            ": it has only a SentencePiece tokenizer.model; write tokenizer.json with transformers "
            "(AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
            if (directory / "tokenizer.model").is_file()
            else ""
        )
        raise UserError(f"{directory} has no {TOKENIZER_FILE}, the model's tokenizer{hint}")
    config = _read_json(directory / CONFIG_FILE) if (directory / CONFIG_FILE).is_file() else {}
    source = _template_source(directory, config)
    stops = _generation_stops(directory / GENERATION_CONFIG_FILE) if source is not None else []
    return make_record(directory.resolve().name, _read_text(path), _special_tokens_map(config), source, stops)


def make_record(
    name: str, text: str, special_tokens_map: dict[str, str], template_source: str | None, extra_stops: list[int]
) -> dict[str, Any]:
    """The record of a tokenizer.json's `text` (from a directory, or built from a GGUF file's metadata): the named
    special tokens' texts, and the chat template with the ids that also end a reply (none without a template)."""
    record = {
        "kind": KIND,
        "name": name,
        "tokenizer_json": text,
        "tokenizer_json_sha256": bpe.sha256_text(text),
        "special_tokens_map": special_tokens_map,
    }
    if template_source is not None:
        record["template_source"] = template_source
        record["extra_stops"] = extra_stops
    return record


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path} ({exc})") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as its text or as an AddedToken object {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens_map(config: dict[str, Any]) -> dict[str, str]:
    named = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return {name: text for name, text in named.items() if text is not None}


def _template_source(directory: Path, config: dict[str, Any]) -> str | None:
    if (directory / TEMPLATE_FILE).is_file():
        return _read_text(directory / TEMPLATE_FILE)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise UserError(f"{directory / CONFIG_FILE}: 'chat_template' is neither Jinja text nor named templates")
    return template


def _generation_stops(path: Path) -> list[int]:
    if not path.is_file():
        return []
    eos = _read_json(path).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def check_record(record: Any, where: str) -> None:
    """The record's structure (cheap: tokenizer.json is neither hashed nor parsed here); UserError naming `where`."""
    fix = "the tokenizer record is damaged; prepare the data again with --tokenizer=DIR"
    if not isinstance(record, dict) or record.get("kind") != KIND:
        raise UserError(f"{where}: not a Hugging Face tokenizer record")
    for key in ("name", "tokenizer_json", "tokenizer_json_sha256"):
        if not isinstance(record.get(key), str) or not record[key]:
            raise UserError(f"{where}: {key!r} must be a non-empty string; {fix}")
    specials = record.get("special_tokens_map")
    if not isinstance(specials, dict) or not all(isinstance(v, str) for v in specials.values()):
        raise UserError(f"{where}: 'special_tokens_map' must map names (bos_token, ...) to token texts; {fix}")
    if "chat" in record:
        from gptkit.data.jinja_chat import JinjaChatTemplate  # here: jinja2 is slow to import; chat templates need it

        try:
            JinjaChatTemplate.from_meta(record["chat"], where)
        except ChatError as exc:
            raise UserError(f"{exc}; {fix}") from None


def record_ids(record: dict[str, Any]) -> list[int]:
    """The ids a checked record's chat template names (none without one)."""
    chat = record.get("chat")
    return [] if chat is None else [*chat["special_tokens"].values(), *chat["reply_stops"], chat["end_of_turn"]]


class HFTokenizer:
    """A tokenizer.json with the interface of gptkit.data.tokenizer's tokenizers (encode, encode_array, decode,
    decode_bytes, vocab_size, eot_token, chat, to_meta), built from its record (read_hf_record or meta.json's
    "tokenizer" object). `eot_token` is the eos token, which separates documents and ends a completion."""

    kind = KIND

    def __init__(self, record: dict[str, Any], where: str = "tokenizer") -> None:
        check_record({key: value for key, value in record.items() if key != "chat"}, where)
        text = record["tokenizer_json"]
        if bpe.sha256_text(text) != record["tokenizer_json_sha256"]:
            raise UserError(f"{where}: tokenizer.json's text does not match its sha256: the record was altered")
        self.name = record["name"]
        self._with_added = _parse(text, where)
        self._plain = _parse(text, where)
        self._plain.encode_special_tokens = True  # a special token's text is ordinary text
        added = self._with_added.get_added_tokens_decoder()
        self.added_tokens = {token.content: (token_id, token.special) for token_id, token in added.items()}
        self.vocab_size: int = max(self._with_added.get_vocab(with_added_tokens=True).values()) + 1
        self.special_tokens_map = dict(record["special_tokens_map"])
        self._check_named_tokens(where)
        self.eot_token: int | None = self.named_token_id("eos_token")
        parsed = json.loads(text)
        self._pieces = self._token_bytes(parsed.get("decoder"))
        self._dropped_bytes = self._bytes_without_token(parsed)
        # an added token's text is no text of the vocabulary's: checked apart (encode_with_added)
        longest_first = sorted(self.added_tokens, key=len, reverse=True)
        self._added_texts = re.compile("|".join(map(re.escape, longest_first))) if self._dropped_bytes else None
        self._record = {key: record[key] for key in RECORD_KEYS}
        self.chat_problem: str | None = None  # why the chat template the tokenizer came with cannot be used
        self.chat = self._template(record, where)
        self.prompt_opening = self._opening()

    def _opening(self) -> list[int]:
        """The ids the tokenizer's post-processor puts before a text (Llama's bos), as transformers' tokenizer and
        llama.cpp (add_bos) open a prompt with them; [] for one that puts none (GPT-2, Qwen, SmolLM2)."""
        text = self._plain.encode("a", add_special_tokens=False).ids
        whole = self._plain.encode("a", add_special_tokens=True).ids
        starts = [i for i in range(len(whole) - len(text) + 1) if whole[i : i + len(text)] == text]
        return whole[: starts[0]] if starts else []

    def named_token_id(self, name: str) -> int | None:
        """The id of the token tokenizer_config.json names `name` (bos_token, pad_token, ...), None when it names none."""
        text = self.special_tokens_map.get(name)
        return None if text is None else self._with_added.token_to_id(text)

    def _check_named_tokens(self, where: str) -> None:
        for name, text in self.special_tokens_map.items():
            if self._with_added.token_to_id(text) is None:
                raise UserError(
                    f"{where}: {CONFIG_FILE} names {name} {text!r}, which {TOKENIZER_FILE} does not hold: the two "
                    "files come from different tokenizers"
                )

    def _template(self, record: dict[str, Any], where: str) -> JinjaChatTemplate | None:
        if "chat" not in record and record.get("template_source") is None:
            return None
        from gptkit.data.jinja_chat import JinjaChatTemplate  # here: jinja2 is slow to import; chat templates need it

        if "chat" in record:
            try:
                return JinjaChatTemplate.from_meta(record["chat"], where)
            except ChatError as exc:
                raise UserError(f"{where}: {exc}") from None
        stops = [self.eot_token] if self.eot_token is not None else []
        try:
            return JinjaChatTemplate.build(
                record["template_source"],
                self.special_tokens_map,
                self.added_tokens,
                self,
                extra_stops=[*stops, *record.get("extra_stops", [])],
            )
        except ChatError as exc:  # plain text still tokenizes: only what renders conversations says why not
            self.chat_problem = str(exc)  # no path: a server says it to its clients
            return None

    def _token_bytes(self, decoder: Any) -> list[bytes | None]:
        """Each id's bytes, so that decode_bytes of ids one at a time joins to their UTF-8 (a character split across
        byte tokens included)."""
        kinds = _component_kinds(decoder)
        to_byte = gpt2_unicode_to_byte()
        pieces: list[bytes | None] = [None] * self.vocab_size
        for token, token_id in self._with_added.get_vocab(with_added_tokens=False).items():
            byte = _BYTE_TOKEN.fullmatch(token) if "ByteFallback" in kinds else None
            if "ByteLevel" in kinds and all(char in to_byte for char in token):
                pieces[token_id] = bytes(to_byte[char] for char in token)
            elif byte is not None:
                pieces[token_id] = bytes([int(byte.group(1), 16)])
            elif kinds & {"Metaspace", "Replace"}:
                pieces[token_id] = token.replace(SENTENCEPIECE_SPACE, " ").encode()
            else:
                pieces[token_id] = self._with_added.decode([token_id], skip_special_tokens=False).encode()
        for text, (token_id, _) in self.added_tokens.items():
            pieces[token_id] = text.encode()
        return pieces

    def _bytes_without_token(self, parsed: dict[str, Any]) -> bytes:
        """The bytes a byte-level BPE model drops from any text it encodes: those with no token of their own, where it
        has no unknown token and no byte fallback to stand for them (a vocabulary of some characters only, as a
        character-level model's export holds). Empty for a complete byte-level vocabulary (GPT-2's, Llama 3's)."""
        model = parsed.get("model") or {}
        if model.get("type") != "BPE" or model.get("unk_token") is not None or model.get("byte_fallback"):
            return b""
        if "ByteLevel" not in _component_kinds(parsed.get("pre_tokenizer")):
            return b""
        vocab = self._plain.get_vocab(with_added_tokens=False)
        return bytes(sorted(byte for char, byte in gpt2_unicode_to_byte().items() if char not in vocab))

    def _check_encodable(self, text: str) -> None:
        """UserError naming the characters of `text` that encoding would drop without a trace (_bytes_without_token),
        as the character-level tokenizer refuses a character it never saw; UserError for an unpaired surrogate (JSON
        can spell one, \\ud800), which is no text and which the tokenizers library refuses with a TypeError."""
        if not self._dropped_bytes and text.isascii():  # nothing to check: no surrogate, every byte a token
            return
        try:
            data = text.encode("utf-8")  # once: the bytes the vocabulary is checked against too
        except UnicodeEncodeError:
            raise UserError("text holds an unpaired surrogate (e.g. \\ud800), which is not text") from None
        if not self._dropped_bytes or len(data.translate(None, self._dropped_bytes)) == len(data):
            return
        dropped = set(self._dropped_bytes)
        unknown = sorted(char for char in set(text) if not dropped.isdisjoint(char.encode("utf-8")))
        shown = ", ".join(repr(char) for char in unknown[:20])
        more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
        raise UserError(
            f"text holds {len(unknown)} character(s) that {self.name}'s vocabulary has no tokens for: {shown}{more}; "
            "use text made of the characters the model was trained on"
        )

    def encode(self, text: str) -> list[int]:
        """Encode ordinary text: no special tokens added, a special token's text encoded as its characters; UserError
        for a character the vocabulary cannot encode (_check_encodable)."""
        self._check_encodable(text)
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        """As encode, to a numpy array (uint32)."""
        return np.asarray(self.encode(text), dtype=np.uint32)

    def encode_continuation_array(self, text: str) -> np.ndarray:
        """As encode_array, for text that continues a document (a piece after a cut in a long one): without the
        space a SentencePiece-style tokenizer (Llama 2, TinyLlama) or one with add_prefix_space puts before a
        text's start, which whole-document encoding puts at the document's start only."""
        self._check_encodable(text)
        return np.asarray(self._continuing.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    @functools.cached_property
    def _continuing(self) -> tokenizers.Tokenizer:
        parsed = json.loads(self._record["tokenizer_json"])
        parsed["normalizer"], parsed["pre_tokenizer"] = map(
            _without_prefix, (parsed.get("normalizer"), parsed.get("pre_tokenizer"))
        )
        backend = _parse(json.dumps(parsed), self.name)
        backend.encode_special_tokens = True
        return backend

    def encode_with_added(self, text: str) -> list[int]:
        """Encode text in which an added token's text stands for that token (a rendered chat template)."""
        self._check_encodable(text if self._added_texts is None else self._added_texts.sub("", text))
        return self._with_added.encode(text, add_special_tokens=False).ids

    def encode_without_added(self, text: str) -> list[int]:
        """Encode text as the characters it is made of, reading no added token in it, special or not: a control token
        typed in a chat message (transformers' sanitize_control_tokens). `encode` still reads an added token that is
        not special (Qwen3's <think>), as transformers does, so this runs the normalizer, pre-tokenizer and model."""
        self._check_encodable(text)
        backend = self._with_added
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = (
            [text] if backend.pre_tokenizer is None else [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        )
        return [token.id for piece in pieces for token in backend.model.tokenize(piece)]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The ids' bytes, token by token (a SentencePiece word keeps its leading space); an id no token has gives
        U+FFFD."""
        pieces, size = self._pieces, self.vocab_size
        return b"".join((pieces[i] if 0 <= i < size else None) or UNKNOWN_ID_BYTES for i in map(int, ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids as transformers decodes them (special tokens shown); bytes that are no valid UTF-8 and ids
        no token has become U+FFFD."""
        ids = [int(i) for i in ids]
        if all(0 <= i < self.vocab_size and self._pieces[i] is not None for i in ids):
            return self._with_added.decode(ids, skip_special_tokens=False)
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_meta(self) -> dict[str, Any]:
        """The "tokenizer" object of meta.json: tokenizer.json's text, its sha256, the named special tokens and the
        chat template."""
        return {**self._record, **({} if self.chat is None else {"chat": self.chat.to_meta()})}

    def without_chat(self) -> HFTokenizer:
        """The same tokenizer without its chat template, for plain text data (a "chat" entry in meta.json marks chat
        data)."""
        plain = copy.copy(self)
        plain.chat = None
        return plain

    def __reduce__(self) -> tuple[Any, ...]:
        # Worker processes started without fork rebuild it from its record (the compiled template does not pickle).
        return (HFTokenizer, (self.to_meta(),))


def _parse(text: str, where: str) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # the Rust parser raises plain Exception with serde's message
        raise UserError(f"{where}: {TOKENIZER_FILE} is not a Hugging Face tokenizer ({exc})") from None


def _without_prefix(component: Any) -> Any:
    """A tokenizer.json normalizer or pre-tokenizer without the space it puts before a text's start: Prepend dropped,
    Metaspace's prepend_scheme "never", add_prefix_space off (ByteLevel's, an older Metaspace's)."""
    if not isinstance(component, dict) or component.get("type") == "Prepend":
        return None if isinstance(component, dict) else component
    if component.get("type") == "Sequence":
        key = "normalizers" if "normalizers" in component else "pretokenizers"
        parts = [_without_prefix(part) for part in component.get(key) or []]
        return {**component, key: [part for part in parts if part is not None]}
    changed = dict(component)
    if "prepend_scheme" in changed:
        changed["prepend_scheme"] = "never"
    if "add_prefix_space" in changed:
        changed["add_prefix_space"] = False
    return changed


def _component_kinds(component: Any) -> set[str]:
    # A decoder's or pre-tokenizer's type and, for a Sequence, its parts' types.
    if not isinstance(component, dict):
        return set()
    kinds = {component.get("type")}
    for part in (component.get("decoders") or []) + (component.get("pretokenizers") or []):
        kinds |= _component_kinds(part)
    return {kind for kind in kinds if isinstance(kind, str)}
