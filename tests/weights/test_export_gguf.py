"""The GGUF export, read back with llama.cpp's own reader (gguf.GGUFReader); and, on demand (-m slow or
GPTKIT_SLOW_TESTS=1), run in llama.cpp itself through llama-cpp-python."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.data import bpe
from gptkit.data import tokenizer as tok
from gptkit.data.chat import END_OF_TURN
from gptkit.weights.export_gguf import export_gguf, gguf_name
from gptkit.weights.export_hf import export_hf
from helpers import lively_model

gguf = pytest.importorskip("gguf")

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]


def export(tmp_path: Path, model, tokenizer, outtype: str = "f32") -> Path:
    directory = tmp_path / f"gguf-{outtype}"
    directory.mkdir(exist_ok=True)
    files = export_gguf(model, tokenizer, directory, outtype, "tiny")
    assert files == [f"tiny-{outtype}.gguf", "Modelfile"]
    return directory / files[0]


def field(reader, key: str):
    """A metadata value as Python data (strings decoded, arrays as lists)."""
    value = reader.fields[key]
    if value.types[0] == gguf.GGUFValueType.ARRAY:
        return [value.contents(i) for i in range(len(value.data))]
    return value.contents()


def tensors_of(reader) -> dict[str, np.ndarray]:
    """Each tensor dequantized to float32 in numpy's (rows, columns) order, which is nn.Linear's (out, in)."""
    return {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(list(reversed(t.shape.tolist())))
        for t in reader.tensors
    }


def tiny_bpe(*merged: bytes) -> tok.BpeTokenizer:
    """A byte-level BPE with GPT-4's split: the 256 bytes, the `merged` tokens, then <|endoftext|>."""
    ranks = {bytes([b]): b for b in range(256)} | {token: 256 + i for i, token in enumerate(merged)}
    record = bpe.make_record("t", bpe.GPT4_PATTERN, {tok.END_OF_TEXT: len(ranks)}, bpe.ranks_to_text(ranks))
    return tok.BpeTokenizer(record)


def chat_gpt2() -> tok.ChatTokenizer:
    return tok.ChatTokenizer.extending(tok.TiktokenTokenizer("gpt2"))


@pytest.fixture(scope="module")
def gpt2_model():
    """A GPT-2-vocabulary chat model (50304 rows: 50261 tokens, padded) with 64-wide rows for q8_0's blocks."""
    return lively_model(vocab_size=50304, n_embd=64, n_head=2, tie_embeddings=False)


def test_f32_tensors_read_back_equal_ours(tmp_path):
    model = lively_model(vocab_size=320, bias=False, pos_encoding="sinusoidal", tie_embeddings=False)
    reader = gguf.GGUFReader(export(tmp_path, model, tiny_bpe()))
    read = tensors_of(reader)
    state = model.state_dict()
    assert read["position_embd.weight"].shape == (16, 32)
    assert np.array_equal(read["position_embd.weight"], model.pos_table.numpy())  # the fixed table, as learned
    assert np.all(read["blk.0.attn_qkv.bias"] == 0) and np.all(read["output_norm.bias"] == 0)
    for key, value in state.items():
        assert np.array_equal(read[gguf_name(key)], value.numpy()), key
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}


