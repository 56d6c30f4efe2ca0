"""One interface over a character table, tiktoken encodings (named ones, and BPEs trained here) and Hugging Face
models' own tokenizers (gptkit.data.hf_tokenizer).

A data directory's meta.json (gptkit.data.meta) says which tokenizer produced its token files;
`tokenizer_from_meta` rebuilds that tokenizer so training and sampling encode and decode exactly as preparation did.

GPT-2 BPE works offline when its two files (vocab.bpe, encoder.json) are in TIKTOKEN_CACHE_DIR (tiktoken's own
cache, files named by the sha1 of their URL) or in a directory passed as `bpe_dir`; in the latter case the
encoding is built here from those files after checking their sha256 against the published hashes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.core.errors import UserError
from gptkit.core.fileio import sha256_file
from gptkit.data import bpe, hf_tokenizer
from gptkit.data.bpe import UNKNOWN_ID_BYTES, gpt2_unicode_to_byte
from gptkit.data.chat import SPECIAL_TOKENS, ChatError, ChatTemplate
from gptkit.data.gguf_tokenizer import find_gguf, load_gguf_tokenizer
from gptkit.data.hf_tokenizer import HFTokenizer, is_hf_tokenizer_dir, load_hf_tokenizer

END_OF_TEXT = "<|endoftext|>"

# sha256 of the GPT-2 BPE files, as tiktoken itself expects them (tiktoken_ext/openai_public.py).
GPT2_BPE_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
GPT2_VOCAB_SIZE = 50257
# GPT-2's pre-tokenisation regex (the form tiktoken uses; equivalent to the original release's pattern).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

_MAX_CODEPOINT = 0x10FFFF


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """vocab_size rounded up to a multiple of `multiple` (train.py's pad_vocab): faster embedding and head matmuls
    on GPUs, at the cost of rows no token uses."""
    return -(-vocab_size // multiple) * multiple


class CharTokenizer:
    """Character-level tokenizer: id = position of the character in `chars`.

    Takes `chars`, distinct single characters in id order, and `eot`: whether an end-of-text token
    (id len(chars)) exists. Encoding a character outside the table raises UserError listing them.
    """

    kind = "char"
    chat: ChatTemplate | None = None  # plain text only: ChatTokenizer adds a template

    def __init__(self, chars: Sequence[str], eot: bool = False) -> None:
        chars = list(chars)
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise UserError(f"character table holds entries that are not single characters: {bad[:5]!r}")
        if len(set(chars)) != len(chars):
            raise UserError("character table holds duplicate characters; rebuild the vocabulary")
        self.chars: list[str] = chars
        self.eot = bool(eot)
        self.eot_token: int | None = len(chars) if self.eot else None
        self.vocab_size: int = len(chars) + (1 if self.eot else 0)
        # A code point -> id table makes encoding a vectorised numpy lookup instead of a Python loop.
        self._ids_by_codepoint = np.full(_MAX_CODEPOINT + 1, -1, dtype=np.int32)
        self._ids_by_codepoint[[ord(c) for c in chars]] = np.arange(len(chars), dtype=np.int32)
        self._pieces: list[bytes] = [c.encode("utf-8", "surrogatepass") for c in chars]
        if self.eot:
            self._pieces.append(END_OF_TEXT.encode())

    @classmethod
    def from_text(cls, text: str, eot: bool = False) -> CharTokenizer:
        """A tokenizer whose table is the sorted distinct characters of `text`."""
        return cls(sorted(set(text)), eot=eot)

    def encode_array(self, text: str) -> np.ndarray:
        """Encode `text` to an int64 numpy array of ids; UserError if a character is not in the table."""
        codepoints = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = self._ids_by_codepoint[codepoints]
        if ids.size and ids.min() < 0:
            unknown = sorted({chr(int(cp)) for cp in codepoints[ids < 0]})
            shown = ", ".join(repr(c) for c in unknown[:20])
            more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
            raise UserError(
                f"text holds {len(unknown)} character(s) not in the character vocabulary: {shown}{more}; "
                "use text made of the training characters or prepare the data again including them"
            )
        return ids.astype(np.int64)

    def encode(self, text: str) -> list[int]:
        """Encode ordinary text (no special tokens) to a list of ids."""
        return self.encode_array(text).tolist()

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """UTF-8 bytes of the ids; the end-of-text id gives '<|endoftext|>', unknown ids give U+FFFD."""
        pieces = self._pieces
        return b"".join(pieces[i] if 0 <= i < len(pieces) else UNKNOWN_ID_BYTES for i in map(int, ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids (see decode_bytes)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_meta(self) -> dict[str, Any]:
        """The "tokenizer" object of meta.json."""
        return {"kind": "char", "chars": list(self.chars), "eot": self.eot}


def load_gpt2_bpe_dir(bpe_dir: str | os.PathLike) -> dict[bytes, int]:
    """Read GPT-2's vocab.bpe and encoder.json from `bpe_dir`, check their sha256, return token bytes -> rank.

    Raises UserError when a file is missing, altered (sha256 mismatch) or inconsistent.
    """
    directory = Path(bpe_dir)
    for name, expected in GPT2_BPE_SHA256.items():
        path = directory / name
        if not path.is_file():
            raise UserError(f"--bpe_dir {directory}: {name} is missing; the directory needs vocab.bpe and encoder.json")
        actual = sha256_file(path)
        if actual != expected:
            raise UserError(
                f"{path} has sha256 {actual[:16]}..., expected {expected[:16]}...: the file is corrupted or not "
                "GPT-2's; copy it again"
            )
    to_byte = gpt2_unicode_to_byte()
    encoder = json.loads((directory / "encoder.json").read_text(encoding="utf-8"))
    ranks = {bytes(to_byte[ch] for ch in token): rank for token, rank in encoder.items() if token != END_OF_TEXT}
    # The merges file must agree with the ranks: merge n builds token 256 + n (tiktoken relies on this order).
    merges = (directory / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:-1]
    if len(merges) + 256 != len(ranks):
        raise UserError(f"{directory}: vocab.bpe and encoder.json disagree on the vocabulary size")
    return ranks


class TiktokenTokenizer:
    """A tiktoken encoding (e.g. "gpt2"), encoding ordinary text only.

    Takes the encoding name and optionally `bpe_dir` (vocab.bpe + encoder.json, GPT-2 only) to build the
    encoding from local, sha256-checked files instead of tiktoken's download/cache.
    """

    kind = "tiktoken"
    chat: ChatTemplate | None = None

    def __init__(self, encoding: str = "gpt2", bpe_dir: str | os.PathLike | None = None) -> None:
        import tiktoken  # imported here so char-level work never needs it

        self.name = encoding
        self.bpe_dir = None if bpe_dir is None else str(bpe_dir)
        if bpe_dir is not None:
            if encoding != "gpt2":
                raise UserError(
                    f"--bpe_dir only supports the gpt2 encoding (vocab.bpe + encoder.json), not {encoding!r}"
                )
            self._encoding = tiktoken.Encoding(
                name="gpt2",
                pat_str=GPT2_PATTERN,
                mergeable_ranks=load_gpt2_bpe_dir(bpe_dir),
                special_tokens={END_OF_TEXT: GPT2_VOCAB_SIZE - 1},
                explicit_n_vocab=GPT2_VOCAB_SIZE,
            )
        else:
            self._encoding = _get_tiktoken_encoding(encoding)
        self.vocab_size: int = self._encoding.n_vocab
        self.eot_token: int | None = self._encoding._special_tokens.get(END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        """Encode ordinary text; special-token strings such as '<|endoftext|>' are treated as plain text."""
        return self._encoding.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        """Encode ordinary text (as encode) straight to a numpy array of ids (uint32).

        Faster than encode() for large texts: no Python list of ints is built.
        """
        if hasattr(self._encoding, "encode_to_numpy"):
            # No special tokens allowed or refused: their strings are encoded as plain text, as encode_ordinary does.
            return self._encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        return np.asarray(self.encode(text), dtype=np.uint32)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Bytes of the ids; an id no token has (padded vocabulary) gives U+FFFD."""
        ids = [int(i) for i in ids]
        try:
            return self._encoding.decode_bytes(ids)
        except KeyError:
            limit = self._encoding.max_token_value
            return b"".join(
                self._encoding.decode_single_token_bytes(i) if 0 <= i <= limit else UNKNOWN_ID_BYTES for i in ids
            )

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; bytes that do not form valid UTF-8 (a token cut mid-character) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_meta(self) -> dict[str, Any]:
        """The "tokenizer" object of meta.json."""
        return {"kind": "tiktoken", "encoding": self.name}


class BpeTokenizer(TiktokenTokenizer):
    """A byte-level BPE trained by prepare_data/train_tokenizer.py, encoded and decoded by tiktoken.

    Built from its record (gptkit.data.bpe: the ranks text, its sha256, the pattern and special tokens), which
    meta.json and checkpoints embed; `from_dir` reads a tokenizer directory. Any damage is a UserError naming
    `where`.
    """

    kind = "bpe"

    def __init__(self, record: dict[str, Any], where: str = "tokenizer") -> None:
        import tiktoken

        ranks = bpe.ranks_of_record(record, where)
        self.name = record["name"]
        self.bpe_dir = None
        try:
            self._encoding = tiktoken.Encoding(
                name=self.name,
                pat_str=record["pattern"],
                mergeable_ranks=ranks,
                special_tokens=dict(record["special_tokens"]),
            )
        except ValueError as exc:  # the pattern is no valid regex
            raise UserError(f"{where}: tiktoken refuses the tokenizer ({exc}); {bpe.RETRAIN}") from None
        self.vocab_size = self._encoding.n_vocab
        self.eot_token = self._encoding._special_tokens.get(END_OF_TEXT)
        # The record without what a checkpoint adds to it (vocab_size, eot_token): what meta.json stores.
        self._record = {key: record[key] for key in bpe.RECORD_KEYS}

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> BpeTokenizer:
        """The tokenizer in a directory written by prepare_data/train_tokenizer.py."""
        return cls(bpe.read_tokenizer_dir(directory), where=str(directory))

    def to_meta(self) -> dict[str, Any]:
        """The "tokenizer" object of meta.json: the whole tokenizer, ranks included, so a checkpoint suffices."""
        return dict(self._record)


def _get_tiktoken_encoding(name: str) -> Any:
    import tiktoken

    known = tiktoken.list_encoding_names()
    if name not in known:
        raise UserError(
            f"unknown tokenizer {name!r}: use 'char', a tiktoken encoding ({', '.join(known)}) or a directory "
            "written by prepare_data/train_tokenizer.py"
        )
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # tiktoken raises requests/ValueError/OSError variants when it cannot fetch
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "(TIKTOKEN_CACHE_DIR not set)")
        raise UserError(
            f"cannot load tiktoken encoding {name!r} ({type(exc).__name__}): its BPE files are not in the cache "
            f"{cache} and could not be downloaded; set TIKTOKEN_CACHE_DIR to a directory holding them (the "
            "preparation scripts also take --bpe_dir, gpt2 only)"
        ) from exc


