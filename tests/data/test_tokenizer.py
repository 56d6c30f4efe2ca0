"""Tests for tokenizer.py: char and tiktoken tokenizers, offline GPT-2 from --bpe_dir, trained BPE records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data.test_meta import make_meta
from gptkit.core.errors import UserError
from gptkit.data import tokenizer
from gptkit.data.bpe import GPT4_PATTERN, make_record, ranks_to_text
from gptkit.data.meta import validate_meta
from gptkit.data.tokenizer import BpeTokenizer, CharTokenizer, TiktokenTokenizer
from helpers import SHAKESPEARE, copy_gpt2_bpe_files


@pytest.fixture(scope="module")
def shakespeare_text() -> str:
    return SHAKESPEARE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def gpt2() -> TiktokenTokenizer:
    return TiktokenTokenizer("gpt2")


def test_char_tokenizer_round_trips_shakespeare(shakespeare_text: str) -> None:
    tok = CharTokenizer.from_text(shakespeare_text)
    assert tok.vocab_size == 62  # newline, space, 9 marks (!&',-.:;?), 26 small letters, 25 capitals (no X)
    assert tok.eot_token is None
    assert tok.chars == sorted(set(shakespeare_text))
    ids = tok.encode(shakespeare_text)
    assert len(ids) == len(shakespeare_text)
    assert ids[:5] == [tok.chars.index(c) for c in "First"]
    assert tok.decode(ids) == shakespeare_text


def test_char_tokenizer_with_eot_and_non_ascii() -> None:
    tok = CharTokenizer(["a", "é", "😀"], eot=True)
    assert tok.vocab_size == 4 and tok.eot_token == 3
    assert tok.encode("é😀a") == [1, 2, 0]
    assert tok.decode([0, 3, 1]) == "a<|endoftext|>é"
    assert tok.decode_bytes([2]) == "😀".encode()
    assert tok.decode([0, 99]) == "a\ufffd"
    assert tok.to_meta() == {"kind": "char", "chars": ["a", "é", "😀"], "eot": True}
    assert tok.encode_array("aé").dtype == np.int64


def test_char_tokenizer_unknown_characters_listed_once() -> None:
    tok = CharTokenizer(["a", "b"])
    with pytest.raises(UserError) as info:
        tok.encode("abxxzx\n")
    message = str(info.value)
    assert "3 character(s)" in message
    assert "'\\n'" in message and "'x'" in message and "'z'" in message
    assert message.count("'x'") == 1


def test_char_tokenizer_rejects_bad_tables() -> None:
    with pytest.raises(UserError, match="duplicate"):
        CharTokenizer(["a", "a"])
    with pytest.raises(UserError, match="single characters"):
        CharTokenizer(["ab"])


@pytest.mark.gpt2_bpe
def test_gpt2_known_ids_and_specials_as_text(gpt2: TiktokenTokenizer) -> None:
    assert gpt2.vocab_size == 50257 and gpt2.eot_token == 50256
    assert gpt2.encode("Hello world") == [15496, 995]
    # Special-token text is ordinary text here: it must not turn into the end-of-text id.
    assert 50256 not in gpt2.encode("a <|endoftext|> b")
    assert gpt2.decode([15496, 995]) == "Hello world"
    assert gpt2.decode([50256]) == "<|endoftext|>"
    # An id past the vocabulary (a padded model's output) decodes to U+FFFD instead of crashing.
    assert gpt2.decode([15496, 50300]) == "Hello\ufffd"
    assert gpt2.to_meta() == {"kind": "tiktoken", "encoding": "gpt2"}


@pytest.mark.gpt2_bpe
def test_gpt2_numpy_encoding_matches_the_list_encoding(gpt2: TiktokenTokenizer, shakespeare_text: str) -> None:
    """encode_array (the pipeline's fast path) gives exactly encode's ids, special-token text included."""
    text = shakespeare_text[:20000] + " <|endoftext|> naïve 日本語 🙂"
    array = gpt2.encode_array(text)
    assert array.dtype == np.uint32
    assert array.tolist() == gpt2.encode(text)


@pytest.mark.gpt2_bpe
def test_bpe_dir_matches_cached_encoding(tmp_path: Path, gpt2: TiktokenTokenizer, shakespeare_text: str) -> None:
    local = TiktokenTokenizer("gpt2", bpe_dir=copy_gpt2_bpe_files(tmp_path / "bpe"))
    assert local.vocab_size == 50257 and local.eot_token == 50256
    sample = shakespeare_text[:200_000] + " naïve café 😀 \t\r\n  x"
    assert local.encode(sample) == gpt2.encode(sample)
    assert local.decode(local.encode(sample)) == sample


@pytest.mark.gpt2_bpe
def test_bpe_dir_corrupted_or_missing_file_rejected(tmp_path: Path) -> None:
    bpe = copy_gpt2_bpe_files(tmp_path / "bpe")
    data = bytearray((bpe / "vocab.bpe").read_bytes())
    data[100] ^= 0x01  # one flipped bit
    (bpe / "vocab.bpe").write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"vocab.bpe has sha256"):
        TiktokenTokenizer("gpt2", bpe_dir=bpe)
    (bpe / "encoder.json").unlink()
    copy = copy_gpt2_bpe_files(tmp_path / "other")
    (copy / "encoder.json").unlink()
    with pytest.raises(UserError, match=r"encoder.json is missing"):
        TiktokenTokenizer("gpt2", bpe_dir=copy)
    with pytest.raises(UserError, match="only supports the gpt2"):
        TiktokenTokenizer("cl100k_base", bpe_dir=copy)


def test_unknown_encoding_name() -> None:
    with pytest.raises(UserError, match="unknown tokenizer 'gpt5'"):
        TiktokenTokenizer("gpt5")


def test_a_missing_gguf_file_is_said_to_be_missing(tmp_path: Path) -> None:
    """Not a tokenizer directory to train again: a file the user named that is not there."""
    missing = tmp_path / "qwen2.5-0.5b-instruct-q4_k_m.gguf"
    with pytest.raises(UserError) as error:
        tokenizer.make_tokenizer(str(missing))
    assert str(error.value) == f"{missing}: no such file or directory"


@pytest.mark.gpt2_bpe
def test_tokenizer_from_meta_rebuilds_both_kinds() -> None:
    char = tokenizer.tokenizer_from_meta({"kind": "char", "chars": ["x", "y"], "eot": True})
    assert isinstance(char, CharTokenizer) and char.vocab_size == 3 and char.encode("yx") == [1, 0]
    bpe = tokenizer.tokenizer_from_meta({"kind": "tiktoken", "encoding": "gpt2"})
    assert isinstance(bpe, TiktokenTokenizer) and bpe.encode("Hello") == [15496]
    with pytest.raises(UserError):
        tokenizer.tokenizer_from_meta({"kind": "sentencepiece"})


# ----------------------------------------------------------------------------- trained BPE records (gptkit.data.bpe)

TINY_RANKS = {**{bytes([b]): b for b in range(256)}, b"ab": 256, b"abc": 257}


def tiny_record(ranks: dict[bytes, int] = TINY_RANKS, specials: dict | None = None, pattern: str = GPT4_PATTERN):
    """A trained-BPE record: every byte, then the merges a+b and ab+c, then end-of-text."""
    return make_record("tiny", pattern, specials or {tokenizer.END_OF_TEXT: len(ranks)}, ranks_to_text(ranks))


def test_a_bpe_record_rebuilds_the_tokenizer_as_a_checkpoint_stores_it() -> None:
    record = tiny_record()
    # A checkpoint's record is meta.json's plus vocab_size and eot_token (checkpoint.tokenizer_record).
    tok = tokenizer.tokenizer_from_meta({**record, "vocab_size": 259, "eot_token": 258})
    assert isinstance(tok, BpeTokenizer) and (tok.vocab_size, tok.eot_token) == (259, 258)
    assert tok.encode("abc ab") == [257, 32, 256] and tok.decode([257, 258, 99]) == "abc<|endoftext|>c"
    assert tok.to_meta() == record
    meta = make_meta(tokenizer=record, vocab_size=259, eot_token=258)
    validate_meta(meta)


def _rehashed(record: dict, ranks_text: str) -> dict:
    return make_record(record["name"], record["pattern"], record["special_tokens"], ranks_text)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda r: {**r, "ranks": r["ranks"].replace("YWI= 256", "YWI= 255")}, "altered or damaged"),
        (lambda r: {**r, "ranks": r["ranks"][:-9]}, "altered or damaged"),  # truncated
        (lambda r: _rehashed(r, r["ranks"].replace("YWI= 256", "YWI= 300")), "ranks must be 0, 1, 2"),
        (lambda r: _rehashed(r, r["ranks"].replace("YWI= 256", "Y!I= 256")), "is not 'base64 rank'"),
        (lambda r: tiny_record({t: i for i, t in enumerate(list(TINY_RANKS)[1:])}), "single bytes have no token"),
        (lambda r: {**r, "special_tokens": {"<|endoftext|>": 3}}, "collide"),
        (lambda r: {**r, "pattern": "(unclosed"}, "tiktoken refuses"),
        (lambda r: {k: v for k, v in r.items() if k != "ranks"}, "'ranks' must be"),
        (lambda r: {**r, "ranks_sha256": "abc"}, "not a sha256"),
    ],
)
def test_a_damaged_bpe_record_is_one_clear_error(damage, message: str) -> None:
    with pytest.raises(UserError) as info:
        tokenizer.tokenizer_from_meta(damage(tiny_record()))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.gpt2_bpe
def test_make_tokenizer_takes_names_and_trained_directories(tmp_path: Path) -> None:
    assert type(tokenizer.make_tokenizer("gpt2")) is TiktokenTokenizer
    with pytest.raises(UserError, match=r"train_tokenizer\.py"):
        tokenizer.make_tokenizer("gpt5")  # neither a tiktoken name nor a directory
    with pytest.raises(UserError, match="does not exist"):
        tokenizer.make_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(UserError, match=r"has no tokenizer\.json"):
        tokenizer.make_tokenizer(str(tmp_path))
    with pytest.raises(UserError, match="--bpe_dir is for GPT-2"):
        tokenizer.make_tokenizer(str(tmp_path), bpe_dir=tmp_path)


@pytest.mark.parametrize("vocab_size, padded", [(50257, 50304), (65, 128), (64, 64), (1, 64)])
def test_padded_vocab_size_rounds_up_to_a_multiple_of_64(vocab_size: int, padded: int) -> None:
    assert tokenizer.padded_vocab_size(vocab_size) == padded  # GPT-2's 50257 to nanoGPT's 50304
