"""The Hugging Face export, checked with transformers itself: AutoTokenizer encodes as our tokenizers do,
apply_chat_template gives our chat template's ids, AutoModelForCausalLM computes our logits and greedy tokens."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.data import bpe
from gptkit.data import tokenizer as tok
from gptkit.data.prepare import discover
from gptkit.data.prepare.settings import PrepareSettings
from gptkit.data.prepare.tokenizer_training import TrainingJob, train_bpe
from gptkit.model import GPT, GPTConfig
from gptkit.weights.export_hf import export_hf
from helpers import lively_model, sample_text, stdlib_sources

transformers = pytest.importorskip("transformers")

# Text none of the tokenizers was trained on: code, prose in several scripts, runs of spaces and newlines, emoji,
# contractions, digits, and the text of special tokens typed as plain text.
HELD_OUT = (
    "def main(argv):\n    return 0  # done\n\n\n\tx = [1, 2, 3]\r\n"
    "Grüße, Привет мир, 你好世界, مرحبا 👍🏽 🇫🇷 I'M it's we'll 12345678 ſ\u00a0\u2028 "
    "    trailing   \n\n  <|endoftext|> <|end|><|user|>"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?\n"},
        {"role": "assistant", "content": " Four."},
        {"role": "user", "content": "And  3+3?"},
    ],
]


@pytest.fixture(scope="module")
def trained_bpe() -> tok.BpeTokenizer:
    """A 600-token byte-level BPE trained here on standard-library sources (GPT-4's split pattern)."""
    found = discover.find_inputs([str(path) for path in stdlib_sources(max_bytes=150_000)])
    job = TrainingJob(files=found.files, read=PrepareSettings(chunk_bytes=1 << 16), vocab_size=600)
    result, _ = train_bpe(job)
    special = {tok.END_OF_TEXT: len(result.ranks)}
    return tok.BpeTokenizer(bpe.make_record("stdlib", job.pattern, special, bpe.ranks_to_text(result.ranks)))


def held_out_texts() -> list[str]:
    texts = [path.read_text(encoding="utf-8")[:20_000] for path in stdlib_sources(offset=1, max_bytes=60_000)]
    return [HELD_OUT, *texts]


def export(tmp_path: Path, model, tokenizer) -> Path:
    directory = tmp_path / "hf"
    directory.mkdir()
    export_hf(model, tokenizer, directory)
    return directory


def chat_ids(hf_tokenizer, messages, generation_prompt: bool) -> list[int]:
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


@pytest.mark.gpt2_bpe
@pytest.mark.parametrize("kind", ["gpt2", "trained"])
def test_auto_tokenizer_encodes_held_out_text_to_our_ids(tmp_path, kind, trained_bpe):
    ours = tok.TiktokenTokenizer("gpt2") if kind == "gpt2" else trained_bpe
    directory = export(tmp_path, lively_model(vocab_size=ours.vocab_size, tie_embeddings=True), ours)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    assert len(hf) == ours.vocab_size
    for text in held_out_texts():
        expected = ours.encode(text)  # special-token text stays ordinary text in ours; HF splits it out
        if "<|" in text:
            parts = text.split("<|endoftext|>")
            expected = [i for n, part in enumerate(parts) for i in ([ours.eot_token] if n else []) + ours.encode(part)]
        assert hf.encode(text, add_special_tokens=True) == expected
        assert hf.decode(expected) == text
    assert hf.eos_token == hf.bos_token == "<|endoftext|>"


def test_a_character_vocabulary_encodes_to_our_ids_and_refuses_unknown_characters(tmp_path):
    text = sample_text(20_000)
    ours = tok.CharTokenizer.from_text(text, eot=True)
    directory = export(tmp_path, lively_model(vocab_size=ours.vocab_size, tie_embeddings=True), ours)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    held_out = sample_text(40_000)[20_000:]
    held_out = "".join(c for c in held_out if c in ours.chars)
    assert hf.encode(held_out) == ours.encode(held_out)
    assert hf.decode(ours.encode(held_out)) == held_out
    assert hf.encode("a<|endoftext|>b") == [*ours.encode("a"), ours.eot_token, *ours.encode("b")]
    with pytest.raises(Exception, match="UNK"):  # ours refuses unknown characters too (UserError)
        hf.encode("a\u4e16b")


@pytest.mark.gpt2_bpe
@pytest.mark.parametrize("kind", ["gpt2", "trained", "char"])
def test_apply_chat_template_gives_our_templates_ids(tmp_path, kind, trained_bpe):
    base = {
        "gpt2": lambda: tok.TiktokenTokenizer("gpt2"),
        "trained": lambda: trained_bpe,
        "char": lambda: tok.CharTokenizer.from_text(sample_text(20_000) + "?!+0123456789", eot=True),
    }[kind]()
    ours = tok.ChatTokenizer.extending(base)
    if kind == "gpt2":
        assert ours.chat.ids == [50257, 50258, 50259, 50260]
    directory = export(tmp_path, lively_model(vocab_size=tok.padded_vocab_size(ours.vocab_size)), ours)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    for messages in CONVERSATIONS:
        assert chat_ids(hf, messages, True) == ours.chat.render_prompt(messages, ours)
        if messages[-1]["role"] == "assistant":
            assert chat_ids(hf, messages, False) == ours.chat.render(messages, ours)[0].tolist()
    with pytest.raises(Exception, match="only the first message may be a system message"):
        chat_ids(hf, [CONVERSATIONS[0][0], {"role": "system", "content": "late"}], True)
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ours.chat.end_of_turn, ours.eot_token]
    assert hf.convert_tokens_to_ids("<|end|>") == ours.chat.end_of_turn