class ChatTokenizer:
    """A tokenizer with the chat template's special tokens, whose ids follow the base vocabulary.

    Encoding is the base tokenizer's (ordinary text only: typing a marker's text never gives the marker);
    decoding shows a marker as its text. `chat` is the template that renders conversations (gptkit.data.chat).
    """

    def __init__(self, base: CharTokenizer | TiktokenTokenizer, chat: ChatTemplate) -> None:
        if min(chat.ids) < base.vocab_size:
            raise UserError("the chat template's special tokens overlap the base vocabulary; prepare the data again")
        self.base, self.chat = base, chat
        self.kind = base.kind
        self.vocab_size: int = max(chat.ids) + 1
        self.eot_token: int | None = base.eot_token
        self._marker_bytes = {token_id: text.encode() for text, token_id in chat.special_tokens.items()}

    @classmethod
    def extending(cls, base: CharTokenizer | TiktokenTokenizer) -> ChatTokenizer:
        """`base` with the template's markers added right after its vocabulary; a conversation opens with the
        base's end-of-text token when it has one."""
        return cls(base, ChatTemplate.for_vocabulary(base.vocab_size, begin=base.eot_token))

    def encode(self, text: str) -> list[int]:
        """Encode ordinary text; a marker's text is encoded as the characters it is made of."""
        return self.base.encode(text)

    def encode_array(self, text: str) -> np.ndarray:
        """As encode, to a numpy array."""
        return self.base.encode_array(text)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Bytes of the ids, a marker as its text (e.g. b"<|end|>")."""
        pieces, run = [], []
        for token_id in map(int, ids):
            marker = self._marker_bytes.get(token_id)
            if marker is None:
                run.append(token_id)
                continue
            pieces.extend([self.base.decode_bytes(run), marker])
            run = []
        pieces.append(self.base.decode_bytes(run))
        return b"".join(pieces)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids (see decode_bytes)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_meta(self) -> dict[str, Any]:
        """The base tokenizer's "tokenizer" object with the template as its "chat" entry."""
        return {**self.base.to_meta(), "chat": self.chat.to_meta()}


