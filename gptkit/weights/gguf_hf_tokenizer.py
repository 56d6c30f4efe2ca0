"""A Hugging Face tokenizer (tokenizer.json) as GGUF metadata: a byte-level BPE as llama.cpp's "gpt2" tokenizer, a
SentencePiece-style BPE (byte fallback, "▁" for spaces: Llama 2, Mistral) as its "llama" one, and a table of
one-byte characters (a character-level model's export) as a "gpt2" BPE without merges.

llama.cpp does not read tokenizer.json's pre-tokenizer: it picks one of its own by the name in `tokenizer.ggml.pre`,
each a fixed list of regexes. Its converter names the pre-tokenizer by hashing a test text's tokens, which needs the
real tokenizer; here the name is chosen by what tokenizer.json says (the pre-tokenizer's structure and regex), and
only where llama.cpp's regexes for that name split text exactly as it does. Anything else is refused in one line.

    GPT-2                  ByteLevel(use_regex) alone                            -> gpt-2
    SmolLM, SmolLM2        Digits(individual) then ByteLevel(use_regex)          -> smollm
    Llama 3                Split(Llama 3's regex) then ByteLevel                 -> llama-bpe
    Qwen2, Qwen2.5, Qwen3  Split(Qwen2's regex, one digit each) then ByteLevel   -> qwen2
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gptkit.core.errors import UserError
from gptkit.data import bpe
from gptkit.data.hf_tokenizer import HFTokenizer
from gptkit.data.tokenizer import gpt2_unicode_to_byte

SPACE = "\u2581"  # SentencePiece's space
# llama.cpp reads the merges key of every byte-level BPE and the gguf writer stores no empty list: a table without
# merges gets this one rule, which joins two pieces no rule makes and so never applies.
UNREACHABLE_MERGE = ("\u0120\u0120", "\u0120\u0120")
# The pre-tokenizer of a character table's tokenizer.json (export_hf.build_tokenizer): every character alone.
CHARACTER_SPLIT = {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": False}
BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
BYTE_STAND_INS = {byte: char for char, byte in gpt2_unicode_to_byte().items()}  # byte-level BPE's printable bytes
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_CONTRACTIONS_SPELLED = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # llama.cpp's spelling
_LETTERS_DIGITS = r"|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The regexes of a Split before a regex-less ByteLevel, as the families' tokenizer.json files write them, by the
# llama.cpp pre-tokenizer whose regex is the same.
SPLIT_PATTERNS = {
    **{c + _LETTERS_DIGITS + r"\p{N}{1,3}" + _REST: "llama-bpe" for c in (_CONTRACTIONS, _CONTRACTIONS_SPELLED)},
    bpe.GPT4_PATTERN: "llama-bpe",  # tiktoken's cl100k spelling of the same split
    **{c + _LETTERS_DIGITS + r"\p{N}" + _REST: "qwen2" for c in (_CONTRACTIONS, _CONTRACTIONS_SPELLED)},
    GPT2_PATTERN: "gpt-2",
}
# llama.cpp's Llama 3 pre-tokenizer also takes a pre-token that is itself a token whole, before any merge (its
# ignore_merges); the others always merge. tokenizer.json says which its BPE does.
IGNORES_MERGES = {"llama-bpe"}
# Normalizers that change no text llama.cpp is given in practice: NFC leaves composed text as it is, and llama.cpp's
# converter skips it the same way.
HARMLESS_NORMALIZERS = {None, "NFC"}


@dataclass(frozen=True, kw_only=True)
class GGUFTokenizer:
    """What llama.cpp needs of a tokenizer.json: its tokens (padded to the model's rows), their types, the merges
    and pre-tokenizer name of a byte-level BPE or the scores and space prefix of a SentencePiece one, special ids
    and whether a prompt opens with bos."""

    kind: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    types: list[int]
    merges: list[str]
    scores: list[float] | None
    pre: str | None
    add_space_prefix: bool | None
    special_ids: dict[str, int]
    add_bos: bool
    add_eos: bool


def pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """llama.cpp's name for tokenizer.json's pre-tokenisation (its "pre_tokenizer", "normalizer" and "model");
    UserError naming what no llama.cpp pre-tokenizer does."""
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in HARMLESS_NORMALIZERS:
        raise UserError(
            f"cannot export this tokenizer to GGUF: llama.cpp's byte-level BPE has no {normalizer} normalizer"
        )
    parts = _flatten(spec.get("pre_tokenizer"))
    name = _name_of_parts(parts)
    if name is None:
        described = ", ".join(_describe(part) for part in parts) or "none"
        raise UserError(
            f"cannot export this tokenizer to GGUF: no llama.cpp pre-tokenizer splits text as its pre-tokenizer "
            f"({described}) does"
        )
    ignores = bool((spec.get("model") or {}).get("ignore_merges"))
    if ignores != (name in IGNORES_MERGES):
        raise UserError(
            f"cannot export this tokenizer to GGUF: its BPE has ignore_merges={ignores}, llama.cpp's {name!r} "
            f"pre-tokenizer {'takes' if name in IGNORES_MERGES else 'never takes'} whole tokens before merging"
        )
    return name


def _flatten(pre: Any) -> list[dict[str, Any]]:
    if not isinstance(pre, dict):
        return []
    if pre.get("type") == "Sequence":
        return [part for item in pre.get("pretokenizers") or [] for part in _flatten(item)]
    return [pre]


def _describe(part: dict[str, Any]) -> str:
    pattern = (part.get("pattern") or {}).get("Regex") if part.get("type") == "Split" else None
    return part.get("type", "?") + (f"({pattern!r})" if pattern else "")


def _byte_level(part: dict[str, Any], use_regex: bool) -> bool:
    return part.get("type") == "ByteLevel" and not part.get("add_prefix_space") and part.get("use_regex") == use_regex


def _name_of_parts(parts: list[dict[str, Any]]) -> str | None:
    if len(parts) == 1 and _byte_level(parts[0], use_regex=True):
        return "gpt-2"
    if len(parts) != 2:
        return None
    first, second = parts
    if first.get("type") == "Digits" and first.get("individual_digits") and _byte_level(second, use_regex=True):
        return "smollm"
    isolated = first.get("type") == "Split" and first.get("behavior") == "Isolated" and not first.get("invert")
    if isolated and _byte_level(second, use_regex=False):
        return SPLIT_PATTERNS.get((first.get("pattern") or {}).get("Regex"))
    return None


def gguf_tokenizer(tokenizer: HFTokenizer, rows: int) -> GGUFTokenizer:
    """The GGUF form of a tokenizer.json (byte-level BPE, or SentencePiece-style BPE) for a model of `rows` embedding
    rows (ids past the tokenizer's become unused "[PADi]" tokens); UserError (one line) for what llama.cpp cannot
    hold."""
    spec = json.loads(tokenizer.to_meta()["tokenizer_json"])
    model = spec.get("model") or {}
    if model.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        kind, pre, add_space_prefix = "gpt2", pre_tokenizer_name(spec), None
    elif model.get("type") == "BPE" and model.get("byte_fallback"):
        kind, pre, add_space_prefix = "llama", None, sentencepiece_space_prefix(spec, list(model.get("vocab") or {}))
    elif model.get("type") == "WordLevel" and spec.get("pre_tokenizer") == CHARACTER_SPLIT:
        kind, pre, add_space_prefix = "gpt2", "gpt-2", None
    else:
        raise UserError(
            f"cannot export this tokenizer to GGUF: export writes byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, "
            f"SmolLM) and SentencePiece-style ones (Llama 2, Mistral), not a {model.get('type')} one; use --format=hf "
            "and llama.cpp's convert_hf_to_gguf.py"
        )
    if tokenizer.vocab_size > rows:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {rows} rows")
    vocab = _vocab(spec) if model.get("type") != "WordLevel" else _byte_level_characters(spec)
    by_id = {token_id: text for text, token_id in vocab.items()}
    missing = [i for i in range(tokenizer.vocab_size) if i not in by_id]
    if missing:
        raise UserError(f"the tokenizer has no token for id {missing[0]}; GGUF needs every id to have one")
    tokens = [by_id[i] for i in range(tokenizer.vocab_size)] + [f"[PAD{i}]" for i in range(tokenizer.vocab_size, rows)]
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model.get("merges") or []]
    if not merges and kind == "llama":  # a SentencePiece BPE's scores come from its merges
        raise UserError("cannot export this tokenizer to GGUF: its BPE has no merges, which llama.cpp requires")
    if not merges:  # a byte-level BPE without merges (a table of one-byte characters, read from a GGUF file)
        merges = [" ".join(UNREACHABLE_MERGE)]
    names = tokenizer.special_tokens_map
    named_ids = {role: tokenizer.named_token_id(f"{role}_token") for role in ("bos", "eos", "unk", "pad")}
    special_ids = {role: token_id for role, token_id in named_ids.items() if token_id is not None}
    opening, closing = _post_processor_ends(spec.get("post_processor"))
    return GGUFTokenizer(
        kind=kind,
        tokens=tokens,
        types=token_types(tokens, tokenizer, kind, model.get("unk_token")),
        merges=merges if kind == "gpt2" else [],
        scores=sentencepiece_scores(tokens, merges, tokenizer.added_tokens) if kind == "llama" else None,
        pre=pre,
        add_space_prefix=add_space_prefix,
        special_ids=special_ids,
        add_bos=opening is not None and opening == names.get("bos_token"),
        add_eos=closing is not None and closing == names.get("eos_token"),
    )


def token_types(tokens: list[str], tokenizer: HFTokenizer, kind: str, unk: str | None) -> list[int]:
    """llama.cpp's type of each token: added tokens are control (special) or user-defined ones; a SentencePiece
    vocabulary also has its unknown token and the 256 byte tokens <0x00>..<0xFF> its byte fallback writes."""
    import gguf

    T = gguf.TokenType
    types = [int(T.NORMAL if i < tokenizer.vocab_size else T.UNUSED) for i in range(len(tokens))]
    if kind == "llama":
        for i in range(tokenizer.vocab_size):
            if BYTE_TOKEN.fullmatch(tokens[i]):
                types[i] = int(T.BYTE)
    for token_id, special in tokenizer.added_tokens.values():
        types[token_id] = int(T.CONTROL if special else T.USER_DEFINED)
    if kind == "llama" and unk is not None and unk in tokens:
        types[tokens.index(unk)] = int(T.UNKNOWN)
    return types


def sentencepiece_space_prefix(spec: dict[str, Any], tokens: list[str]) -> bool:
    """Whether a SentencePiece-style tokenizer.json (its BPE's `tokens`) opens text with "▁" (llama.cpp's
    add_space_prefix); UserError unless llama.cpp's SentencePiece tokenizer writes spaces as "▁" exactly as it does.
    llama.cpp turns every space
    into "▁" and, with add_space_prefix, puts one more before the text and after each added token, whatever the text
    begins with: that is the normalizer Replace(" ", "▁"), after Prepend("▁") or not, with no pre-tokenizer (Llama
    2's tokenizer.json as transformers wrote it before tokenizers 0.14), or the pre-tokenizer Metaspace with no
    normalizer when it prepends nothing (see _metaspace_space_prefix)."""
    if isinstance(spec.get("pre_tokenizer"), dict) and spec["pre_tokenizer"].get("type") == "Metaspace":
        return _metaspace_space_prefix(spec, tokens)
    normalizer = spec.get("normalizer") or {}
    parts = (normalizer.get("normalizers") or []) if normalizer.get("type") == "Sequence" else [normalizer]
    kinds = [(part.get("type"), part.get("prepend") or (part.get("pattern") or {}).get("String")) for part in parts]
    replace = ("Replace", " ")
    spaces = all(part.get("content") == SPACE for part in parts if part.get("type") == "Replace")
    if spec.get("pre_tokenizer") is None and kinds in ([("Prepend", SPACE), replace], [replace]) and spaces:
        return len(kinds) == 2
    raise UserError(
        "cannot export this tokenizer to GGUF: llama.cpp's SentencePiece tokenizer takes spaces written as '▁' by "
        "the normalizer (Prepend('▁') then Replace(' ', '▁'), as Llama 2's tokenizer.json), or by a Metaspace "
        f"pre-tokenizer, not this normalizer {[kind for kind, _ in kinds]} and pre-tokenizer "
        f"{(spec.get('pre_tokenizer') or {}).get('type')}"
    )


def _metaspace_space_prefix(spec: dict[str, Any], tokens: list[str]) -> bool:
    """add_space_prefix (False) of a tokenizer.json whose pre-tokenizer Metaspace writes spaces as "▁", the form
    tokenizers >= 0.14 and transformers write; UserError where llama.cpp would tokenize otherwise. Metaspace puts "▁"
    before a text (prepend_scheme "first": the first text; "always": each text between added tokens) only when it
    does not begin with a space already, where llama.cpp always puts one: " Hi" is "▁Hi" to one and "▁▁Hi" to the
    other, so only prepend_scheme "never" (no prefix, as llama.cpp without add_space_prefix) is exact. Its split
    (words cut before each "▁") changes nothing where no token holds a "▁" past its first character."""
    pre = spec["pre_tokenizer"]
    where = "cannot export this tokenizer to GGUF: its pre-tokenizer Metaspace"
    if spec.get("normalizer") is not None or pre.get("replacement") != SPACE:
        raise UserError(
            f"{where} with replacement {pre.get('replacement')!r} and normalizer "
            f"{(spec.get('normalizer') or {}).get('type')} is not how llama.cpp's SentencePiece tokenizer writes "
            "spaces (as '▁', with no normalizer)"
        )
    # Files written before tokenizers 0.14 say add_prefix_space (true: "always") and always split.
    scheme = pre.get("prepend_scheme") or ("always" if pre.get("add_prefix_space", True) else "never")
    if scheme != "never":
        raise UserError(
            f"{where} (prepend_scheme {scheme!r}) puts '▁' before a text only when it does not begin with a space, "
            "where llama.cpp's SentencePiece tokenizer (add_space_prefix) always puts one, so the two tokenize text "
            "such as ' Hi' differently; export --format=hf and convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    spanning = next((token for token in tokens if SPACE in token[1:]), None)
    if pre.get("split", True) and spanning is not None:
        raise UserError(
            f"{where} cuts text into words before each '▁' (split true), but the token {spanning!r} holds a '▁' "
            "past its start: llama.cpp's SentencePiece tokenizer, which does not cut words, would make it"
        )
    return False


def sentencepiece_scores(tokens: list[str], merges: list[str], added: dict[str, tuple[int, bool]]) -> list[float]:
    """Scores under which llama.cpp's SentencePiece tokenizer (merge the adjacent pair whose joined text is the
    token of highest score) merges as the BPE does (the pair of lowest merge rank): a token scores minus the rank of
    the first merge that makes it. That is the same only when every split of a token into two tokens is a merge, as
    in the tokenizer.json files written from SentencePiece models; UserError naming a split that is not."""
    rank_of = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1)
        rank_of.setdefault(left + right, rank)
    pairs = set(merges)
    known = {token for token in tokens if token not in added}
    for token in known:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in known and right in known and f"{left} {right}" not in pairs:
                raise UserError(
                    f"cannot export this tokenizer to GGUF: {left!r} + {right!r} make the token {token!r} but are no "
                    "merge of its BPE; llama.cpp's SentencePiece tokenizer would join them (it merges by token score)"
                )
    return [-float(rank_of[token]) if token in rank_of else 0.0 for token in tokens]


def _vocab(spec: dict[str, Any]) -> dict[str, int]:
    vocab = dict((spec.get("model") or {}).get("vocab") or {})
    for added in spec.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    return vocab


def _byte_level_characters(spec: dict[str, Any]) -> dict[str, int]:
    """A character table's vocabulary as a byte-level BPE's (byte_level_character); added tokens as they are."""
    added = {token["content"]: token["id"] for token in spec.get("added_tokens") or []}
    table = spec["model"]["vocab"].items()
    return {byte_level_character(text): token_id for text, token_id in table if text not in added} | added


def byte_level_character(character: str) -> str:
    """A character table's character (one byte in UTF-8) as the printable stand-in byte-level BPE writes for its
    byte, so that llama.cpp, looking text up byte by byte, finds the table's id; UserError for a character of more
    bytes, which no byte lookup finds."""
    encoded = character.encode("utf-8")
    if len(encoded) != 1:
        raise UserError(
            f"cannot export this character vocabulary to GGUF: {character!r} is more than one byte in UTF-8, and "
            "llama.cpp's byte-level BPE looks text up byte by byte; use --format=hf, or train on a BPE tokenizer"
        )
    return BYTE_STAND_INS[encoded[0]]


def _post_processor_ends(processor: Any) -> tuple[str | None, str | None]:
    """The special tokens tokenizer.json's post-processor puts before and after a single text (TemplateProcessing,
    alone or in a Sequence), which llama.cpp adds when asked for special tokens (its add_bos / add_eos)."""
    if not isinstance(processor, dict):
        return None, None
    if processor.get("type") == "Sequence":
        for part in processor.get("processors") or []:
            ends = _post_processor_ends(part)
            if ends != (None, None):
                return ends
        return None, None
    if processor.get("type") != "TemplateProcessing":
        return None, None
    single = processor.get("single") or []
    texts = [item["SpecialToken"]["id"] if "SpecialToken" in item else None for item in single]
    return (texts[0] if texts else None), (texts[-1] if len(texts) > 1 else None)


def add_hf_tokenizer(writer: Any, tokenizer: HFTokenizer, rows: int) -> None:
    """Write the tokenizer's GGUF keys: model, pre-tokenizer, tokens, types, merges, special ids, chat template."""
    vocabulary = gguf_tokenizer(tokenizer, rows)
    writer.add_tokenizer_model(vocabulary.kind)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    if vocabulary.kind == "gpt2":
        writer.add_tokenizer_pre(vocabulary.pre)
        writer.add_token_merges(vocabulary.merges)
    else:
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(vocabulary.scores)
        writer.add_add_space_prefix(vocabulary.add_space_prefix)
    adders = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id,
        "pad": writer.add_pad_token_id,
    }
    for role, token_id in vocabulary.special_ids.items():
        adders[role](token_id)
    writer.add_add_bos_token(vocabulary.add_bos)
    writer.add_add_eos_token(vocabulary.add_eos)
    if tokenizer.chat is not None:
        writer.add_eot_token_id(tokenizer.chat.end_of_turn)
        writer.add_chat_template(tokenizer.chat.source)


def hf_modelfile(filename: str, tokenizer: HFTokenizer, block_size: int) -> str:
    """An ollama Modelfile: ollama reads the chat template from the GGUF file; the stops are the template's."""
    stops = list(tokenizer.chat.reply_stops) if tokenizer.chat is not None else [tokenizer.eot_token]
    lines = [f"FROM ./{filename}"]
    for stop in dict.fromkeys(stop for stop in stops if stop is not None):
        lines.append(f"PARAMETER stop {json.dumps(tokenizer.decode([stop]), ensure_ascii=False)}")
    lines.append(f"PARAMETER num_ctx {block_size}")
    return "\n".join(lines) + "\n"
