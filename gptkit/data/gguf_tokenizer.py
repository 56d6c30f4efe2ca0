"""A GGUF file (llama.cpp's one-file format) found and opened, and the tokenizer it holds as a Hugging Face
tokenizer.json, behind gptkit.data.hf_tokenizer's HFTokenizer. (The model in it: gptkit/weights/gguf_read.py.)

    tokenizer = load_gguf_tokenizer("SmolLM2-135M-Instruct-Q8_0.gguf")

Two of llama.cpp's tokenizers (`tokenizer.ggml.model`) are read. "gpt2", the byte-level BPE: its tokens in GPT-2's
byte alphabet, their types (control and unknown tokens become special added tokens, user-defined ones added tokens
that are not special), the merges, the bos/eos/unknown/padding ids and the chat template. llama.cpp reads no regex
from the file: `tokenizer.ggml.pre` names one of its own pre-tokenizers, and each name read here gets the
`tokenizers` pre-tokenizer that splits text as llama.cpp's regexes for it do (what gptkit/weights/gguf_hf_tokenizer.py
writes under the same names):

    gpt-2 and GPT2_NAMES           ByteLevel(use_regex)
    smollm                         Digits(individual) then ByteLevel(use_regex)
    llama-bpe and LLAMA3_NAMES     Split(Llama 3's regex) then ByteLevel; a piece that is a token is taken whole,
                                   and a text opens with bos unless the file says otherwise
    qwen2 and QWEN2_NAMES          Split(Qwen2's regex: one digit a piece) then ByteLevel

(llama.cpp gives each name of a group the same regexes; the names are its own, e.g. falcon3 for Falcon 3.)

"llama", SentencePiece (Llama 2, Mistral, TinyLlama): tokens with "▁" for spaces, scores, byte tokens <0xXX>, as
the BPE with byte fallback that transformers writes for those models. Other tokenizers and pre-tokenizers are
refused in one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gptkit.core.errors import UserError, describe_os_error
from gptkit.data.hf_tokenizer import HFTokenizer, make_record

SUFFIX = ".gguf"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # llama.cpp's token types (gguf.TokenType)
SPACE = "\u2581"  # SentencePiece's space
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _REST
QWEN2_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _REST


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _sequence(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": list(parts)}


# llama.cpp's pre-tokenizer names that split text with the same regexes (llama-vocab.cpp's groups).
GPT2_NAMES = ("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "exaone4")
GPT2_NAMES += ("jina-es", "jina-de", "jina-v2-es", "jina-v2-de")
LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
LLAMA3_NAMES += ("jina-v5-nano",)
QWEN2_NAMES = ("qwen2", "deepseek-r1-qwen", "megrez")
# llama.cpp's pre-tokenizer names -> (the tokenizers pre-tokenizer, whether a piece that is a token is taken whole).
PRE_TOKENIZERS: dict[str, tuple[dict[str, Any], bool]] = {
    **dict.fromkeys(GPT2_NAMES, (_byte_level(use_regex=True), False)),
    "smollm": (_sequence({"type": "Digits", "individual_digits": True}, _byte_level(use_regex=True)), False),
    **dict.fromkeys(LLAMA3_NAMES, (_sequence(_split(LLAMA3_SPLIT), _byte_level(False)), True)),
    **dict.fromkeys(QWEN2_NAMES, (_sequence(_split(QWEN2_SPLIT), _byte_level(False)), False)),
}

# ------------------------------------------------------------------------------------------------ the file


def find_gguf(name: str | os.PathLike) -> Path | None:
    """The GGUF file `name` stands for: itself (a file named *.gguf), or the one *.gguf file of a directory without
    config.json; None when it names no GGUF. UserError for a directory holding several."""
    path = Path(name)
    if path.is_file():
        return path if path.suffix.lower() == SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(entry for entry in path.iterdir() if entry.suffix.lower() == SUFFIX and entry.is_file())
    if len(found) > 1:
        names = ", ".join(entry.name for entry in found[:4])
        raise UserError(f"{path} holds {len(found)} GGUF files ({names}); name the one to read: {found[0]}")
    return found[0] if found else None


def open_gguf(path: str | os.PathLike) -> Any:
    """A gguf.GGUFReader over the file (its tensors mapped, not read; its metadata arrays read at once: see
    gptkit.data.gguf_reader); UserError of one line for a file that is truncated, damaged or no GGUF, and for one part
    of a split model."""
    from gptkit.data.gguf_reader import OnePassGGUFReader

    try:
        reader = OnePassGGUFReader(path)
    except (PermissionError, IsADirectoryError) as exc:  # the file is not the problem: its access is
        raise UserError(f"cannot read {path}: {describe_os_error(exc)}") from None
    except (ValueError, OSError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        detail = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise UserError(f"cannot read {path}: it is truncated, damaged or not a GGUF file ({detail})") from None
    parts = metadata(reader, "split.count", 1, kind=int)
    if parts > 1:
        raise UserError(
            f"{path} is part {metadata(reader, 'split.no', 0, kind=int) + 1} of a GGUF model split into {parts} files; we read "
            "one whole file: join them first (llama-gguf-split --merge FIRST_PART OUT.gguf)"
        )
    return reader


def metadata(
    reader: Any,
    key: str,
    default: Any = None,
    kind: type | None = None,
    items: type | None = None,
    per_layer: bool = False,
) -> Any:
    """A metadata value as Python data (strings decoded, arrays as lists), or `default` when the file lacks it.
    kind: the type it must have (int, float: any number, str, bool, list with `items` the type of its items), else
    UserError: a damaged file's value would fail far from here. per_layer: a list of `kind` is taken too (llama.cpp
    may write a hyper-parameter once a layer)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except UnicodeDecodeError:
        raise UserError(f"{reader.data.filename}: metadata {key} is not UTF-8 text; the file is damaged") from None
    if per_layer and isinstance(value, list):
        kind, items = list, kind
    if kind is not None and not is_kind(value, kind, items):
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:40]}..."
        wanted = f"a list of {KIND_NAMES[items]}s" if kind is list else f"a {KIND_NAMES[kind]}"
        raise UserError(f"{reader.data.filename}: metadata {key} is {shown}, not {wanted}; the file is damaged")
    return value