Tokenizer = CharTokenizer | TiktokenTokenizer | ChatTokenizer | HFTokenizer


def no_chat_reason(tokenizer: Tokenizer, otherwise: str) -> str:
    """Why `tokenizer` renders no conversations: the problem of the chat template its model came with (not valid
    Jinja, failing on a conversation, or ending a turn with no special token), else `otherwise` (it has none)."""
    problem = tokenizer.chat_problem if isinstance(tokenizer, HFTokenizer) else None
    return f"{problem}, so it renders no conversations" if problem else otherwise


def prompt_opening(tokenizer: Tokenizer) -> list[int]:
    """The ids a plain prompt (no chat template) opens with, before its text's: a Hugging Face or GGUF Llama's bos
    (its model was trained so, and transformers and llama.cpp prompt it so); none for our own tokenizers."""
    return list(tokenizer.prompt_opening) if isinstance(tokenizer, HFTokenizer) else []


def special_tokens_of(tokenizer: Tokenizer) -> dict[str, int]:
    """The special tokens' texts and ids: the end of text, and a chat template's markers (a Hugging Face
    tokenizer's: its added tokens)."""
    if isinstance(tokenizer, HFTokenizer):
        return {text: token_id for text, (token_id, _) in tokenizer.added_tokens.items()}
    special = {} if tokenizer.eot_token is None else {END_OF_TEXT: tokenizer.eot_token}
    if tokenizer.chat is not None:
        special.update(tokenizer.chat.special_tokens)
    return special


