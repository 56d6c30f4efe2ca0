"""GGUF export of a model whose tokenizer is a Hugging Face tokenizer.json: small tokenizers trained here with each
family's real pre-tokenizer (GPT-2, Llama 3, Qwen2, SmolLM2), read back with llama.cpp's reader (gguf.GGUFReader);
and, on demand (-m slow or GPTKIT_SLOW_TESTS=1), tokenized and run by llama.cpp itself (llama-cpp-python), whose
tokens must be the `tokenizers` library's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptkit.core.errors import UserError
from gptkit.data.hf_tokenizer import load_hf_tokenizer
from gptkit.weights import gguf_hf_tokenizer
from helpers import greedy_llama_cpp, lively_model, reference_greedy
from hf_tokenizer_dirs import FAMILIES, VARIED, write_family, write_sentencepiece

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from test_export_gguf import QWEN3, export, field, slow_requested  # noqa: E402

# What llama.cpp must call each family's pre-tokenizer (the names its converter gives the real models).
PRE_NAMES = {"gpt2": "gpt-2", "llama3": "llama-bpe", "qwen2": "qwen2", "smollm2": "smollm"}
ROWS = 640  # the model's embedding rows: more than the tokenizers' ~600 tokens, so the file pads
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "A fox. It's 2024!"},
    {"role": "user", "content": "And 12345?"},
]


# SentencePiece-style tokenizers: Llama 2's normalizer form, and the Metaspace form llama.cpp tokenizes exactly (no
# "▁" prepended), its text cut into words or not.
SENTENCEPIECE = {
    "llama2": {},
    "metaspace": dict(prepend_scheme="never", split=False),
    "metaspace-split": dict(prepend_scheme="never", split=True),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Each byte-level family's tokenizer, and the SentencePiece-style ones (SENTENCEPIECE)."""
    root = tmp_path_factory.mktemp("families")
    directories = {family: write_family(root / family, family) for family in FAMILIES}
    for name, form in SENTENCEPIECE.items():
        directories[name] = write_sentencepiece(root / name, every_split=True, **form)
    return directories


def hf_tokenizer_json(directory: Path):
    return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tokenizer_is_written_as_llama_cpp_reads_it(tmp_path, family_dirs, family):
    tokenizer = load_hf_tokenizer(family_dirs[family])
    reader = gguf.GGUFReader(export(tmp_path, lively_model(vocab_size=ROWS, **QWEN3), tokenizer))
    spec = json.loads((family_dirs[family] / "tokenizer.json").read_text())
    hf = hf_tokenizer_json(family_dirs[family])
    size = hf.get_vocab_size(with_added_tokens=True)
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == PRE_NAMES[family]
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == ROWS
    assert tokens[:size] == [hf.id_to_token(i) for i in range(size)]
    assert tokens[size:] == [f"[PAD{i}]" for i in range(size, ROWS)]
    specials = {added.content for added in hf.get_added_tokens_decoder().values()}
    for i in range(size):
        expected = gguf.TokenType.CONTROL if tokens[i] in specials else gguf.TokenType.NORMAL
        assert types[i] == expected, tokens[i]
    assert set(types[size:]) == {gguf.TokenType.UNUSED}
    assert field(reader, "tokenizer.ggml.merges") == [" ".join(merge) for merge in spec["model"]["merges"]]
    config = json.loads((family_dirs[family] / "tokenizer_config.json").read_text())
    for role, key in (
        ("bos", gguf.Keys.Tokenizer.BOS_ID),
        ("eos", gguf.Keys.Tokenizer.EOS_ID),
        ("pad", gguf.Keys.Tokenizer.PAD_ID),
    ):
        if f"{role}_token" in config:
            assert field(reader, key) == hf.token_to_id(config[f"{role}_token"]), role
        else:
            assert key not in reader.fields, role
    # llama.cpp adds bos to a prompt only where tokenizer.json's post-processor does (Llama 3's).
    with_bos = hf.encode("Hi", add_special_tokens=True).ids != hf.encode("Hi", add_special_tokens=False).ids
    assert field(reader, "tokenizer.ggml.add_bos_token") is with_bos is (family == "llama3")
    if tokenizer.chat is None:
        assert "tokenizer.chat_template" not in reader.fields
    else:
        assert field(reader, "tokenizer.chat_template") == tokenizer.chat.source
        assert tokens[field(reader, "tokenizer.ggml.eot_token_id")] in ("<|im_end|>", "<|eot_id|>")
    modelfile = (tmp_path / "gguf-f32" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./tiny-f32.gguf\n") and 'PARAMETER stop "' in modelfile


def edited_tokenizer(tmp_path: Path, source: Path, edit) -> Path:
    """A copy of the tokenizer directory `source` whose tokenizer.json went through `edit` (a dict -> None)."""
    directory = tmp_path / "edited"
    directory.mkdir()
    for path in source.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    spec = json.loads((directory / "tokenizer.json").read_text())
    edit(spec)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


def gpt4o_split(spec):
    # GPT-4o's (o200k) split, which none of llama.cpp's names written here matches.
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    )