KIND_NAMES = {int: "whole number", float: "number", str: "string", bool: "boolean"}


def is_kind(value: Any, kind: type, items: type | None = None) -> bool:
    """Whether a metadata value is of `kind` (see metadata); a bool is no integer or number here."""
    if kind is list:
        return isinstance(value, list) and all(is_kind(item, items) for item in value)
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


# ------------------------------------------------------------------------------------------------ the tokenizer


def load_gguf_tokenizer(path: str | os.PathLike, reader: Any = None) -> HFTokenizer:
    """The tokenizer of a GGUF file (see the module's docstring) with its chat template; UserError (one line) for
    one that is not read here."""
    return HFTokenizer(gguf_tokenizer_record(path, reader), where=str(path))


def gguf_tokenizer_record(path: str | os.PathLike, reader: Any = None) -> dict[str, Any]:
    """The HFTokenizer record of the file's tokenizer: the tokenizer.json built from its metadata, the named special
    tokens and the chat template (llama.cpp's end-of-turn and end-of-message ids also end a reply)."""
    reader = open_gguf(path) if reader is None else reader
    model = metadata(reader, "tokenizer.ggml.model", kind=str)
    if model not in ("gpt2", "llama"):
        refused = "it holds no tokenizer" if model is None else f"its tokenizer.ggml.model is {model!r}"
        raise UserError(
            f"{path}: {refused}; we read llama.cpp's byte-level BPE (gpt2: GPT-2, Llama 3, Qwen, SmolLM) and "
            "SentencePiece (llama: Llama 2, Mistral, TinyLlama) tokenizers"
        )
    tokens = metadata(reader, "tokenizer.ggml.tokens", kind=list, items=str) or []
    if not tokens:
        raise UserError(f"{path}: tokenizer.ggml.tokens is missing or empty; the file is damaged (write it again)")
    types = metadata(reader, "tokenizer.ggml.token_type", kind=list, items=int) or [NORMAL] * len(tokens)
    if len(types) != len(tokens):  # which tokens are control ones (a turn's end) would be guessed
        raise UserError(
            f"{path}: tokenizer.ggml.token_type holds {len(types)} types for {len(tokens)} tokens; the file is "
            "damaged (write it again)"
        )
    ids = {role: metadata(reader, f"tokenizer.ggml.{key}_token_id", kind=int) for role, key in SPECIAL_ROLES.items()}
    ids = {role: i for role, i in ids.items() if isinstance(i, int) and 0 <= i < len(tokens)}
    pre = metadata(reader, "tokenizer.ggml.pre", "gpt-2", kind=str) if model == "gpt2" else None
    # llama.cpp opens a SentencePiece text, and a Llama 3 group's one, with bos unless the file says otherwise
    opens_with_bos = model == "llama" or pre in LLAMA3_NAMES
    adds = {
        role: metadata(reader, f"tokenizer.ggml.add_{role}_token", opens_with_bos and role == "bos", kind=bool)
        for role in ("bos", "eos")
    }
    ends = {role: tokens[i] for role, i in ids.items() if adds.get(role)}
    if model == "gpt2":
        text = tokenizer_json(tokens, types, byte_level_parts(pre, tokens, reader, path), ends)
    else:
        text = tokenizer_json(tokens, types, sentencepiece_parts(reader, tokens, types), ends)
    template = metadata(reader, "tokenizer.chat_template", kind=str)
    stops = [metadata(reader, f"tokenizer.ggml.{key}_token_id", kind=int) for key in ("eot", "eom")]
    special = {f"{role}_token": tokens[i] for role, i in ids.items()}
    return make_record(Path(path).name, text, special, template, [i for i in stops if isinstance(i, int)])


