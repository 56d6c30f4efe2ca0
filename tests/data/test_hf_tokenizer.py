"""A Hugging Face model's own tokenizer and chat template against transformers (AutoTokenizer, apply_chat_template):
ids of multilingual, code and emoji text, conversations of three templates, masked spans, the record in meta.json,
streaming decode, and every refusal as one line; then prepare_data/chat.py --tokenizer=DIR end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import hf_tokenizer_dirs
from gptkit.core.errors import UserError
from gptkit.data import tokenizer as tok
from gptkit.data.chat import ChatError
from gptkit.data.conversations import open_conversations
from gptkit.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from gptkit.data.meta import META_FORMAT, META_VERSION, read_meta, validate_meta
from gptkit.data.prepare import chat_prepare
from gptkit.infer.textstream import TextStream
from helpers import assert_one_line_error, assert_one_line_message, run_main
from hf_tokenizer_dirs import (
    CHATML,
    QWEN3,
    QWEN3_SPECIALS,
    QWEN3_TEXT_TOKENS,
    TEXTS,
    write_byte_level,
    write_llama3,
    write_qwen3,
    write_sentencepiece,
)
from prepare_data import chat as chat_script

CONVERSATION = [
    {"role": "system", "content": "You answer in the user's language."},
    {"role": "user", "content": "Bonjour ! Ça va ? 🙂"},
    {"role": "assistant", "content": "Très bien, merci. 你好！"},
    {"role": "user", "content": "def f(x):\n    return x ** 2  # what?"},
    {"role": "assistant", "content": "It squares x: f(3) == 9 🚀"},
]
# Each family's template: its writer, and the text a masked span must decode to for an assistant's content.
FAMILIES = {
    "chatml": (write_byte_level, lambda content: content + "<|im_end|>"),
    "llama3": (write_llama3, lambda content: content.strip() + "<|eot_id|>"),
    "zephyr": (write_sentencepiece, lambda content: content + "</s>"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    directory = FAMILIES[request.param][0](tmp_path_factory.mktemp(request.param))
    return request.param, directory


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of ones in a 0/1 mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int64), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def test_ids_and_text_equal_autotokenizers(family: tuple[str, Path]) -> None:
    _, directory = family
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    assert ours.vocab_size == len(auto)
    for text in TEXTS:
        expected = auto(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == expected, text
        assert ours.encode_array(text).tolist() == expected
        assert ours.decode(expected) == auto.decode(expected)
    # Typed special-token text is text, never the token (ordinary text, as prompts are read).
    eos = auto.eos_token
    assert auto.convert_tokens_to_ids(eos) not in ours.encode(f"a {eos} b")
    assert auto.decode(ours.encode(f"a {eos} b")) == f"a {eos} b"


@pytest.mark.parametrize("name", hf_tokenizer_dirs.FAMILIES)
def test_a_plain_prompt_opens_as_the_autotokenizer_opens_a_text(name: str, tmp_path: Path) -> None:
    """Llama 3's tokenizer puts <|begin_of_text|> before a text (transformers' default, llama.cpp's add_bos); GPT-2's,
    Qwen2's and SmolLM2's put nothing: a plain prompt's ids are transformers' own."""
    directory = hf_tokenizer_dirs.write_family(tmp_path / name, name)
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    for text in TEXTS:
        assert tok.prompt_opening(ours) + ours.encode(text) == auto(text)["input_ids"], text
    assert tok.prompt_opening(ours) == ([auto.bos_token_id] if name == "llama3" else [])


def test_an_unpaired_surrogate_is_refused_in_one_line(family: tuple[str, Path]) -> None:
    """A lone surrogate (JSON's \\ud800) is no text: every encoder refuses it with a UserError, where the tokenizers
    library raises a TypeError."""
    _, directory = family
    ours = load_hf_tokenizer(directory)
    for encode in (ours.encode, ours.encode_with_added, ours.encode_without_added):
        for text in ("\ud800", "ok \udfff then"):
            with pytest.raises(UserError, match="unpaired surrogate"):
                encode(text)


def test_streaming_decode_joins_split_characters(family: tuple[str, Path]) -> None:
    name, directory = family
    ours = load_hf_tokenizer(directory)
    for text in TEXTS:
        ids = ours.encode(text)
        stream = TextStream(ours, stops=[])
        shown = "".join(stream.push(token) for token in ids) + stream.finish()
        # A SentencePiece word keeps its "▁" as a space token by token; the text starts with one such word.
        assert shown == (" " + text if name == "zephyr" else text)
    emoji = ours.encode("🦀")
    assert len(emoji) > 1 and all(ours.decode_bytes([i]) != "🦀".encode() for i in emoji)  # split across tokens
    assert ours.decode_bytes([ours.vocab_size + 3]) == "\ufffd".encode()  # a padded vocabulary's id


def test_conversation_ids_equal_apply_chat_template(family: tuple[str, Path]) -> None:
    _, directory = family
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    ids, mask = ours.chat.render(CONVERSATION, ours)
    assert ids.tolist() == auto.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert len(mask) == len(ids)
    prompt = ours.chat.render_prompt(CONVERSATION[:4], ours)
    assert prompt == auto.apply_chat_template(
        CONVERSATION[:4], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ours.chat.render_prompt(CONVERSATION[:4], ours, add_generation_prompt=False) == (
        auto.apply_chat_template(CONVERSATION[:4], tokenize=True, return_dict=False)
    )


def test_masked_spans_decode_to_the_assistant_contents_and_end_of_turn(family: tuple[str, Path]) -> None:
    name, directory = family
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    conversation = [*CONVERSATION[:2], {"role": "assistant", "content": "  padded reply \n"}, *CONVERSATION[3:]]
    if name == "zephyr":  # its decoder drops the space a text opens with, so no content starts with one here
        conversation[2] = {"role": "assistant", "content": "padded reply \n"}
    ids, mask = ours.chat.render(conversation, ours)
    end_of_turn = FAMILIES[name][1]
    replies = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert [auto.decode(ids[start:end].tolist()) for start, end in spans(mask)] == [end_of_turn(r) for r in replies]


def test_typed_control_tokens_stay_text(family: tuple[str, Path]) -> None:
    _, directory = family
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    controls = sorted(ours.chat.special_tokens)
    typed = "ignore that " + "".join(controls) + " then"
    conversation = [{"role": "user", "content": typed}, {"role": "assistant", "content": "no " + controls[-1]}]
    ids, mask = ours.chat.render(conversation, ours)
    assert ids.tolist() == auto.apply_chat_template(
        conversation, tokenize=True, return_dict=False, sanitize_control_tokens=True
    )
    plain = auto.apply_chat_template(conversation, tokenize=True, return_dict=False)
    control_ids = set(ours.chat.special_tokens.values())
    assert sum(i in control_ids for i in ids.tolist()) < sum(i in control_ids for i in plain)
    (start, end), *_ = spans(mask)
    assert [i for i in ids[start:end].tolist() if i in control_ids] == [ours.chat.end_of_turn]


def test_record_rebuilds_the_same_tokenizer_without_the_directory(family: tuple[str, Path], tmp_path: Path) -> None:
    _, directory = family
    ours = load_hf_tokenizer(directory)
    record = json.loads(json.dumps(ours.to_meta()))  # what meta.json and checkpoints hold: JSON only
    assert record["tokenizer_json"] == (directory / "tokenizer.json").read_text(encoding="utf-8")
    assert record["chat"]["source"] == (directory / "chat_template.jinja").read_text(encoding="utf-8")
    checkpoint_record = {**record, "vocab_size": ours.vocab_size, "eot_token": ours.eot_token}
    again = tok.tokenizer_from_meta(checkpoint_record)
    assert isinstance(again, HFTokenizer) and again.to_meta() == record
    assert [again.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert again.chat.render(CONVERSATION, again)[0].tolist() == ours.chat.render(CONVERSATION, ours)[0].tolist()
    assert (again.chat.reply_stops, again.eot_token) == (ours.chat.reply_stops, ours.eot_token)
    meta = {
        "format": META_FORMAT,
        "version": META_VERSION,
        "tokenizer": ours.without_chat().to_meta(),
        "vocab_size": ours.vocab_size,
        "dtype": "uint16",
        "eot_token": ours.eot_token,
        "splits": {"train": {"files": ["t.bin"], "tokens": 0, "text_bytes": 0, "documents": 0}},
    }
    validate_meta(meta)  # plain text data: the record without the template
    chat_split = {**meta["splits"]["train"], "mask_files": ["m.bin"], "conversations_files": ["c.bin"]}
    meta = {**meta, "tokenizer": record, "splits": {"train": chat_split}}
    validate_meta(meta)
    altered = {**record, "tokenizer_json": record["tokenizer_json"].replace('"', "'", 1)}
    with pytest.raises(UserError) as error:
        tok.tokenizer_from_meta(altered)
    assert_one_line_message(error.value, "does not match its sha256")
    with pytest.raises(UserError) as error:
        validate_meta({**meta, "vocab_size": max(ours.chat.reply_stops)})
    assert_one_line_message(error.value, "does not hold the chat template's special tokens")


def test_make_tokenizer_tells_a_hf_directory_from_a_trained_bpe(tmp_path: Path) -> None:
    directory = write_byte_level(tmp_path / "hf")
    assert isinstance(tok.make_tokenizer(str(directory)), HFTokenizer)
    assert tok.special_tokens_of(load_hf_tokenizer(directory)) == {
        "<|endoftext|>": 0,
        "<|im_start|>": 1,
        "<|im_end|>": 2,
    }
    assert tok.encode_with_special_tokens(load_hf_tokenizer(directory), "<|im_end|>") == [2]


def test_jinja_environment_is_transformers(tmp_path: Path) -> None:
    """tojson keeps non-ASCII characters, raise_exception refuses, bos_token and loop controls work, and a
    {% generation %} block renders its body, as in transformers."""
    template = (
        "{{ bos_token }}{% for m in messages %}{% if 'forbidden' in m.content %}"
        "{{ raise_exception('No forbidden words') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{% generation %}{{ m.content | tojson }}{% endgeneration %}<|im_end|>\n"
        "{% if loop.index > 8 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    directory = write_byte_level(tmp_path / "t", template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    assert ours.chat.render(CONVERSATION, ours)[0].tolist() == auto.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=False
    )
    with pytest.raises(ChatError) as error:
        ours.chat.render([{"role": "user", "content": "a forbidden word"}, CONVERSATION[2]], ours)
    assert_one_line_message(error.value, "chat template refuses", "No forbidden words")


# ----------------------------------------------------------------------------- refusals, one line each


def test_missing_or_mismatched_tokenizer_files(tmp_path: Path) -> None:
    directory = write_byte_level(tmp_path / "m")
    (directory / "tokenizer.json").rename(directory / "other.json")
    cases = {"no tokenizer.json": tmp_path / "m", "no directory": tmp_path / "nowhere"}
    for where in cases.values():
        with pytest.raises(UserError) as error:
            load_hf_tokenizer(where)
        assert_one_line_message(error.value, "tokenizer.json")
    (directory / "tokenizer.json").write_text('{"model": {"type": "Unknown"}}')
    with pytest.raises(UserError) as error:
        load_hf_tokenizer(directory)
    assert_one_line_message(error.value, "is not a Hugging Face tokenizer")
    (directory / "other.json").rename(directory / "tokenizer.json")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "</s>"}))
    with pytest.raises(UserError) as error:
        load_hf_tokenizer(directory)
    assert_one_line_message(error.value, "eos_token '</s>'", "come from different tokenizers")


@pytest.mark.parametrize(
    ("template", "fragments"),
    [
        ("{% for m in messages %}{{ m.content }", ("not valid Jinja", "line 1")),
        ("{{ raise_exception('no chat here') }}", ("refuses the conversation", "no chat here")),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", ("ends an assistant turn with no special token",)),
    ],
)
def test_a_template_that_fails_leaves_plain_text_and_says_why_there_is_no_chat(
    tmp_path: Path, template: str, fragments: tuple[str, ...]
) -> None:
    """A model whose chat template cannot render a conversation still tokenizes text as its tokenizer.json does;
    what needs the template (here preparing chat data) says why in one line."""
    directory = write_byte_level(tmp_path / "t", template)
    tokenizer = load_hf_tokenizer(directory)
    assert tokenizer.chat is None
    text = "Hello there, it's 2024!"
    expected = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text) == expected
    with pytest.raises(UserError) as error:
        chat_prepare.chat_tokenizer(tokenizer)
    assert_one_line_message(error.value, f"the tokenizer {tokenizer.name!r}: ", *fragments, "renders no conversations")


def test_qwen3s_template_trains_on_every_turn_of_a_multi_turn_conversation(tmp_path: Path) -> None:
    """Qwen3's real template gives the reply after the last user message a thinking block that earlier replies lack:
    each assistant turn is masked as the whole conversation renders it."""
    directory = write_byte_level(tmp_path / "qwen3", QWEN3, QWEN3_SPECIALS)
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    conversation = CONVERSATION
    assert ours.chat.reply_stops[0] == ours.chat.end_of_turn == auto.convert_tokens_to_ids("<|im_end|>")  # not <think>
    ids, mask = ours.chat.render(conversation, ours)
    assert ids.tolist() == auto.apply_chat_template(conversation, tokenize=True, return_dict=False)
    texts = [ours.decode(ids[start:end].tolist()) for start, end in spans(mask)]
    assert texts == [
        "Très bien, merci. 你好！<|im_end|>",
        "<think>\n\n</think>\n\nIt squares x: f(3) == 9 🚀<|im_end|>",
    ]
    prompt = ours.chat.render_prompt(conversation[:4], ours)
    assert prompt == auto.apply_chat_template(
        conversation[:4], tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_qwen3s_reasoning_tokens_are_text_that_never_ends_a_completion(tmp_path: Path) -> None:
    """Qwen3 ships <think>, <tool_call>, ... as added tokens that are not special: a completion stops only at the
    special ones and the generation config's eos ids (as vLLM and transformers), while its template still writes
    them as tokens and a message that types them gets their characters."""
    directory = write_qwen3(tmp_path / "qwen3")
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    special = {token_id for token_id, added in auto.added_tokens_decoder.items() if added.special}
    eos = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    assert set(tok.completion_stops(ours)) == special | set(eos) and len(special) == 3
    text_ids = auto.convert_tokens_to_ids(QWEN3_TEXT_TOKENS)
    assert not set(text_ids) & set(tok.completion_stops(ours)) and set(text_ids) <= set(ours.chat.ids)
    assert ours.chat.reply_stops == tuple(eos)
    ids, mask = ours.chat.render(CONVERSATION, ours)
    assert ids.tolist() == auto.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert ours.decode(ids[mask == 1].tolist()).startswith("Très bien, merci. 你好！<|im_end|><think>\n\n</think>")
    # Typed in a message, they are their characters (transformers' sanitize_control_tokens), never the token.
    typed = [{"role": "user", "content": "say <think> and </tool_call>"}, {"role": "assistant", "content": "ok"}]
    sanitized = auto.apply_chat_template(typed, tokenize=True, return_dict=False, sanitize_control_tokens=True)
    assert ours.chat.render(typed, ours)[0].tolist() == sanitized
    assert not set(text_ids) & set(sanitized[: sanitized.index(auto.convert_tokens_to_ids("<|im_end|>"))])


def test_a_template_whose_earlier_turns_end_otherwise_refuses_the_conversation(tmp_path: Path) -> None:
    # A reply followed by more has no end of turn: where it ends cannot be told.
    template = CHATML.replace(
        "message.content + '<|im_end|>'",
        "message.content + ('<|im_end|>' if loop.last or message.role != 'assistant' else '')",
    )
    ours = load_hf_tokenizer(write_byte_level(tmp_path / "t", template))
    assert ours.chat.render(CONVERSATION[:3], ours)[1].any()  # one turn: its span is found
    with pytest.raises(ChatError) as error:
        ours.chat.render(CONVERSATION, ours)
    assert error.value.reason == "template renders prefixes differently"
    assert_one_line_message(error.value, "message 2", "cannot be told apart")


# ----------------------------------------------------------------------------- prepare_data/chat.py end to end


def test_prepare_chat_with_a_hf_tokenizer(family: tuple[str, Path], tmp_path: Path, capsys: Any) -> None:
    name, directory = family
    auto = AutoTokenizer.from_pretrained(str(directory))
    conversations = [
        [*CONVERSATION[: 3 + 2 * (i % 2)]] if i % 3 else [CONVERSATION[1], {"role": "assistant", "content": f"n{i}"}]
        for i in range(40)
    ]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations), encoding="utf-8")
    out = tmp_path / "out"
    args = [
        f"--input={source}",
        f"--out_dir={out}",
        f"--tokenizer={directory}",
        "--val_fraction=0.2",
        "--num_workers=2",
    ]
    code, stdout, err = run_main(chat_script.main, args, capsys)
    assert code == 0, err
    meta = read_meta(out, check_files=True)
    assert meta["tokenizer"] == load_hf_tokenizer(directory).to_meta() and meta["vocab_size"] == len(auto)
    expected = sorted(tuple(auto.apply_chat_template(m, tokenize=True, return_dict=False)) for m in conversations)
    got, masked = [], []
    for split in ("train", "val"):
        split_conversations = open_conversations(out, split, meta)
        for index in range(len(split_conversations)):
            ids, mask = split_conversations.conversation(index)
            got.append(tuple(ids.tolist()))
            masked += [auto.decode(ids[start:end].tolist()) for start, end in spans(mask)]
    assert sorted(got) == expected
    replies = [m["content"] for c in conversations for m in c if m["role"] == "assistant"]
    assert sorted(masked) == sorted(FAMILIES[name][1](r) for r in replies)
    assert f"vocab {len(auto):,}" in stdout


def test_prepare_chat_refuses_a_tokenizer_without_template(tmp_path: Path, capsys: Any) -> None:
    directory = write_byte_level(tmp_path / "base", template=None)
    source = tmp_path / "chats.jsonl"
    source.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    args = [f"--input={source}", f"--out_dir={tmp_path / 'out'}", f"--tokenizer={directory}"]
    code, _, err = run_main(chat_script.main, args, capsys)
    assert_one_line_error(code, err, "has no chat template")
    assert not (tmp_path / "out").exists()


def test_prepare_corpus_with_a_hf_tokenizer_records_no_template(tmp_path: Path, capsys: Any) -> None:
    from prepare_data import corpus as corpus_script

    directory = write_byte_level(tmp_path / "hf")
    auto = AutoTokenizer.from_pretrained(str(directory))
    documents = [f"{i}: {TEXTS[i % len(TEXTS)]}" for i in range(30)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    out = tmp_path / "out"
    args = [f"--input={source}", f"--out_dir={out}", f"--tokenizer={directory}", "--block_size=4", "--num_workers=1"]
    code, _, err = run_main(corpus_script.main, args, capsys)
    assert code == 0, err
    meta = read_meta(out, check_files=True)
    assert "chat" not in meta["tokenizer"] and meta["tokenizer"]["kind"] == "hf"
    assert meta["eot_token"] == auto.convert_tokens_to_ids("<|im_end|>")  # the eos token separates documents
    stream = np.concatenate(
        [np.fromfile(out / f, dtype=meta["dtype"]) for s in ("train", "val") for f in meta["splits"][s]["files"]]
    )
    pieces = np.split(stream, np.flatnonzero(stream == meta["eot_token"]))
    got = sorted(tuple(piece[1:].tolist()) for piece in pieces if len(piece))
    assert got == sorted(tuple(auto(d, add_special_tokens=False)["input_ids"]) for d in documents)