def greedy_ours(model, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    return ids


MODELS = {
    "tied, gelu_tanh, padded vocabulary": dict(tie_embeddings=True, vocab_size=64),
    "untied, exact gelu": dict(activation="gelu"),
    "no biases": dict(bias=False),
    "sinusoidal positions": dict(pos_encoding="sinusoidal"),
}


@pytest.mark.parametrize("settings", MODELS.values(), ids=MODELS.keys())
def test_auto_model_computes_our_logits_and_greedy_tokens(tmp_path, settings):
    model = lively_model(**{"vocab_size": 37, **settings})
    with torch.no_grad():  # every parameter random, so a tensor put in the wrong place shows
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    directory = export(tmp_path, model, tok.CharTokenizer([chr(97 + i) for i in range(26)], eot=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    config = json.loads((directory / "config.json").read_text())
    assert config["vocab_size"] == model.config.vocab_size  # the model's rows, padded beyond the tokenizer's 27
    assert config["activation_function"] == ("gelu" if model.config.activation == "gelu" else "gelu_new")
    prompt = [3, 1, 4, 1, 5]
    idx = torch.tensor([[*prompt, 9, 2, 6, 5, 3, 5]])
    with torch.no_grad():
        expected, _ = model(idx, idx)
        logits = hf(idx).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert generated[0].tolist() == greedy_ours(model, prompt, 10)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (dict(pos_encoding="rope"), "pos_encoding=rope"),
        (dict(activation="relu2"), "activation=relu2"),
        (dict(qk_norm=True), "qk_norm=True"),
    ],
)
def test_what_gpt2_cannot_express_is_refused_naming_the_setting(tmp_path, settings, named):
    with pytest.raises(UserError, match=named):
        export(tmp_path, lively_model(**settings), tok.CharTokenizer("abc"))
    assert os.listdir(tmp_path / "hf") == []


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
    with pytest.raises(UserError, match="27 tokens but the model only 20 rows"):
        export(tmp_path, lively_model(vocab_size=20), tok.CharTokenizer([chr(97 + i) for i in range(26)], eot=True))


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_a_hugging_face_tokenizer_s_own_bos_token_is_the_config_s(tmp_path, family):
    """config.json's bos_token_id is the token tokenizer_config.json names bos (Llama 3's <|begin_of_text|>), or
    null where it names none (Qwen2), as transformers reads the exported tokenizer; not the end-of-text token."""
    import transformers

    from gptkit.data.hf_tokenizer import load_hf_tokenizer
    from hf_tokenizer_dirs import write_family

    tokenizer = load_hf_tokenizer(write_family(tmp_path / "tokenizer", family))
    config = dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu", bias=False, mlp_hidden=64)
    model = GPT(GPTConfig(block_size=32, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=32, **config))
    destination = export(tmp_path, model, tokenizer)
    written = json.loads((destination / "config.json").read_text())
    assert written["bos_token_id"] == transformers.AutoTokenizer.from_pretrained(destination).bos_token_id
    assert (written["bos_token_id"] is None) == (family == "qwen2")
