"""The GGUF export, read back with llama.cpp's own reader (gguf.GGUFReader); and, on demand (-m slow or
GPTKIT_SLOW_TESTS=1), run in llama.cpp itself through llama-cpp-python."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from gptkit.core.errors import UserError
from gptkit.data import bpe
from gptkit.data import tokenizer as tok
from gptkit.data.chat import END_OF_TURN
from gptkit.data.gguf_tokenizer import load_gguf_tokenizer
from gptkit.data.hf_tokenizer import HFTokenizer, read_hf_record
from gptkit.weights.export_gguf import export_gguf, gguf_tensors
from gptkit.weights.export_hf import export_hf
from helpers import gpt2_chat_tokenizer, greedy_llama_cpp, lively_model, reference_greedy
from hf_tokenizer_dirs import VARIED

gguf = pytest.importorskip("gguf")

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]


def export(tmp_path: Path, model, tokenizer, outtype: str = "f32") -> Path:
    directory = tmp_path / f"gguf-{outtype}"
    directory.mkdir(parents=True, exist_ok=True)
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


# llama.cpp's tensor names (its llama-arch.cpp) -> ours, for block {i}.
GPT2_NAMES = {
    "token_embd.weight": "transformer.wte.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "transformer.h.{i}.ln_1.weight",
    "blk.{i}.attn_qkv.weight": "transformer.h.{i}.attn.c_attn.weight",
    "blk.{i}.attn_output.weight": "transformer.h.{i}.attn.c_proj.weight",
    "blk.{i}.ffn_norm.weight": "transformer.h.{i}.ln_2.weight",
    "blk.{i}.ffn_up.weight": "transformer.h.{i}.mlp.c_fc.weight",
    "blk.{i}.ffn_down.weight": "transformer.h.{i}.mlp.c_proj.weight",
}


def tiny_bpe(*merged: bytes) -> tok.BpeTokenizer:
    """A byte-level BPE with GPT-4's split: the 256 bytes, the `merged` tokens, then <|endoftext|>."""
    ranks = {bytes([b]): b for b in range(256)} | {token: 256 + i for i, token in enumerate(merged)}
    record = bpe.make_record("t", bpe.GPT4_PATTERN, {tok.END_OF_TEXT: len(ranks)}, bpe.ranks_to_text(ranks))
    return tok.BpeTokenizer(record)


@pytest.fixture(scope="module")
def gpt2_model():
    """A GPT-2-vocabulary chat model (50304 rows: 50261 tokens, padded) with 64-wide rows for q8_0's blocks."""
    return lively_model(vocab_size=50304, n_embd=64, n_head=2, tie_embeddings=False)


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory, gpt2_model):
    """gpt2_model with GPT-2's chat vocabulary in f16, and llama.cpp's reader of the file. Writing and reading 50,000
    tokens and merges takes seconds, so the tests of its metadata share the file."""
    path = export(tmp_path_factory.mktemp("gpt2"), gpt2_model, gpt2_chat_tokenizer(), "f16")
    return path, gguf.GGUFReader(path)


def test_f32_tensors_read_back_equal_ours(tmp_path):
    model = lively_model(vocab_size=320, bias=False, pos_encoding="sinusoidal", tie_embeddings=False)
    reader = gguf.GGUFReader(export(tmp_path, model, tiny_bpe()))
    read = tensors_of(reader)
    assert read["position_embd.weight"].shape == (16, 32)
    assert np.array_equal(read["position_embd.weight"], model.pos_table.numpy())  # the fixed table, as learned
    assert np.all(read["blk.0.attn_qkv.bias"] == 0) and np.all(read["output_norm.bias"] == 0)
    for key, value in GPT2_NAMES.items():
        ours = model.state_dict()[value.replace("{i}", "1")].numpy()
        assert np.array_equal(read[key.replace("{i}", "1")], ours), key
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}


@pytest.mark.heavy
def test_f16_and_q8_0_tensors_are_within_their_formats_error(tmp_path):
    # 64-wide rows for q8_0's blocks of 32; a small vocabulary, as the formats' error is what is tested
    model = lively_model(vocab_size=320, n_embd=64, n_head=2, tie_embeddings=False)
    state = {name: value.numpy() for name, value in gguf_tensors(model)[1].items()}
    f16 = gguf.GGUFReader(export(tmp_path, model, tiny_bpe(), "f16"))
    for name, value in tensors_of(f16).items():
        expected = state[name] if value.ndim == 1 or name == "position_embd.weight" else state[name].astype(np.float16)
        assert np.array_equal(value, expected.astype(np.float32)), name
    q8 = gguf.GGUFReader(export(tmp_path, model, tiny_bpe(), "q8_0"))
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