@pytest.mark.heavy
def test_f16_and_q8_0_tensors_are_within_their_formats_error(tmp_path, gpt2_model):
    state = {gguf_name(k): v.numpy() for k, v in gpt2_model.state_dict().items()}
    f16 = gguf.GGUFReader(export(tmp_path, gpt2_model, chat_gpt2(), "f16"))
    for name, value in tensors_of(f16).items():
        expected = state[name] if value.ndim == 1 or name == "position_embd.weight" else state[name].astype(np.float16)
        assert np.array_equal(value, expected.astype(np.float32)), name
    q8 = gguf.GGUFReader(export(tmp_path, gpt2_model, chat_gpt2(), "q8_0"))
    types = {t.name: t.tensor_type for t in q8.tensors}
    assert types["blk.0.ffn_down.weight"] == types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["position_embd.weight"] == types["blk.0.ffn_up.bias"] == gguf.GGMLQuantizationType.F32
    for name, value in tensors_of(q8).items():
        if types[name] != gguf.GGMLQuantizationType.Q8_0:
            assert np.array_equal(value, state[name]), name
            continue
        # q8_0: blocks of 32 values share one scale, amax / 127, so each value is off by at most half a step
        # (plus the scale's own f16 rounding, 127 steps of 2^-11 relative).
        blocks, original = value.reshape(-1, 32), state[name].reshape(-1, 32)
        step = np.abs(original).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(blocks - original) <= step * (0.5 + 127 * 2**-11) + 1e-12), name
        assert np.abs(blocks - original).max() > 0  # quantized, not stored exactly


@pytest.mark.heavy
def test_metadata_holds_the_architecture_tokenizer_and_chat_template(tmp_path, gpt2_model):
    tokenizer = chat_gpt2()
    reader = gguf.GGUFReader(export(tmp_path, gpt2_model, tokenizer, "f16"))
    config = gpt2_model.config
    assert field(reader, "general.architecture") == "gpt2"
    assert field(reader, "general.name") == "tiny"
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    assert field(reader, "gpt2.context_length") == config.block_size
    assert field(reader, "gpt2.embedding_length") == config.n_embd
    assert field(reader, "gpt2.feed_forward_length") == 4 * config.n_embd
    assert field(reader, "gpt2.block_count") == config.n_layer
    assert field(reader, "gpt2.attention.head_count") == config.n_head
    assert field(reader, "gpt2.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 50304  # one per row of the model: padded with unused tokens
    assert tokens[0] == "!" and tokens[220] == "\u0120" and tokens[995] == "\u0120world"  # GPT-2's byte-level text
    assert tokens[50256] == "<|endoftext|>" and tokens[50257:50261] == [
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        END_OF_TURN,
    ]
    assert tokens[50261] == "[PAD50261]"
    assert (
        types[50256:50262] == [gguf.TokenType.CONTROL] * 5 + [gguf.TokenType.UNUSED]
        and types[995] == gguf.TokenType.NORMAL
    )
    merges = field(reader, "tokenizer.ggml.merges")
    assert merges[0] == "\u0120 t" and len(merges) >= 50000  # GPT-2's first merge rule, and all of them
    assert field(reader, "tokenizer.ggml.bos_token_id") == field(reader, "tokenizer.ggml.eos_token_id") == 50256
    assert field(reader, "tokenizer.ggml.eot_token_id") == 50260
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, "tokenizer.chat_template").startswith("{%- set markers")
    names = {t.name for t in reader.tensors}
    assert "output.weight" in names and len(names) == 4 + 1 + 12 * config.n_layer  # untied: the head is stored