SPECIAL_ROLES = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}  # role -> llama.cpp's key


def byte_level_parts(pre: str, tokens: list[str], reader: Any, path: str | os.PathLike) -> dict[str, Any]:
    """tokenizer.json's parts for llama.cpp's byte-level BPE: the pre-tokenizer its name `pre` stands for, its
    merges."""
    if pre not in PRE_TOKENIZERS:
        raise UserError(
            f"{path}: its pre-tokenizer (tokenizer.ggml.pre) is {pre!r}; we read {', '.join(PRE_TOKENIZERS)}"
        )
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    vocab = first_ids(tokens)
    merges = usable_merges(metadata(reader, "tokenizer.ggml.merges", kind=list, items=str) or [], vocab)
    model = {"unk_token": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges}
    return {
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "decoder": {**_byte_level(use_regex=True), "add_prefix_space": True},
        "model": {**model, "merges": merges},
    }


def sentencepiece_parts(reader: Any, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """tokenizer.json's parts for llama.cpp's SentencePiece tokenizer (as transformers writes Llama 2's): spaces
    written "▁" by the normalizer, one put before each text with add_space_prefix (llama.cpp's default), byte
    fallback to the <0xXX> tokens, and merges by score (see sentencepiece_merges)."""
    space_prefix = metadata(reader, "tokenizer.ggml.add_space_prefix", True, kind=bool)
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    prepend = [{"type": "Prepend", "prepend": SPACE}] if space_prefix else []
    strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if space_prefix else []
    decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"}]
    unknown = next((token for token, kind in zip(tokens, types) if kind == UNKNOWN), None)
    scores = metadata(reader, "tokenizer.ggml.scores", kind=list, items=float) or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise UserError(
            f"{reader.data.filename}: tokenizer.ggml.scores holds {len(scores)} scores for {len(tokens)} tokens; the "
            "file is damaged (write it again)"
        )
    return {
        "normalizer": {"type": "Sequence", "normalizers": [*prepend, replace]},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [*decoders, {"type": "Fuse"}, *strip]},
        "model": {
            "unk_token": unknown,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "merges": sentencepiece_merges(tokens, types, scores),
        },
    }