@pytest.mark.gpt2_bpe
@pytest.mark.heavy
def test_metadata_holds_the_architecture_tokenizer_and_chat_template(gpt2_file, gpt2_model):
    _, reader = gpt2_file
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


@pytest.mark.gpt2_bpe
@pytest.mark.heavy
def test_the_chat_template_in_the_metadata_renders_our_ids(tmp_path, gpt2_file, gpt2_model):
    transformers = pytest.importorskip("transformers")
    from gptkit.weights.export_hf import export_hf

    tokenizer = gpt2_chat_tokenizer()
    path, reader = gpt2_file
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    export_hf(gpt2_model, tokenizer, hf_dir)
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = hf.apply_chat_template(
        CONVERSATION, chat_template=field(reader, "tokenizer.chat_template"), tokenize=False, add_generation_prompt=True
    )
    assert hf.encode(text) == tokenizer.chat.render_prompt(CONVERSATION, tokenizer)
    modelfile = (path.parent / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./tiny-f16.gguf\n") and 'PARAMETER stop "<|end|>"' in modelfile


@pytest.mark.gpt2_bpe
@pytest.mark.heavy
def test_gpt2_s_chat_vocabulary_reads_back_with_tiktoken_s_ids_and_our_template(gpt2_file):
    """gptkit/data/gguf_tokenizer.py over the file's metadata (as gpt2_file's reader parsed it): GPT-2's 50,000 tokens
    and merges with the chat template's tokens encode as tiktoken does, and render our template's ids."""
    path, reader = gpt2_file
    tokenizer = gpt2_chat_tokenizer()
    ours = load_gguf_tokenizer(path, reader)
    for text in VARIED:
        assert ours.encode(text) == tokenizer.encode(text), text
    conversation = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    assert (
        ours.chat.render(conversation, ours)[0].tolist() == tokenizer.chat.render(conversation, tokenizer)[0].tolist()
    )


def test_a_trained_bpe_uses_llama_cpps_gpt4_style_pre_tokenizer(tmp_path):
    model = lively_model(vocab_size=260, tie_embeddings=True)
    reader = gguf.GGUFReader(export(tmp_path, model, tiny_bpe(b"ab", b"abc")))
    assert field(reader, "tokenizer.ggml.pre") == "llama-bpe"
    assert field(reader, "tokenizer.ggml.merges") == ["a b", "ab c"]
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied: llama.cpp reuses token_embd


# The Llama family as our settings describe it (see gptkit/weights/hf.py for the Hugging Face models they load).
LLAMA = dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu", bias=False, n_head=4, n_kv_head=2, mlp_hidden=96)
QWEN2 = {**LLAMA, "qkv_bias": True}
QWEN3 = {**LLAMA, "qk_norm": True, "qk_norm_weight": True, "head_dim": 16}
# The demo's model (config/train_shakespeare_char_cpu.py) moved to Qwen3's shape: norms without weights.
QWEN3_DEMO = {**LLAMA, "n_kv_head": 4, "qk_norm": True, "norm_weight": False, "tie_embeddings": True}


def rotate_halves(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Ours (and llama.cpp's NEOX mode): pairs (x[i], x[i + d/2]) turn by angles[i]."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * np.cos(angles) - b * np.sin(angles), a * np.sin(angles) + b * np.cos(angles)], -1)


def rotate_adjacent(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """llama.cpp's Llama (its NORM mode): pairs (x[2i], x[2i + 1]) turn by angles[i]."""
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * np.cos(angles) - b * np.sin(angles), a * np.sin(angles) + b * np.cos(angles)
    return out


def test_llama_q_and_k_give_our_attention_scores_under_llama_cpps_rotation(tmp_path):
    model = lively_model(vocab_size=300, **LLAMA)
    reader = gguf.GGUFReader(export(tmp_path, model, tiny_bpe()))
    assert field(reader, "general.architecture") == "llama"
    read = tensors_of(reader)
    config, state = model.config, {k: v.double().numpy() for k, v in model.state_dict().items()}
    q_ours, k_ours, _ = np.split(state["transformer.h.1.attn.c_attn.weight"], [32, 48])
    x = np.random.default_rng(0).standard_normal((5, 32))  # five positions' inputs
    angles = np.arange(5)[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    for head in range(4):  # query head h reads key head h // 2
        rows, kv_rows = slice(8 * head, 8 * head + 8), slice(8 * (head // 2), 8 * (head // 2) + 8)
        ours = rotate_halves(x @ q_ours[rows].T, angles) @ rotate_halves(x @ k_ours[kv_rows].T, angles).T
        q_theirs = x @ read["blk.1.attn_q.weight"][rows].astype(np.float64).T
        k_theirs = x @ read["blk.1.attn_k.weight"][kv_rows].astype(np.float64).T
        theirs = rotate_adjacent(q_theirs, angles) @ rotate_adjacent(k_theirs, angles).T
        np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)
    assert field(reader, "llama.attention.head_count") == 4 and field(reader, "llama.attention.head_count_kv") == 2
    assert field(reader, "llama.feed_forward_length") == 96 and field(reader, "llama.rope.dimension_count") == 8
    assert field(reader, "llama.rope.freq_base") == pytest.approx(config.rope_base)
    assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(config.norm_eps)


@pytest.mark.parametrize("settings", [QWEN2, QWEN3, QWEN3_DEMO], ids=["qwen2", "qwen3", "qwen3-demo"])
def test_qwen_tensors_are_our_weights_split_under_llama_cpps_names(tmp_path, settings):
    model = lively_model(vocab_size=300, **settings)
    reader = gguf.GGUFReader(export(tmp_path, model, tiny_bpe()))
    architecture = "qwen3" if settings.get("qk_norm") else "qwen2"
    assert field(reader, "general.architecture") == architecture
    config, state = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    q_width, kv_width = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    expected = {"token_embd.weight": state["transformer.wte.weight"]}
    for i in range(2):
        h = f"transformer.h.{i}."
        q, k, v = np.split(state[h + "attn.c_attn.weight"], [q_width, q_width + kv_width])
        gate, up = np.split(state[h + "mlp.c_fc.weight"], 2)
        expected |= {
            f"blk.{i}.attn_q.weight": q,
            f"blk.{i}.attn_k.weight": k,
            f"blk.{i}.attn_v.weight": v,
            f"blk.{i}.attn_output.weight": state[h + "attn.c_proj.weight"],
            f"blk.{i}.ffn_gate.weight": gate,
            f"blk.{i}.ffn_up.weight": up,
            f"blk.{i}.ffn_down.weight": state[h + "mlp.c_proj.weight"],
        }
        for ours, theirs in (("ln_1", "attn_norm"), ("ln_2", "ffn_norm")):
            expected[f"blk.{i}.{theirs}.weight"] = state.get(h + ours + ".weight", np.ones(32, np.float32))
        if architecture == "qwen2":
            b_q, b_k, b_v = np.split(state[h + "attn.c_attn.bias"], [q_width, q_width + kv_width])
            expected |= {f"blk.{i}.attn_q.bias": b_q, f"blk.{i}.attn_k.bias": b_k, f"blk.{i}.attn_v.bias": b_v}
        else:
            for part in ("q", "k"):
                weight = state.get(f"{h}attn.{part}_norm.weight", np.ones(config.head_dim, np.float32))
                expected[f"blk.{i}.attn_{part}_norm.weight"] = weight
    expected["output_norm.weight"] = state.get("transformer.ln_f.weight", np.ones(32, np.float32))
    if not config.tie_embeddings:
        expected["output.weight"] = state["lm_head.weight"]
    read = tensors_of(reader)
    assert sorted(read) == sorted(expected)
    for name, value in expected.items():
        assert np.array_equal(read[name], value), name
    assert field(reader, f"{architecture}.attention.key_length") == config.head_dim
    assert field(reader, f"{architecture}.attention.head_count_kv") == config.n_kv_head


def test_a_table_of_one_byte_characters_is_a_byte_level_bpe_without_merges(tmp_path):
    tokenizer = tok.CharTokenizer("\n !abcz", eot=True)
    model = lively_model(vocab_size=12, **QWEN3_DEMO)
    reader = gguf.GGUFReader(export(tmp_path, model, tokenizer))
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, "\n" (10) is U+010A, " " (32) U+0120
    padding = [f"[PAD{i}]" for i in range(8, 12)]
    expected = ["\u010a", "\u0120", "!", "a", "b", "c", "z", "<|endoftext|>", *padding]
    assert field(reader, "tokenizer.ggml.tokens") == expected
    assert field(reader, "tokenizer.ggml.token_type")[6:9] == [
        gguf.TokenType.NORMAL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.UNUSED,
    ]
    (merge,) = field(reader, "tokenizer.ggml.merges")  # one rule whose pieces are no token: it never applies
    assert all(piece not in field(reader, "tokenizer.ggml.tokens") for piece in merge.split(" "))


def test_a_character_models_hugging_face_export_writes_the_same_gguf_tokenizer(tmp_path):
    """The character table from its tokenizer.json (export.py --init_from=HF_DIR --format=gguf) is written as from
    the run itself: the same tokens, types and merges, so llama.cpp looks up the same ids."""
    tokenizer = tok.CharTokenizer("\n !abcz", eot=True)
    model = lively_model(vocab_size=12, **QWEN3_DEMO)
    direct = gguf.GGUFReader(export(tmp_path / "direct", model, tokenizer))
    export_hf(model, tokenizer, tmp_path / "hf")
    from_hf = HFTokenizer(read_hf_record(tmp_path / "hf"), where="hf")
    assert from_hf.encode("abc z!\n") == tokenizer.encode("abc z!\n")
    through_hf = gguf.GGUFReader(export(tmp_path / "through_hf", model, from_hf))
    for key in ("tokens", "token_type", "merges", "model", "pre", "eos_token_id"):
        assert field(through_hf, f"tokenizer.ggml.{key}") == field(direct, f"tokenizer.ggml.{key}"), key
    wide = tmp_path / "wide"
    export_hf(model, tok.CharTokenizer("abcé", eot=True), wide)
    with pytest.raises(UserError, match="'é' is more than one byte in UTF-8"):
        export(tmp_path / "refused", model, HFTokenizer(read_hf_record(wide), where="wide"))


@pytest.mark.parametrize(
    ("model_settings", "tokenizer", "named"),
    [
        ({}, tok.CharTokenizer("abcé", eot=True), "'é' is more than one byte"),
        ({"activation": "gelu"}, None, "activation=gelu (exact)"),
        ({"pos_encoding": "rope", "qk_norm": True}, None, "pos_encoding=rope with norm=layernorm"),  # the old demo
        ({**LLAMA, "embed_norm": True}, None, "embed_norm=True"),
        ({**LLAMA, "logit_softcap": 15.0}, None, "logit_softcap=15.0"),
        ({"norm": "rmsnorm"}, None, "norm=rmsnorm with pos_encoding=learned"),
        ({**QWEN3, "bias": True}, None, "bias=True with qk_norm=True"),
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
    tokenizer = gpt2_chat_tokenizer()
    model = lively_model(vocab_size=50304, n_embd=64, n_head=2, block_size=64, tie_embeddings=False)
    llm = llama_cpp.Llama(model_path=str(export(tmp_path, model, tokenizer)), n_ctx=64, verbose=False, seed=0)
    text = "Hello world, it's 2024!\n\n  Grüße   ok."
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(text)
    prompt = tokenizer.chat.render_prompt(CONVERSATION, tokenizer)
    rendered = "<|endoftext|><|system|>Be brief.<|end|><|user|>Hello, who are you?<|end|><|assistant|>"
    assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == prompt
    assert greedy_llama_cpp(llm, prompt, 12) == reference_greedy(model, prompt, 12)


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
    job = TrainingJob(files=found.files, read=PrepareSettings(chunk_bytes=1 << 16), vocab_size=600)
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [LLAMA, {**LLAMA, "bias": True}, QWEN2, QWEN3, QWEN3_DEMO],
    ids=["llama", "llama-biases", "qwen2", "qwen3", "qwen3-demo"],
)
def test_llama_cpp_greedy_decodes_our_tokens_in_every_architecture(tmp_path, request, settings):
    """llama.cpp runs the f32 file of each Llama-family shape to the greedy tokens our model picks."""
    if not slow_requested(request.config):
        pytest.skip("slow: runs llama.cpp; ask with -m slow or GPTKIT_SLOW_TESTS=1")
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)"
    )
    model = lively_model(vocab_size=300, block_size=64, **settings)
    llm = llama_cpp.Llama(model_path=str(export(tmp_path, model, tiny_bpe())), n_ctx=64, verbose=False)
    prompt = [5, 77, 200, 31, 9, 144]
    assert greedy_llama_cpp(llm, prompt, 20) == reference_greedy(model, prompt, 20)


@pytest.mark.slow
def test_llama_cpp_runs_the_demos_character_model_to_our_tokens_and_text(tmp_path, request):
    """The demo's shape (Qwen3 with weightless norms, tied) on Shakespeare's character table: llama.cpp tokenizes
    text as our table does, greedy-decodes our tokens and turns them back into our text."""
    if not slow_requested(request.config):
        pytest.skip("slow: runs llama.cpp; ask with -m slow or GPTKIT_SLOW_TESTS=1")
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)"
    )
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak! 3 &c; $-'?"
    tokenizer = tok.CharTokenizer("".join(sorted(set(text))), eot=False)
    model = lively_model(vocab_size=tokenizer.vocab_size, block_size=128, **QWEN3_DEMO)
    llm = llama_cpp.Llama(model_path=str(export(tmp_path, model, tokenizer)), n_ctx=128, verbose=False)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(text)
    prompt = tokenizer.encode("First Citizen:\n")
    ours = reference_greedy(model, prompt, 30)
    assert greedy_llama_cpp(llm, prompt, 30) == ours
    assert llm.detokenize(ours).decode() == tokenizer.decode(ours)