@pytest.mark.parametrize(
    "family, edit, named",
    [
        ("qwen2", gpt4o_split, "no llama.cpp pre-tokenizer splits text as its pre-tokenizer (Split("),
        ("gpt2", lambda spec: spec["pre_tokenizer"].update(add_prefix_space=True), "pre-tokenizer (ByteLevel)"),
        ("gpt2", lambda spec: spec.update(pre_tokenizer={"type": "Whitespace"}), "pre-tokenizer (Whitespace)"),
        ("gpt2", lambda spec: spec.update(normalizer={"type": "Lowercase"}), "no Lowercase normalizer"),
        ("qwen2", lambda spec: spec["model"].update(ignore_merges=True), "ignore_merges=True"),
    ],
    ids=["gpt4o-split", "prefix-space", "whitespace", "lowercase", "ignore-merges"],
)
def test_a_pre_tokenizer_no_llama_cpp_name_matches_is_refused_in_one_line(tmp_path, family_dirs, family, edit, named):
    tokenizer = load_hf_tokenizer(edited_tokenizer(tmp_path, family_dirs[family], edit))
    with pytest.raises(UserError, match="cannot export this tokenizer to GGUF") as error:
        export(tmp_path, lively_model(vocab_size=ROWS, **QWEN3), tokenizer)
    assert named in str(error.value) and "\n" not in str(error.value)
    assert list((tmp_path / "gguf-f32").iterdir()) == []  # refused before writing


@pytest.mark.parametrize("form", SENTENCEPIECE)
def test_a_sentencepiece_tokenizer_is_written_as_llama_cpps_llama_tokenizer(tmp_path, family_dirs, form):
    """Llama 2's form and the Metaspace one: tokens with "▁" for spaces, scores that make llama.cpp merge as the BPE
    does (minus the rank of the merge that makes each token), byte, unknown and control types, a space before the
    text where the tokenizer puts one."""
    directory = family_dirs[form]
    reader = gguf.GGUFReader(export(tmp_path, lively_model(vocab_size=ROWS, **QWEN3), load_hf_tokenizer(directory)))
    spec = json.loads((directory / "tokenizer.json").read_text())
    hf = hf_tokenizer_json(directory)
    size = hf.get_vocab_size(with_added_tokens=True)
    assert field(reader, "tokenizer.ggml.model") == "llama"
    prefixed = hf.encode("Hi", add_special_tokens=False).tokens[0].startswith("▁")
    assert field(reader, "tokenizer.ggml.add_space_prefix") is prefixed is (form == "llama2")
    assert "tokenizer.ggml.merges" not in reader.fields
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert tokens[:size] == [hf.id_to_token(i) for i in range(size)] and len(tokens) == ROWS
    T = gguf.TokenType
    assert types[:4] == [T.UNKNOWN, T.CONTROL, T.CONTROL, T.BYTE] and tokens[3] == "<0x00>"
    assert types[3:259] == [T.BYTE] * 256 and set(types[259:size]) == {T.NORMAL} and set(types[size:]) == {T.UNUSED}
    scores = field(reader, "tokenizer.ggml.scores")
    for rank, (left, right) in enumerate(spec["model"]["merges"][:50]):
        token_id = hf.token_to_id(left + right)
        first = min(i for i, merge in enumerate(spec["model"]["merges"]) if "".join(merge) == left + right)
        assert scores[token_id] == -first, (left, right, rank)
    assert [field(reader, f"tokenizer.ggml.{role}_token_id") for role in ("bos", "eos", "unknown")] == [1, 2, 0]


def metaspace(**settings):
    """An edit of a Metaspace tokenizer.json: its pre-tokenizer's settings replaced."""
    return lambda spec: spec["pre_tokenizer"].update(settings)


def written_before_tokenizers_0_14(spec):
    # {"add_prefix_space": true} where newer files say prepend_scheme "always" (and split true, the default).
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "add_prefix_space": True}


def with_double_space_token(spec):
    # "▁▁" (two spaces) as Llama 2's vocabulary has it: a "▁" past the token's start, across a word cut.
    spec["model"]["vocab"]["▁▁"] = max(spec["model"]["vocab"].values()) + 1
    spec["model"]["merges"].append(["▁", "▁"])


@pytest.mark.parametrize(
    "form, edit, named",
    [
        ("metaspace", metaspace(prepend_scheme="first"), "(prepend_scheme 'first') puts '▁' before a text only when"),
        ("metaspace-split", metaspace(prepend_scheme="always"), "(prepend_scheme 'always')"),
        ("metaspace", written_before_tokenizers_0_14, "(prepend_scheme 'always')"),
        ("metaspace-split", with_double_space_token, "the token '▁▁' holds a '▁' past its start"),
        ("metaspace", metaspace(replacement="_"), "replacement '_' and normalizer None"),
        ("metaspace", lambda spec: spec.update(normalizer={"type": "NFKC"}), "replacement '▁' and normalizer NFKC"),
    ],
    ids=["first", "always", "add-prefix-space", "split-across-words", "replacement", "normalizer"],
)
def test_a_metaspace_tokenizer_llama_cpp_would_tokenize_otherwise_is_refused_in_one_line(
    tmp_path, family_dirs, form, edit, named
):
    tokenizer = load_hf_tokenizer(edited_tokenizer(tmp_path, family_dirs[form], edit))
    with pytest.raises(UserError, match="cannot export this tokenizer to GGUF: its pre-tokenizer Metaspace") as error:
        export(tmp_path, lively_model(vocab_size=ROWS, **QWEN3), tokenizer)
    assert named in str(error.value) and "\n" not in str(error.value)
    assert list((tmp_path / "gguf-f32").iterdir()) == []  # refused before writing