def completion_stops(tokenizer: Tokenizer) -> list[int]:
    """The tokens that end a plain completion (no chat template applied): the end of text, and on a chat model the
    tokens that end its replies and every special token of its template: a marker is never text in an answer, as a
    chat reply never shows one either. An added token that a Hugging Face tokenizer marks not special, though its
    template writes it (Qwen3's <think>, <tool_call>), is text: shown in the answer and never a stop, as vLLM and
    transformers treat it."""
    eot, template = tokenizer.eot_token, tokenizer.chat
    stops = [] if eot is None else [eot]
    if template is not None:
        stops += [template.end_of_turn, *reply_stops(tokenizer)]
    return list(dict.fromkeys(stops))


def reply_stops(tokenizer: Tokenizer) -> list[int]:
    """The tokens that end a chat reply (the tokenizer has a chat template): the template's reply stops, and every
    special token of its template (as completion_stops: a model that writes a marker has left its turn, and a reply
    never shows one)."""
    return list(dict.fromkeys([*tokenizer.chat.reply_stops, *_special_template_ids(tokenizer)]))


def _special_template_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids of the chat template's control tokens that are special tokens: all of a template made here, those a
    Hugging Face tokenizer.json marks "special" of a model's own template."""
    template = tokenizer.chat
    if template is None:
        return []
    if not isinstance(tokenizer, HFTokenizer):
        return template.ids
    added = tokenizer.added_tokens
    return [token_id for text, token_id in template.special_tokens.items() if added.get(text, (token_id, True))[1]]


def encode_with_special_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """Encode text in which a special token's text stands for that token (as Hugging Face tokenizers read text);
    the rest is ordinary text. Only for tools that expect this (a server's /tokenize): prompts never read markers."""
    special = special_tokens_of(tokenizer)
    if not special:
        return tokenizer.encode(text)
    pattern = "(" + "|".join(re.escape(marker) for marker in sorted(special, key=len, reverse=True)) + ")"
    ids: list[int] = []
    for number, piece in enumerate(re.split(pattern, text)):
        if number % 2:  # re.split puts the matched separators at odd places
            ids.append(special[piece])
        elif piece:
            ids += tokenizer.encode(piece)
    return ids