def sentencepiece_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[list[str]]:
    """BPE merges under which `tokenizers` joins pieces as llama.cpp's SentencePiece tokenizer does: it joins the
    adjacent pair whose joined text is the token of highest score, so every split of a token into two tokens is a
    merge, ranked by that token's score (ties: by id, then the shorter left part)."""
    pieces = {token: i for token, i in first_ids(tokens).items() if types[i] == NORMAL}
    found = []
    for token, token_id in pieces.items():
        for cut in range(1, len(token)):
            if token[:cut] in pieces and token[cut:] in pieces:
                found.append((-scores[token_id], token_id, cut, token[:cut], token[cut:]))
    return [[left, right] for *_, left, right in sorted(found)]


def first_ids(tokens: list[str]) -> dict[str, int]:
    """Each token's id (the first, where a file repeats a token)."""
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    return vocab


def tokenizer_json(tokens: list[str], types: list[int], parts: dict[str, Any], ends: dict[str, str]) -> str:
    """tokenizer.json's text: a BPE holding every token under its id, the unknown, control and user-defined tokens
    also added tokens (as llama.cpp reads them in a text whole; the user-defined ones are not special), the model's `parts` (normalizer, pre-tokenizer, decoder, the BPE's settings and merges), and `ends`
    (bos / eos: the token) put around a text when special tokens are asked for (llama.cpp's add_bos / add_eos)."""
    vocab = first_ids(tokens)
    added = [
        {
            "id": token_id,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind != USER_DEFINED,
        }
        for token_id, (token, kind) in enumerate(zip(tokens, types))
        if kind in (UNKNOWN, CONTROL, USER_DEFINED) and vocab[token] == token_id
    ]
    model = {"type": "BPE", "dropout": None, "continuing_subword_prefix": None, "end_of_word_suffix": None}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": parts["normalizer"],
        "pre_tokenizer": parts["pre_tokenizer"],
        "post_processor": post_processor(ends, vocab),
        "decoder": parts["decoder"],
        "model": {**model, **parts["model"], "vocab": vocab},
    }
    return json.dumps(spec, ensure_ascii=False)


def usable_merges(merges: list[str], vocab: dict[str, int]) -> list[list[str]]:
    """The merges as pairs. llama.cpp splits "left right" at the first space past the first character, and skips a
    merge whose parts or result are no token (`tokenizers` refuses those), which therefore never applies."""
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1 :]) if cut > 0 else (merge, "")
        if left in vocab and right in vocab and left + right in vocab:
            pairs.append([left, right])
    return pairs


def post_processor(ends: dict[str, str], vocab: dict[str, int]) -> dict[str, Any] | None:
    """TemplateProcessing putting bos before and eos after a text, as llama.cpp does with add_bos / add_eos (our
    own encode adds neither; a tokenizer.json written back from this one keeps them)."""
    if not ends:
        return None
    before = [ends["bos"]] if "bos" in ends else []
    after = [ends["eos"]] if "eos" in ends else []

    def piece(sequence: str) -> list[dict[str, Any]]:
        return [
            *({"SpecialToken": {"id": token, "type_id": 0}} for token in before),
            {"Sequence": {"id": sequence, "type_id": 0}},
            *({"SpecialToken": {"id": token, "type_id": 0}} for token in after),
        ]

    special = {token: {"id": token, "ids": [vocab[token]], "tokens": [token]} for token in before + after}
    return {
        "type": "TemplateProcessing",
        "single": piece("A"),
        "pair": piece("A") + piece("B"),
        "special_tokens": special,
    }