def test_metaspace_first_is_refused_because_tokenizers_and_llama_cpp_differ_on_a_leading_space(family_dirs):
    """Why prepend_scheme "first" is refused: `tokenizers` puts no "▁" before text that begins with a space, where
    llama.cpp with add_space_prefix always puts one (" Hi" -> "▁▁Hi"), as the Prepend normalizer does: the slow test
    shows llama.cpp tokenizing Llama 2's form exactly on text that begins with spaces."""
    first = tokenizers.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    legacy = tokenizers.normalizers.Sequence(
        [tokenizers.normalizers.Prepend("▁"), tokenizers.normalizers.Replace(" ", "▁")]
    )
    assert [piece for piece, _ in first.pre_tokenize_str(" Hi")] == ["▁Hi"]
    assert legacy.normalize_str(" Hi") == "▁▁Hi"


def test_a_sentencepiece_bpe_whose_merges_miss_a_split_is_refused_in_one_line(tmp_path):
    # The trainer's merges only: llama.cpp, which merges any two tokens that make a token, would split otherwise.
    tokenizer = load_hf_tokenizer(write_sentencepiece(tmp_path / "sp"))
    with pytest.raises(UserError, match=r"make the token .* but are no merge of its BPE") as error:
        export(tmp_path, lively_model(vocab_size=ROWS, **QWEN3), tokenizer)
    assert "\n" not in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("family", [*FAMILIES, *SENTENCEPIECE])
def test_llama_cpp_tokenizes_as_the_hugging_face_tokenizer_and_decodes_our_tokens(
    tmp_path, request, family_dirs, family
):
    """llama.cpp reads the file's tokenizer to the `tokenizers` library's ids on varied text (with and without the
    special tokens a prompt opens with, and a rendered conversation's control tokens), decodes ids to its text, and
    greedy-decodes our model's tokens."""
    if not slow_requested(request.config):
        pytest.skip("slow: runs llama.cpp; ask with -m slow or GPTKIT_SLOW_TESTS=1")
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)"
    )
    tokenizer = load_hf_tokenizer(family_dirs[family])
    hf = hf_tokenizer_json(family_dirs[family])
    model = lively_model(vocab_size=ROWS, block_size=128, **QWEN3)
    llm = llama_cpp.Llama(model_path=str(export(tmp_path, model, tokenizer)), n_ctx=128, verbose=False)
    for text in VARIED:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, text
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == hf.encode(text).ids, text
        decoded = llm.detokenize(ids).decode()
        if family == "llama2":  # llama-cpp-python keeps the space SentencePiece puts before the text; HF strips it
            decoded = decoded.removeprefix(" ")
        assert decoded == hf.decode(ids, skip_special_tokens=False), text
    if tokenizer.chat is not None:
        rendered = tokenizer.chat.render_text(CONVERSATION, add_generation_prompt=True)
        prompt = hf.encode(rendered, add_special_tokens=False).ids
        assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == prompt
        assert any(token in prompt for token in tokenizer.chat.special_tokens.values())
        if (
            family not in SENTENCEPIECE
        ):  # a SentencePiece template's ids take no space before text after a control token
            assert prompt == tokenizer.chat.render_prompt(CONVERSATION, tokenizer)
    else:
        prompt = tokenizer.encode("It's 2024: hello, world")
    prompt = prompt[-60:]
    assert greedy_llama_cpp(llm, prompt, 20) == reference_greedy(model, prompt, 20)


@pytest.mark.slow
def test_llama_cpp_tokenizes_metaspace_first_otherwise_which_is_why_it_is_refused(
    tmp_path, request, family_dirs, monkeypatch
):
    """Were prepend_scheme "first" written with add_space_prefix (as llama.cpp's converter writes Llama 2), llama.cpp
    would tokenize text that begins with a space, or follows an added token, otherwise than `tokenizers`."""
    if not slow_requested(request.config):
        pytest.skip("slow: runs llama.cpp; ask with -m slow or GPTKIT_SLOW_TESTS=1")
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)"
    )
    directory = edited_tokenizer(tmp_path, family_dirs["metaspace"], metaspace(prepend_scheme="first"))
    monkeypatch.setattr(gguf_hf_tokenizer, "sentencepiece_space_prefix", lambda spec, tokens: True)
    path = export(tmp_path, lively_model(vocab_size=ROWS, **QWEN3), load_hf_tokenizer(directory))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
    hf = hf_tokenizer_json(directory)
    for text, same in [("Hello, world!", True), (" Hello, world!", False), ("a</s>b", False)]:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert (llm.tokenize(text.encode(), add_bos=False, special=True) == ids) is same, text