def is_tokenizer_dir(name: str) -> bool:
    """Whether a --tokenizer value names a tokenizer directory: a path (holds a separator, or is an existing
    directory) that is not a tiktoken encoding name."""
    import tiktoken

    if name in tiktoken.list_encoding_names():
        return False
    return os.sep in name or "/" in name or Path(name).is_dir()


def make_tokenizer(name: str, bpe_dir: str | os.PathLike | None = None) -> TiktokenTokenizer | HFTokenizer:
    """A tiktoken tokenizer by name ('gpt2', 'cl100k_base', ...), a trained one from its directory (a path), or a
    Hugging Face model's from its directory (tokenizer.json, with its chat template) or from its GGUF file.

    Char tokenizers need a table: use CharTokenizer.
    """
    gguf = find_gguf(name)
    if gguf is not None:
        if bpe_dir is not None:
            raise UserError("--bpe_dir is for GPT-2 BPE; it makes no sense with a GGUF file's tokenizer")
        return load_gguf_tokenizer(gguf)
    if name.endswith(".gguf") and not Path(name).exists():  # not a trained tokenizer's directory to train again
        raise UserError(f"{name}: no such file or directory")
    if is_tokenizer_dir(name):
        if bpe_dir is not None:
            raise UserError("--bpe_dir is for GPT-2 BPE; it makes no sense with a tokenizer directory")
        return load_hf_tokenizer(name) if is_hf_tokenizer_dir(name) else BpeTokenizer.from_dir(name)
    return TiktokenTokenizer(name, bpe_dir=bpe_dir)


def tokenizer_from_meta(tokenizer_meta: dict, bpe_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Rebuild the tokenizer described by meta.json's "tokenizer" object (optionally GPT-2 from `bpe_dir`); with a
    "chat" entry, a ChatTokenizer."""
    check_tokenizer_meta(tokenizer_meta, "tokenizer")
    if tokenizer_meta["kind"] == hf_tokenizer.KIND:  # its chat template, if any, comes with it
        return HFTokenizer(tokenizer_meta)
    if tokenizer_meta["kind"] == "char":
        base = CharTokenizer(tokenizer_meta["chars"], eot=bool(tokenizer_meta.get("eot", False)))
    elif tokenizer_meta["kind"] == bpe.KIND:
        base = BpeTokenizer(tokenizer_meta)
    else:
        base = TiktokenTokenizer(tokenizer_meta["encoding"], bpe_dir=bpe_dir)
    if "chat" not in tokenizer_meta:
        return base
    return ChatTokenizer(base, chat_template_of(tokenizer_meta, "tokenizer"))


def chat_template_of(tokenizer_meta: dict, where: str) -> ChatTemplate:
    """The template of a tokenizer object's "chat" entry; UserError naming `where` when it is malformed."""
    try:
        return ChatTemplate.from_meta(tokenizer_meta["chat"], where)
    except ChatError as exc:
        raise UserError(f"{exc}; prepare the chat data again") from None


def chat_special_count(tokenizer_meta: dict) -> int:
    """How many ids a tokenizer object's chat template adds to the base vocabulary (0 without one)."""
    return len(SPECIAL_TOKENS) if "chat" in tokenizer_meta else 0


def check_tokenizer_meta(tok: Any, where: str) -> None:
    """UserError naming `where` unless `tok` is a well-formed "tokenizer" object (meta.json's, a checkpoint's)."""
    if not isinstance(tok, dict) or tok.get("kind") not in ("char", "tiktoken", bpe.KIND, hf_tokenizer.KIND):
        raise UserError(f"{where}: 'tokenizer' must be an object with kind 'char', 'tiktoken', 'bpe' or 'hf'")
    if tok["kind"] == hf_tokenizer.KIND:
        hf_tokenizer.check_record(tok, where)
    elif tok["kind"] == bpe.KIND:
        bpe.check_record(tok, where)
    elif tok["kind"] == "char":
        chars = tok.get("chars")
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise UserError(f"{where}: a char tokenizer needs 'chars', a list of single characters")
        if not isinstance(tok.get("eot", False), bool):
            raise UserError(f"{where}: the char tokenizer's 'eot' must be true or false")
    elif not isinstance(tok.get("encoding"), str):
        raise UserError(f"{where}: a tiktoken tokenizer needs 'encoding', e.g. \"gpt2\"")