@pytest.mark.heavy
def test_the_chat_template_in_the_metadata_renders_our_ids(tmp_path, gpt2_model):
    transformers = pytest.importorskip("transformers")
    tokenizer = chat_gpt2()
    reader = gguf.GGUFReader(export(tmp_path, gpt2_model, tokenizer))
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    export_hf(gpt2_model, tokenizer, hf_dir)
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = hf.apply_chat_template(
        CONVERSATION, chat_template=field(reader, "tokenizer.chat_template"), tokenize=False, add_generation_prompt=True
    )
    assert hf.encode(text) == tokenizer.chat.render_prompt(CONVERSATION, tokenizer)
    modelfile = (tmp_path / "gguf-f32" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./tiny-f32.gguf\n") and 'PARAMETER stop "<|end|>"' in modelfile


def test_a_trained_bpe_uses_llama_cpps_gpt4_style_pre_tokenizer(tmp_path):
    model = lively_model(vocab_size=260, tie_embeddings=True)
    reader = gguf.GGUFReader(export(tmp_path, model, tiny_bpe(b"ab", b"abc")))
    assert field(reader, "tokenizer.ggml.pre") == "llama-bpe"
    assert field(reader, "tokenizer.ggml.merges") == ["a b", "ab c"]
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied: llama.cpp reuses token_embd


@pytest.mark.parametrize(
    ("model_settings", "tokenizer", "named"),
    [
        ({}, tok.CharTokenizer("abc", eot=True), "character vocabulary"),
        ({"activation": "gelu"}, None, "activation=gelu (exact)"),
        ({"pos_encoding": "rope"}, None, "pos_encoding=rope"),
    ],
)
def test_what_gguf_cannot_express_is_refused(tmp_path, model_settings, tokenizer, named):
    tokenizer = tokenizer or tiny_bpe()
    with pytest.raises(UserError, match=named.replace("(", r"\(").replace(")", r"\)")):
        export(tmp_path, lively_model(vocab_size=300, **model_settings), tokenizer)


def slow_requested(config) -> bool:
    return "slow" in (config.getoption("-m") or "") or os.environ.get("GPTKIT_SLOW_TESTS") == "1"


@pytest.mark.slow
def test_llama_cpp_runs_the_export_to_our_greedy_tokens(tmp_path, request, gpt2_model):
    """llama.cpp itself (llama-cpp-python) tokenizes as we do and greedy-decodes our tokens from the f32 file."""
    if not slow_requested(request.config):
        pytest.skip("slow: runs llama.cpp; ask with -m slow or GPTKIT_SLOW_TESTS=1")
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)"
    )
    tokenizer = chat_gpt2()
    model = lively_model(vocab_size=50304, n_embd=64, n_head=2, block_size=64, tie_embeddings=False)
    llm = llama_cpp.Llama(model_path=str(export(tmp_path, model, tokenizer)), n_ctx=64, verbose=False, seed=0)
    text = "Hello world, it's 2024!\n\n  Grüße   ok."
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(text)
    prompt = tokenizer.chat.render_prompt(CONVERSATION, tokenizer)
    rendered = "<|endoftext|><|system|>Be brief.<|end|><|user|>Hello, who are you?<|end|><|assistant|>"
    assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == prompt
    ours = []
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
            ours.append(ids[-1])
    theirs = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        theirs.append(token)
        if len(theirs) == len(ours):
            break
    assert theirs == ours


@pytest.mark.slow
def test_llama_cpp_tokenizes_a_trained_bpe_as_we_do(tmp_path, request):
    """llama.cpp's "llama-bpe" pre-tokenizer splits held-out text as our GPT-4-style pattern does."""
    if not slow_requested(request.config):
        pytest.skip("slow: runs llama.cpp; ask with -m slow or GPTKIT_SLOW_TESTS=1")
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)"
    )
    from gptkit.data.prepare import discover
    from gptkit.data.prepare.settings import PrepareSettings
    from gptkit.data.prepare.tokenizer_training import TrainingJob, train_bpe
    from helpers import stdlib_sources

    found = discover.find_inputs([str(path) for path in stdlib_sources(max_bytes=150_000)])
    job = TrainingJob(found.files, PrepareSettings(chunk_bytes=1 << 16), 600)
    ranks = train_bpe(job)[0].ranks
    tokenizer = tok.BpeTokenizer(
        bpe.make_record("t", job.pattern, {tok.END_OF_TEXT: len(ranks)}, bpe.ranks_to_text(ranks))
    )
    model = lively_model(vocab_size=tok.padded_vocab_size(tokenizer.vocab_size), n_embd=64)
    llm = llama_cpp.Llama(model_path=str(export(tmp_path, model, tokenizer)), n_ctx=64, verbose=False)
    texts = [path.read_text(encoding="utf-8")[:20_000] for path in stdlib_sources(offset=1, max_bytes=60_000)]
    texts.append("Grüße, Привет мир, 你好世界 👨‍👩‍👧‍👦 \t \r\n x   y\n\n\n   return 12345678901 it's I'M")
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(text)
