"""GGUF in: files our exporter writes (gptkit.weights.export_gguf) from tiny random models of each architecture, read
back as our GPT and tokenizer and checked against transformers reading the same file (AutoModelForCausalLM and
AutoTokenizer with gguf_file=), the source model and tokenizer, and a float64 dequantizer written here from the
block formats' definitions; the scripts taking --init_from=FILE.gguf; and the files refused in one line."""

from __future__ import annotations

import hashlib
import io
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

import export
import sample
import train
from gptkit.core.errors import UserError
from gptkit.data.gguf_tokenizer import load_gguf_tokenizer, open_gguf
from gptkit.data.hf_tokenizer import load_hf_tokenizer
from gptkit.data.meta import read_meta
from gptkit.data.tokenizer import CharTokenizer, make_tokenizer
from gptkit.model import GPTConfig, scaled_frequencies
from gptkit.weights import checkpoint, export_gguf, gguf_hf_tokenizer, load
from gptkit.weights.checkpoint import load_checkpoint
from gptkit.weights.gguf_read import q8_0_values, read_tensors
from gptkit.weights.hf import gguf_tag
from gptkit.weights.quantization import apply_quantization
from gptkit.weights.sources import base_reference, check_data_tokenizer, named_tokenizer
from helpers import (
    assert_one_line_error,
    assert_one_line_message,
    assert_script_error,
    clean_env,
    cli_args,
    lively_model,
    run_in_process,
    run_main,
    run_script,
    serving_hub,
)
from hf_tokenizer_dirs import FAMILIES, VARIED, write_family, write_sentencepiece
from prepare_data import chat as chat_script
from prepare_data import corpus, preferences

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from test_export_gguf import tiny_bpe  # noqa: E402

T = gguf.GGMLQuantizationType
LLAMA_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
ROWS = 640  # embedding rows: more than the tokenizers' ~600 tokens, so the files pad
ROPE = dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu", bias=False, n_head=4, n_kv_head=2)
SHAPES = {  # our settings written as each of llama.cpp's architectures
    "gpt2": dict(pos_encoding="learned"),
    "llama-gqa-tied": dict(ROPE, tie_embeddings=True),
    "llama-untied": dict(ROPE),
    "qwen2": dict(ROPE, qkv_bias=True, tie_embeddings=True),
    "qwen3": dict(ROPE, qk_norm=True, head_dim=32),  # 4 heads of 32 in a 64-wide model
}
# transformers' GGUF loader reads neither GPT-2's context length (n_positions) nor Qwen3's key_length (head_dim).
TRANSFORMERS_FIXES = {"gpt2": {"n_positions": 32}, "qwen3": {"head_dim": 32}}


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    """A Qwen2-style byte-level BPE with ChatML (about 600 tokens)."""
    return load_hf_tokenizer(write_family(tmp_path_factory.mktemp("tokenizer") / "qwen2", "qwen2"))


def tiny(shape: str, **overrides) -> torch.nn.Module:
    return lively_model(**{"vocab_size": ROWS, "n_embd": 64, "block_size": 32, **SHAPES[shape], **overrides})


def export_file(directory: Path, model, tokenizer, outtype: str = "f32") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory / export_gguf.export_gguf(model, tokenizer, directory, outtype, "tiny")[0]


def transformers_model(path: Path, shape: str):
    fixes = TRANSFORMERS_FIXES.get(shape.split("-")[0], {})
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **fixes).eval()


def logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx, targets=torch.zeros_like(idx))[0]


IDX = torch.randint(0, ROWS, (2, 20), generator=torch.Generator().manual_seed(1))

# ------------------------------------------------------------------------------------------------ the model


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_architecture_reads_with_transformers_logits(tmp_path, qwen_tokenizer, shape, outtype):
    source = tiny(shape)
    path = export_file(tmp_path, source, qwen_tokenizer, outtype)
    ours = load(str(path), tokenizer=False).model
    torch.testing.assert_close(logits(ours, IDX), transformers_model(path, shape)(IDX).logits, rtol=0, atol=1e-4)
    assert ours.config.tie_embeddings == source.config.tie_embeddings
    if outtype == "f32":  # nothing lost: the source's own logits
        torch.testing.assert_close(logits(ours, IDX), logits(source, IDX), rtol=0, atol=1e-5)


def test_a_head_stored_as_a_copy_of_the_embedding_is_tied(tmp_path, qwen_tokenizer):
    """Older llama.cpp GPT-2 files hold output.weight as a copy of token_embd.weight: one tied matrix here."""
    source = tiny("gpt2")
    with torch.no_grad():
        source.lm_head.weight.copy_(source.transformer.wte.weight)
    ours = load(str(export_file(tmp_path, source, qwen_tokenizer)), tokenizer=False).model
    assert ours.config.tie_embeddings and not source.config.tie_embeddings
    torch.testing.assert_close(logits(ours, IDX), logits(source, IDX), rtol=0, atol=1e-5)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    ("base", "original", "between"),
    [(10000.0, 256, 2), (500000.0, 8, 1), (500000.0, 4, 0)],  # frequencies between the kept and the divided ones
)
def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path, qwen_tokenizer, base, original, between):
    """llama.cpp keeps Llama 3's scaling only as a factor per frequency (rope_freqs); read back, the factors and so
    the logits are the source's, and with two frequencies between the ends its parameters are too (with none, every
    frequency is divided: linear scaling). transformers' loader ignores rope_freqs: the source model is the
    reference."""
    scaling = {**LLAMA3, "original_max_position_embeddings": original}
    source = tiny("llama-untied", rope_base=base, rope_scaling=scaling, n_head=2, n_kv_head=2)
    ours = load(str(export_file(tmp_path, source, qwen_tokenizer)), tokenizer=False).model
    frequency = base ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    smooth = (original * frequency / (2 * torch.pi) - 1) / 3
    assert int(((smooth > 0) & (smooth < 1)).sum()) == between
    read = ours.config.rope_scaling
    torch.testing.assert_close(scaled_frequencies(frequency, read), scaled_frequencies(frequency, scaling))
    torch.testing.assert_close(logits(ours, IDX), logits(source, IDX), rtol=0, atol=1e-5)
    if between >= 2:
        assert read == scaling
    if between == 0:
        assert read == {"rope_type": "linear", "factor": 8.0}


# ------------------------------------------------------------------------------------------------ tensor types


def f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float64)


def k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's eight 6-bit scales and mins, packed in 12 bytes."""
    s = packed.astype(np.int64)
    low = [(s[j] & 63, s[j + 4] & 63) for j in range(4)]
    high = [((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) for j in range(4, 8)]
    scales, mins = zip(*(low + high))
    return np.array(scales), np.array(mins)


def block_values(qtype, b: np.ndarray) -> np.ndarray:
    """One block's values in float64, from the format's definition (ggml's block_* structs)."""
    if qtype == T.Q8_0:  # d, 32 int8
        return f16(b[0:2])[0] * b[2:34].view(np.int8)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):  # d[, m][, 32 high bits], 16 bytes of two 4-bit values
        offset = 2 if qtype in (T.Q4_0, T.Q5_0) else 4
        high = np.zeros(32, np.int64)
        if qtype in (T.Q5_0, T.Q5_1):
            bits = int(b[offset : offset + 4].view(np.uint32)[0])
            high, offset = np.array([(bits >> j) & 1 for j in range(32)]) << 4, offset + 4
        nibbles = b[offset : offset + 16].astype(np.int64)
        q = (np.concatenate([nibbles & 15, nibbles >> 4]) | high).astype(np.float64)
        centred = {T.Q4_0: 8, T.Q5_0: 16}
        if qtype in centred:
            return f16(b[0:2])[0] * (q - centred[qtype])
        return f16(b[0:2])[0] * q + f16(b[2:4])[0]
    if qtype in (T.Q4_K, T.Q5_K):  # d, dmin, 12 bytes of scales, [32 bytes of high bits,] 128 bytes of nibbles
        d, dmin = f16(b[0:2])[0], f16(b[2:4])[0]
        scales, mins = k_scales(b[4:16])
        high = b[16:48].astype(np.int64) if qtype == T.Q5_K else np.zeros(32, np.int64)
        nibbles = b[48:176].astype(np.int64) if qtype == T.Q5_K else b[16:144].astype(np.int64)
        values = []
        for j in range(4):  # 64 values: 32 low nibbles, then 32 high ones, each half with its scale and min
            part = nibbles[32 * j : 32 * j + 32]
            for half, q in enumerate((part & 15, part >> 4)):
                q = q | (((high >> (2 * j + half)) & 1) << 4)
                values.append(d * scales[2 * j + half] * q - dmin * mins[2 * j + half])
        return np.concatenate(values)
    # Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d
    low, high = b[0:128].astype(np.int64), b[128:192].astype(np.int64)
    scales, d = b[192:208].view(np.int8).astype(np.int64), f16(b[208:210])[0]
    values = np.zeros(256)
    for n in range(2):
        ql, qh, sc = low[64 * n : 64 * n + 64], high[32 * n : 32 * n + 32], scales[8 * n : 8 * n + 8]
        for i in range(32):
            quarters = [
                (ql[i] & 15) | ((qh[i] & 3) << 4),
                (ql[i + 32] & 15) | (((qh[i] >> 2) & 3) << 4),
                (ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4),
                (ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4),
            ]
            for k, q in enumerate(quarters):
                values[128 * n + 32 * k + i] = d * sc[i // 16 + 2 * k] * (q - 32)
    return values


def dequantized64(raw: np.ndarray, qtype, shape: tuple[int, int]) -> np.ndarray:
    if qtype == T.F16:
        return f16(raw).reshape(shape)
    if qtype == T.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(shape)
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    return np.concatenate([block_values(qtype, block) for block in raw.reshape(-1, size)]).reshape(shape)


# The types whose blocks are built by hand (the gguf package writes none of them): each one's f16 scale fields
# (offset in the block, size of the scale; ggml-common.h's block_*), set so that the weights stay below about a
# tenth. IQ1_M has none: its scale is the top 4 bits of each of the 4 16-bit words at byte 48 (iq1m_scale_fields).
K_SCALES = {T.Q4_K: ((0, 1e-4), (2, 1e-4)), T.Q5_K: ((0, 5e-5), (2, 5e-5)), T.Q6_K: ((208, 2e-5),)}
OTHER_SCALES = {
    T.Q2_K: ((80, 1e-3), (82, 1e-3)),
    T.Q3_K: ((108, 1e-4),),
    T.IQ1_S: ((0, 1e-3),),
    T.IQ1_M: (),
    T.IQ2_XXS: ((0, 1e-4),),
    T.IQ2_XS: ((0, 1e-4),),
    T.IQ2_S: ((0, 1e-4),),
    T.IQ3_XXS: ((0, 1e-4),),
    T.IQ3_S: ((0, 1e-4),),
    T.IQ4_NL: ((0, 1e-4),),
    T.IQ4_XS: ((0, 1e-5),),
    T.TQ1_0: ((52, 2e-2),),
    T.TQ2_0: ((64, 2e-2),),
}
HAND_SCALES = K_SCALES | OTHER_SCALES
QUANTIZED = {
    "token_embd.weight": T.F16,
    "output.weight": T.BF16,
    "blk.0.attn_q.weight": T.Q4_0,
    "blk.0.attn_k.weight": T.Q4_1,
    "blk.0.attn_v.weight": T.Q5_0,
    "blk.0.attn_output.weight": T.Q5_1,
    "blk.0.ffn_gate.weight": T.Q8_0,
    "blk.0.ffn_down.weight": T.Q4_K,
    "blk.1.ffn_down.weight": T.Q5_K,
    "blk.2.ffn_down.weight": T.Q6_K,
}


def iq1m_scale_fields(raw: np.ndarray, scales: np.ndarray) -> None:
    """IQ1_M blocks' float16 scales `scales` written as the format keeps them: nibble k of the scale's 16 bits in
    the top 4 bits of the block's 16-bit word k at byte 48."""
    bits = scales.astype(np.float16).view(np.uint16)
    words = raw[..., 48:56].copy().view(np.uint16)
    for k in range(4):
        words[..., k] = (words[..., k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
    raw[..., 48:56] = words.view(np.uint8)


def hand_blocks(qtype, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Blocks of `qtype` (one of HAND_SCALES) built byte by byte: random codes and sub-scales, and small positive
    f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    if qtype == T.IQ1_M:
        iq1m_scale_fields(raw, rng.uniform(0.5, 1.0, size=raw.shape[:2]) * 1e-3)
    for offset, scale in HAND_SCALES[qtype]:
        values = rng.uniform(0.5, 1.0, size=raw.shape[:2]) * scale
        raw[:, :, offset : offset + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


def encode_as(types: dict, written: dict, name: str, tensor: torch.Tensor, outtype: str):
    """export_gguf.encode_tensor writing the tensors `types` names in those types (kept in `written`)."""
    qtype = types.get(name)
    if qtype is None:
        return ENCODE_TENSOR(name, tensor, outtype)
    array = tensor.float().numpy()
    if qtype in HAND_SCALES:
        data = hand_blocks(qtype, array.shape, np.random.default_rng(len(written)))
    elif qtype == T.I32:  # integers: no weight format
        data = np.zeros(array.shape, np.int32)
    else:
        data = gguf.quants.quantize(array, qtype)
    written[name] = (np.ascontiguousarray(data).view(np.uint8).copy(), qtype, array.shape)
    return data, qtype


ENCODE_TENSOR = export_gguf.encode_tensor


def test_every_tensor_type_reads_as_its_format_defines_with_transformers_logits(tmp_path, monkeypatch, qwen_tokenizer):
    """F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (the gguf package's quantizer) and Q4_K, Q5_K, Q6_K (blocks made by
    hand) in one Llama file: each tensor reads as the float64 computation of its block format, and the model gives
    transformers' logits."""
    written: dict = {}
    monkeypatch.setattr(export_gguf, "encode_tensor", partial(encode_as, QUANTIZED, written))
    source = tiny("llama-untied", n_layer=3, mlp_hidden=256)  # K-quant blocks hold 256 values: ffn_down's rows
    path = export_file(tmp_path, source, qwen_tokenizer)
    assert set(written) == set(QUANTIZED)
    tensors = read_tensors(open_gguf(path), path)
    for name, (raw, qtype, shape) in written.items():
        expected = torch.from_numpy(dequantized64(raw, qtype, shape))
        torch.testing.assert_close(tensors[name].double(), expected, rtol=1e-6, atol=1e-9, msg=name)
    ours = load(str(path), tokenizer=False).model
    torch.testing.assert_close(logits(ours, IDX), transformers_model(path, "llama")(IDX).logits, rtol=0, atol=1e-4)


# One matrix of each other type in a 256-wide Llama of two layers (their blocks hold 256 weights, IQ4_NL's 32).
OTHER_TYPES = dict(
    zip(
        [f"blk.{i}.{part}.weight" for i in range(2) for part in LLAMA_PARTS],
        OTHER_SCALES,
        strict=False,
    )
)


def test_the_other_k_i_and_ternary_quants_read_with_transformers_logits(tmp_path, monkeypatch, qwen_tokenizer):
    """Q2_K, Q3_K, the I-quants and the ternary ones, one matrix each in one Llama file, give transformers' logits
    (it dequantizes them with the same gguf package: llama.cpp's own C dequantizes them in test_gguf_llamacpp.py)."""
    written: dict = {}
    monkeypatch.setattr(export_gguf, "encode_tensor", partial(encode_as, OTHER_TYPES, written))
    path = export_file(tmp_path, tiny("llama-untied", n_layer=2, n_embd=256, mlp_hidden=256), qwen_tokenizer)
    assert sorted(qtype for _, qtype, _ in written.values()) == sorted(OTHER_SCALES)
    tensors = read_tensors(open_gguf(path), path)
    assert all(tensors[name].abs().max() < 0.2 for name in written)  # the scales took: no junk values
    ours = load(str(path), tokenizer=False).model
    torch.testing.assert_close(logits(ours, IDX), transformers_model(path, "llama")(IDX).logits, rtol=0, atol=1e-4)


def test_int4_of_a_q4_k_product_keeps_its_codes_and_group_scales(tmp_path, monkeypatch, qwen_tokenizer):
    """Under --quantize=int4 a Q4_K product's groups keep the file's codes, with scale d sc_j and minimum -dmin m_j
    in float16: each weight within float16's rounding of those (2^-11 of each, at most 15 scales and a minimum) of
    the float64 computation of the block format, where quantizing the values again moves the codes of groups whose
    codes miss 0 or 15 by up to half a step."""
    written: dict = {}
    types = {f"blk.{layer}.ffn_down.weight": T.Q4_K for layer in range(2)}
    monkeypatch.setattr(export_gguf, "encode_tensor", partial(encode_as, types, written))
    path = export_file(tmp_path, tiny("llama-untied", mlp_hidden=256), qwen_tokenizer)
    model = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "int4")
    for layer in range(2):
        raw, qtype, shape = written[f"blk.{layer}.ffn_down.weight"]
        exact = torch.from_numpy(dequantized64(raw, qtype, shape)).view(shape[0], -1, 32)
        codes, scale, minimum = model.get_submodule(f"transformer.h.{layer}.mlp.c_proj").blocks()
        codes = torch.cat([codes & 15, codes >> 4], dim=-1).double()  # byte j: weight j low, weight j + 16 high
        values = scale.double()[..., None] * codes + minimum.double()[..., None]
        rounding = (15 * scale.double().abs() + minimum.double().abs())[..., None] * 2**-11
        assert ((values - exact).abs() <= rounding).all()


def test_q8_0_rows_read_as_the_gguf_package_dequantizes_them():
    """Q8_0 rows (any tensor, a whole one or a lookup's rows) dequantize to exactly the gguf package's float32 values."""
    array = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32) * 3
    array[2] = 0.0  # a block whose scale is 0
    blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    values = q8_0_values(blocks.view(np.uint8).reshape(5, -1), 96)
    assert values.dtype == torch.float32 and torch.equal(values, torch.from_numpy(np.asarray(expected, np.float32)))


# ------------------------------------------------------------------------------------------------ the tokenizer

PRE_NAMES = {"gpt2": "gpt-2", "llama3": "llama-bpe", "qwen2": "qwen2", "smollm2": "smollm"}


# Other names llama.cpp gives the pre-tokenizers of our families (llama-vocab.cpp: each group splits alike).
OTHER_PRE_NAMES = {"gpt2": ("phi-2", "mellum"), "llama3": ("falcon3", "midm-2.0"), "qwen2": ("megrez",)}


@pytest.mark.parametrize(
    "family, name", [(family, name) for family, names in OTHER_PRE_NAMES.items() for name in names]
)
def test_a_pre_tokenizer_under_another_of_llama_cpp_s_names_reads_as_its_family(tmp_path, monkeypatch, family, name):
    """A file naming its pre-tokenizer as llama.cpp does for other models of the family's regexes (Falcon 3's
    falcon3 is Llama 3's) tokenizes as the tokenizer.json it was written from."""
    monkeypatch.setattr(gguf_hf_tokenizer, "pre_tokenizer_name", lambda spec: name)
    source = load_hf_tokenizer(write_family(tmp_path / "source", family))
    path = export_file(tmp_path / "gguf", tiny("llama-untied"), source)
    assert open_gguf(path).fields["tokenizer.ggml.pre"].contents() == name
    ours = load_gguf_tokenizer(path)
    for text in VARIED:
        assert ours.encode(text) == source.encode(text), text


@pytest.mark.parametrize("family, opens", [("llama3", True), ("qwen2", False)])
def test_a_file_that_says_nothing_of_bos_opens_with_it_as_llama_cpp_decides(tmp_path, monkeypatch, family, opens):
    """Without tokenizer.ggml.add_bos_token, llama.cpp opens a text with bos for the Llama 3 group of pre-tokenizers
    (not for Qwen2's): the tokenizer read so says so when written back (its bos-adding post-processor)."""
    source = load_hf_tokenizer(write_family(tmp_path / "source", family))
    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_add_bos_token", lambda writer, value: None)
        path = export_file(tmp_path / "gguf", tiny("llama-untied"), source)
    assert "tokenizer.ggml.add_bos_token" not in open_gguf(path).fields
    back = export_file(tmp_path / "back", tiny("llama-untied"), load_gguf_tokenizer(path))
    assert bool(open_gguf(back).fields["tokenizer.ggml.add_bos_token"].contents()) is opens


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_s_tokenizer_reads_back_with_its_ids_and_template(tmp_path, family):
    """The tokenizer in the file tokenizes as the tokenizer.json it was written from and as transformers' tokenizer
    of the file (added tokens read as tokens in the second), keeps the chat template, and writes back under the same
    llama.cpp pre-tokenizer name."""
    source = load_hf_tokenizer(write_family(tmp_path / "source", family))
    path = export_file(tmp_path / "gguf", tiny("llama-untied"), source)
    ours = load_gguf_tokenizer(path)
    markers = " x".join(source.added_tokens) + "user\nHi there<|im_end|>\n"
    texts = [*VARIED, markers, "Hi" + "".join(source.added_tokens)]
    for text in texts:
        assert ours.encode(text) == source.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    auto = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if family == "smollm2":  # transformers' smollm splits no digits, as llama.cpp's (and SmolLM2's own) does
        texts = [text for text in texts if not any(char.isdigit() for char in text)]
    for text in texts:
        assert ours.encode_with_added(text) == auto.encode(text, add_special_tokens=False), text
    assert (ours.chat and ours.chat.source) == (source.chat and source.chat.source)
    assert ours.eot_token == source.eot_token
    spec = json.loads(ours.to_meta()["tokenizer_json"])
    assert gguf_hf_tokenizer.pre_tokenizer_name(spec) == PRE_NAMES[family]


# SentencePiece-style tokenizer.json files llama.cpp tokenizes exactly (see gguf_hf_tokenizer): Llama 2's normalizer
# form, and the Metaspace form that prepends no "▁", cutting text into words or not.
SENTENCEPIECE = {
    "llama2": {},
    "metaspace": dict(prepend_scheme="never", split=False),
    "metaspace-split": dict(prepend_scheme="never", split=True),
}


@pytest.mark.parametrize("form", sorted(SENTENCEPIECE))
def test_sentencepiece_tokenizers_read_back_with_their_ids(tmp_path, form):
    """llama.cpp's SentencePiece tokenizer (Llama 2, Mistral, TinyLlama) tokenizes as the tokenizer.json it was
    written from, and as transformers' tokenizer of the file on Llama 2's form where that puts the same space before
    a text (not before one that opens with a space, nor after a special token) as llama.cpp."""
    source = load_hf_tokenizer(write_sentencepiece(tmp_path / "source", every_split=True, **SENTENCEPIECE[form]))
    path = export_file(tmp_path / "gguf", tiny("llama-untied"), source)
    ours = load_gguf_tokenizer(path)
    texts = [*VARIED, " leading", "<s>hi</s> there", "x<unk>y"]
    for text in texts:
        assert ours.encode(text) == source.encode(text), text
        assert ours.encode_with_added(text) == source.encode_with_added(text), text
        assert ours.decode(ours.encode(text)) == source.decode(source.encode(text)), text
    assert ours.chat.source == source.chat.source and ours.eot_token == source.eot_token
    if form == "llama2":
        auto = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        for text in (text for text in texts if not text[0].isspace() and "<" not in text):
            assert ours.encode(text) == auto.encode(text, add_special_tokens=False), text


def test_our_own_tokenizers_read_back_with_their_ids(tmp_path):
    """A BPE trained here (GPT-4's split: llama.cpp's llama-bpe) and a table of one-byte characters (a byte-level BPE
    without merges) tokenize as themselves when read from the file, and the table so read is written to a file
    again (as the same byte-level BPE without merges) that reads back with the same ids."""
    bpe = tiny_bpe(b"he", b"ll", b"hell", b"hello", b" w")
    text = "hello world, hell's 12345 \u00e9t\u00e9"
    bpe_file = export_file(tmp_path / "bpe", lively_model(vocab_size=320), bpe)
    assert load_gguf_tokenizer(bpe_file).encode(text) == bpe.encode(text)
    chars = CharTokenizer.from_text("abc defg\nhi!")
    char_file = export_file(tmp_path / "char", lively_model(vocab_size=chars.vocab_size), chars)
    assert load_gguf_tokenizer(char_file).encode("hi abc\ndeg!") == chars.encode("hi abc\ndeg!")
    again = export_file(tmp_path / "again", lively_model(vocab_size=chars.vocab_size), load_gguf_tokenizer(char_file))
    assert load_gguf_tokenizer(again).encode("hi abc\ndeg!") == chars.encode("hi abc\ndeg!")


def test_a_character_table_read_from_the_file_refuses_characters_it_lacks(tmp_path, capsys):
    """A byte-level BPE with no token for some bytes (a character table's) and no unknown token would drop those
    characters from a prompt or a corpus without a trace: it refuses them, as CharTokenizer does; a complete
    byte-level BPE (the trained one, with its 256 bytes) encodes anything."""
    chars = CharTokenizer.from_text("abc defg\nhi!", eot=True)
    char_file = export_file(tmp_path / "char", lively_model(vocab_size=chars.vocab_size), chars)
    read = load_gguf_tokenizer(char_file)
    for text in ("hi \u00e9g\u00e9 \u4e16!", "\u00e9\u4e16"):
        with pytest.raises(UserError) as refused:
            read.encode(text)
        with pytest.raises(UserError, match="\u00e9"):
            chars.encode(text)
        message = str(refused.value)
        assert "2 character(s)" in message and "'\u00e9', '\u4e16'" in message and "\n" not in message
    with pytest.raises(UserError, match="'x'"):
        read.encode_without_added("hix")
    assert read.encode_with_added("hi<|endoftext|>") == [*chars.encode("hi"), chars.eot_token]  # '|' has no token
    bpe = tiny_bpe(b"he")
    bpe_file = export_file(tmp_path / "bpe", lively_model(vocab_size=320), bpe)
    assert load_gguf_tokenizer(bpe_file).encode("h\u00e9\u4e16x") == bpe.encode("h\u00e9\u4e16x")
    args = [f"--init_from={char_file}", "--start=\u4e16", "--max_new_tokens=2", "--device=cpu"]
    code, _, err = run_main(sample.main, args, capsys)
    assert_one_line_error(code, err, "1 character(s)", "'\u4e16'")


def test_make_tokenizer_and_prepare_data_take_the_file(tmp_path, qwen_tokenizer):
    path = export_file(tmp_path, tiny("qwen2"), qwen_tokenizer)
    assert make_tokenizer(str(path)).to_meta() == load_gguf_tokenizer(path).to_meta()
    assert make_tokenizer(str(path.parent)).encode("Hello there") == qwen_tokenizer.encode("Hello there")


def test_the_model_its_tokenizer_and_the_data_check_come_from_one_read_of_the_file(tmp_path, qwen_tokenizer):
    """load reads a GGUF file's metadata once (gguf's reader takes seconds over a large vocabulary): with the file
    emptied after the read, the tokenizer train.py checks its data against and the one sample.py decodes with are
    still the file's."""
    for tokenizer in (False, True):
        path = export_file(tmp_path, tiny("qwen2"), qwen_tokenizer)
        own = load_gguf_tokenizer(path)
        meta = {"tokenizer": own.to_meta(), "vocab_size": own.vocab_size, "eot_token": None}
        loaded = load(str(path), tokenizer=tokenizer)
        path.write_bytes(b"")
        check_data_tokenizer(loaded, meta)
        with pytest.raises(UserError) as error:
            check_data_tokenizer(loaded, {**meta, "tokenizer": CharTokenizer.from_text("abc").to_meta()})
        assert_one_line_message(error.value, f"needs data in its own tokenizer; prepare it with --tokenizer={path}")
    assert loaded.tokenizer.to_meta() == own.to_meta()


# ------------------------------------------------------------------------------------------------ the scripts


def greedy_text(path: Path, prompt: list[int], tokens: int, stops: set[int]) -> str:
    """transformers' greedy continuation of `prompt` on the file, cut before the first of `stops`, as text."""
    model = transformers_model(path, "qwen2")
    auto = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    idx = torch.tensor([prompt])
    out = model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=tokens, do_sample=False)[
        0, len(prompt) :
    ]
    cut = next((i for i, token in enumerate(out.tolist()) if token in stops), len(out))
    return auto.decode(out[:cut])


def test_sample_py_prints_transformers_greedy_text_from_the_file_and_its_directory(tmp_path, qwen_tokenizer, capsys):
    path = export_file(tmp_path / "model", tiny("qwen2"), qwen_tokenizer)
    start = "def square(x):"
    expected = start + greedy_text(path, qwen_tokenizer.encode(start), 12, set()) + "\n"
    for init_from in (path, path.parent):
        args = cli_args(init_from=init_from, start=start, max_new_tokens=12, temperature=0, stop_at_eot=False)
        result = run_in_process(sample.main, [*args, "--stream=False", "--device=cpu", "--decode=eager"], capsys)
        assert result.returncode == 0, result.stderr
        # A random model picks bytes that split characters: transformers shows each broken token as U+FFFD, sample.py
        # joins a character's bytes across tokens first; the text apart from those marks is the same.
        assert result.stdout.replace("\ufffd", "") == expected.replace("\ufffd", "")


def test_a_llama_3_file_s_plain_prompt_opens_with_bos_as_transformers_and_llama_cpp_prompt_it(tmp_path, capsys):
    """The file says add_bos_token (Llama 3's tokenizer puts <|begin_of_text|> before a text): sample.py's greedy
    text is transformers' from the ids its tokenizer gives the prompt, bos first."""
    llama3 = load_hf_tokenizer(write_family(tmp_path / "tokenizer", "llama3"))
    path = export_file(tmp_path / "model", tiny("llama-untied"), llama3)
    auto = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    start = "def square(x):"
    ids = auto(start)["input_ids"]
    assert ids[0] == auto.bos_token_id and ids[1:] == llama3.encode(start)
    model = transformers_model(path, "llama-untied")
    idx = torch.tensor([ids])
    out = model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=12, do_sample=False)[0, len(ids) :]
    args = cli_args(init_from=path, start=start, max_new_tokens=12, temperature=0, stop_at_eot=False)
    result = run_in_process(sample.main, [*args, "--stream=False", "--device=cpu", "--decode=eager"], capsys)
    assert result.returncode == 0, result.stderr
    assert result.stdout.replace("\ufffd", "") == (start + auto.decode(out) + "\n").replace("\ufffd", "")


@pytest.mark.parametrize(
    ("outtype", "quantize"), [("q4_0", "none"), ("q4_1", "int4"), ("q8_0", "none"), ("f32", "int4")]
)
def test_a_file_read_as_it_is_stored_runs_under_bfloat16_autocast(tmp_path, qwen_tokenizer, capsys, outtype, quantize):
    """sample.py --dtype=bfloat16 on the CPU runs the products under autocast, while the blocks read from the file
    are float16: their reading must not meet the autocast (torch.cat refuses float16 there)."""
    path = export_file(tmp_path / "model", tiny("qwen2"), qwen_tokenizer, outtype)
    model = apply_quantization(load(str(path), tokenizer=False, int4_products=True).model.eval(), quantize)
    want = logits(model, IDX)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = logits(model, IDX).float()
    torch.testing.assert_close(got, want, rtol=0, atol=0.1 * want.abs().max().item())  # bfloat16's 8 bits
    args = cli_args(init_from=path, start="def f", max_new_tokens=6, temperature=0, quantize=quantize)
    for decode in ("eager", "auto"):  # auto: eager, as the native int4 step computes in float32 only
        result = run_in_process(sample.main, [*args, "--dtype=bfloat16", "--device=cpu", f"--decode={decode}"], capsys)
        assert result.returncode == 0, result.stderr


def test_sample_py_chat_renders_the_file_s_template(tmp_path, qwen_tokenizer, capsys):
    path = export_file(tmp_path, tiny("qwen2", block_size=64), qwen_tokenizer)
    auto = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    message = [{"role": "user", "content": "Hello there"}]
    prompt = auto.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = greedy_text(path, prompt, 8, {auto.convert_tokens_to_ids("<|im_end|>")})
    sys.stdin = io.StringIO("Hello there\n")
    try:
        args = cli_args(init_from=path, max_new_tokens=8, temperature=0)
        code, out, err = run_main(sample.main, [*args, "--chat", "--device=cpu", "--decode=eager"], capsys)
    finally:
        sys.stdin = sys.__stdin__
    assert code == 0, err
    assert out.replace("\ufffd", "") == expected.replace("\ufffd", "") + "\n"


CONVERSATIONS = [
    [{"role": "user", "content": f"{i} + {i}?"}, {"role": "assistant", "content": f"{2 * i}"}] for i in range(30)
]
TRAIN = dict(
    device="cpu",
    compile=False,
    block_size=64,
    batch_size=2,
    gradient_accumulation_steps=1,
    max_iters=2,
    eval_interval=2,
    eval_iters=1,
    learning_rate=1e-3,
    curves=False,
    cpu_threads=1,
)


@pytest.mark.heavy
def test_train_fine_tunes_the_file_whole_and_with_lora_and_export_writes_it_back(tmp_path, qwen_tokenizer, capsys):
    """Chat data prepared with the file's tokenizer; train.py from the file (all weights, then LoRA, whose base is the
    file by path and sha256); export.py from the file gives the Hugging Face model of the same logits."""
    path = export_file(tmp_path / "model", tiny("qwen2", block_size=64), qwen_tokenizer)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS), encoding="utf-8")
    data = tmp_path / "data"
    code, _, err = run_main(chat_script.main, [f"--input={chats}", f"--out_dir={data}", f"--tokenizer={path}"], capsys)
    assert code == 0, err
    for name, extra in (("full", {}), ("lora", dict(lora_rank=4, lora_alpha=8.0))):
        args = cli_args(init_from=path, data_dir=data, out_dir=tmp_path / name, **TRAIN, **extra)
        code, _, err = run_main(train.main, args, capsys)
        assert code == 0, err
        tokenizer = load(str(tmp_path / name)).tokenizer
        assert tokenizer.to_meta() == load_gguf_tokenizer(path).to_meta()
    lora = load_checkpoint(tmp_path / "lora" / "ckpt.pt")["lora"]
    assert lora["base"] == base_reference(str(path)) and lora["base"]["source"] == str(path.resolve())

    exported = tmp_path / "hf"
    done = run_in_process(export.main, [f"--init_from={path}", "--format=hf", f"--export_dir={exported}"], capsys)
    assert done.returncode == 0, done.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    torch.testing.assert_close(hf(IDX).logits, logits(load(str(path), tokenizer=False).model, IDX), rtol=0, atol=1e-4)
    again = tmp_path / "gguf"
    done = run_in_process(export.main, [f"--init_from={path}", "--format=gguf", f"--export_dir={again}"], capsys)
    assert done.returncode == 0, done.stderr
    assert (again / "tiny-f16.gguf").is_file()  # named after the file read, less its type


def test_grpo_and_dpo_start_from_the_file_with_its_tokenizer(tmp_path, qwen_tokenizer, capsys):
    """GRPO has no data directory: its prompts are rendered with the file's own tokenizer and template, which its
    checkpoints record (as DPO's, from preferences prepared with the file's tokenizer), LoRA over the file's Q4_0
    blocks."""
    path = export_file(tmp_path / "model", tiny("qwen2", block_size=64), qwen_tokenizer, "q4_0")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(4)))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"{i}?", "chosen": f"{i}", "rejected": "no"}) + "\n" for i in range(8))
    )
    code, _, err = run_main(
        preferences.main,
        [f"--input={pairs}", f"--out_dir={tmp_path / 'prefs'}", f"--tokenizer={path}", "--val_fraction=0.25"],
        capsys,
    )
    assert code == 0, err
    lora = dict(lora_rank=4, lora_base_weights="int4")
    runs = {
        "grpo": dict(objective="grpo", grpo_prompts=prompts, grpo_eval_prompts=prompts, grpo_group_size=2, **lora),
        "dpo": dict(objective="dpo", data_dir=tmp_path / "prefs", **lora),
    }
    for name, extra in runs.items():
        args = cli_args(
            init_from=path, out_dir=tmp_path / name, **{**TRAIN, "max_iters": 1, "eval_interval": 1}, **extra
        )
        code, _, err = run_main(train.main, args, capsys)
        assert code == 0, err
        state = load_checkpoint(tmp_path / name / "ckpt.pt")
        assert state["lora"]["base"] == base_reference(str(path))
        assert load(str(tmp_path / name)).tokenizer.to_meta() == load_gguf_tokenizer(path).to_meta()


def test_products_in_k_quants_say_what_their_float32_copy_takes_and_how_to_keep_4_bits(
    tmp_path, monkeypatch, qwen_tokenizer, capsys
):
    """Decoding a file whose products are K-quants makes them float32 under --quantize=none: sample.py says how many
    bytes that is (rows x columns x 4 of each such product) and that int4 keeps 4 bits; under int4 it says nothing."""
    types = {f"blk.{layer}.ffn_down.weight": T.Q4_K for layer in range(2)}
    monkeypatch.setattr(export_gguf, "encode_tensor", partial(encode_as, types, {}))
    path = export_file(tmp_path, tiny("llama-untied", mlp_hidden=256), qwen_tokenizer)
    args = [f"--init_from={path}", "--start=Hi", "--max_new_tokens=2", "--device=cpu"]
    code, _, err = run_main(sample.main, args, capsys)
    assert code == 0, err
    assert err.splitlines()[0] == (  # two 64 x 256 products in float32: 131,072 bytes
        "note: the file's Q4_K products decode in float32 under --quantize=none (0.1 MB); --quantize=int4 keeps them "
        "in 4 bits"
    )
    code, _, err = run_main(sample.main, [*args, "--quantize=int4"], capsys)
    assert code == 0 and "note:" not in err, err


def test_a_file_whose_chat_template_fails_samples_text_and_says_why_there_is_no_chat(
    tmp_path, monkeypatch, qwen_tokenizer, capsys
):
    """A file whose chat template is not valid Jinja runs as llama.cpp runs it, its chat alone refused: sample.py
    continues a prompt, and --chat says why in one line."""
    write_template = gguf.GGUFWriter.add_chat_template
    with monkeypatch.context() as patch:
        broken = "{% for m in messages %}{{ m.content }"
        patch.setattr(gguf.GGUFWriter, "add_chat_template", lambda writer, value: write_template(writer, broken))
        path = export_file(tmp_path, tiny("qwen2"), qwen_tokenizer)
    args = [f"--init_from={path}", "--max_new_tokens=3", "--device=cpu"]
    code, out, err = run_main(sample.main, [*args, "--start=Hi there"], capsys)
    assert code == 0 and out.startswith("Hi there"), err
    code, _, err = run_main(sample.main, [*args, "--chat"], capsys)
    assert_one_line_error(code, err, "error: the chat template is not valid Jinja (line 1", "use --start")


def test_a_file_whose_vocabulary_cannot_spell_its_template_samples_text_and_says_why_there_is_no_chat(
    tmp_path, monkeypatch, qwen_tokenizer, capsys
):
    """A vocabulary without a newline's token, under a template that writes newlines: the template is what fails,
    not the user's text."""
    tokens, types = gguf.GGUFWriter.add_token_list, gguf.GGUFWriter.add_token_types
    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_token_list", lambda writer, value: tokens(writer, value[:200]))
        patch.setattr(gguf.GGUFWriter, "add_token_types", lambda writer, value: types(writer, value[:200]))
        path = export_file(tmp_path, tiny("qwen2"), qwen_tokenizer)
    assert "\n" not in load_gguf_tokenizer(path).decode(list(range(200)))
    args = [f"--init_from={path}", "--max_new_tokens=3", "--device=cpu"]
    code, out, err = run_main(sample.main, [*args, "--start=hi"], capsys)
    assert code == 0 and out.startswith("hi"), err
    code, _, err = run_main(sample.main, [*args, "--chat"], capsys)
    assert_one_line_error(code, err, "the chat template's own text cannot be tokenized", "'\\n'")


# ------------------------------------------------------------------------------------------------ the hub


@pytest.mark.parametrize(
    "filename, tag",
    [
        ("SmolLM2-1.7B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("model.q8_0.gguf", "Q8_0"),
        ("sub/qwen2.5-0.5b-instruct-iq4_xs.GGUF", "IQ4_XS"),
        ("model-Q4_K_M-00001-of-00002.gguf", None),  # one part of a split file
        ("model.gguf", None),
        ("README.md", None),
    ],
)
def test_a_gguf_file_s_tag_is_the_quantization_its_name_ends_in(filename, tag):
    assert gguf_tag(Path(filename).name) == tag


def test_a_hub_repository_s_gguf_file_is_named_by_its_tag(tmp_path, monkeypatch, qwen_tokenizer, capsys):
    """owner/name:TAG fetches the one GGUF file of that quantization (in any case), and only it, from HF_ENDPOINT
    (a loopback stand-in for the hub) into the cache and samples as the file itself does; offline it is read from
    the cache; the repository's name alone, a tag it does not hold and one not in the cache offline are one line
    each, naming the tags there are. A LoRA base fetched so is recorded by that name."""
    import huggingface_hub.constants

    repository = tmp_path / "repository"
    repository.mkdir()
    model = tiny("qwen2")
    for outtype, name in (("q8_0", "tiny-Q8_0.gguf"), ("q4_0", "tiny.q4_0.gguf")):
        export_file(tmp_path / outtype, model, qwen_tokenizer, outtype).rename(repository / name)
    (repository / "README.md").write_text("a tiny model\n")
    args = ["--start=Hi there", "--max_new_tokens=6", "--temperature=0", "--device=cpu"]
    code, expected, err = run_main(sample.main, [f"--init_from={repository / 'tiny-Q8_0.gguf'}", *args], capsys)
    assert code == 0, err
    hub = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "0"}
    with serving_hub({"someone/tiny-GGUF": repository}) as (base, requested):
        env = clean_env(**hub, HF_ENDPOINT=base)
        online = run_script("sample.py", "--init_from=someone/tiny-GGUF:q8_0", *args, env=env)
        assert (online.returncode, online.stdout) == (0, expected), online.stderr
        fetched = [line.rsplit("/", 1)[1] for line in requested if line.startswith("GET /someone/tiny-GGUF/resolve/")]
        assert fetched == ["tiny-Q8_0.gguf"]
        untagged = run_script("sample.py", "--init_from=someone/tiny-GGUF", *args, env=env)
        assert_script_error(untagged, "someone/tiny-GGUF holds GGUF files", "e.g. someone/tiny-GGUF:Q4_0")
        unknown = run_script("sample.py", "--init_from=someone/tiny-GGUF:Q5_K_M", *args, env=env)
        assert_script_error(unknown, "holds no GGUF file tagged Q5_K_M", "tags: Q4_0, Q8_0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", hub["HF_HUB_CACHE"])  # read once, on import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, out, err = run_main(sample.main, ["--init_from=someone/tiny-GGUF:Q8_0", *args], capsys)
    assert (code, out) == (0, expected), err
    sample_error("someone/tiny-GGUF:Q4_0", capsys, "someone/tiny-GGUF:Q4_0: no such directory", "in the cache")
    digest = hashlib.sha256((repository / "tiny-Q8_0.gguf").read_bytes()).hexdigest()
    assert base_reference("someone/tiny-GGUF:Q8_0") == {"source": "someone/tiny-GGUF:Q8_0", "sha256": digest}
    own = load_gguf_tokenizer(repository / "tiny-Q8_0.gguf").to_meta()
    assert named_tokenizer("someone/tiny-GGUF:Q8_0", None).to_meta() == own  # the preparation scripts' --tokenizer
    (tmp_path / "notes.txt").write_text("Hi there, a note to tokenize.\n" * 40)
    corpus_args = [f"--input={tmp_path / 'notes.txt'}", f"--out_dir={tmp_path / 'data'}", "--block_size=8"]
    code, _, err = run_main(corpus.main, [*corpus_args, "--tokenizer=someone/tiny-GGUF:Q8_0"], capsys)
    assert code == 0, err
    assert read_meta(tmp_path / "data")["tokenizer"] == {key: value for key, value in own.items() if key != "chat"}


# ------------------------------------------------------------------------------------------------ refusals


def sample_error(init_from: Path, capsys, *fragments: str) -> str:
    args = [f"--init_from={init_from}", "--max_new_tokens=2", "--device=cpu", "--decode=eager"]
    code, _, err = run_main(sample.main, args, capsys)
    return assert_one_line_error(code, err, *fragments)


def write_bare(path: Path, arch: str, **uint16: int) -> Path:
    """A GGUF file of `arch` with one small tensor and the given uint16 metadata."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in uint16.items():
        writer.add_uint16(key.replace("_", "."), value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_without_a_tokenizer_is_one_line(tmp_path):
    with pytest.raises(UserError) as error:
        load_gguf_tokenizer(write_bare(tmp_path / "bare.gguf", "llama"))
    assert_one_line_message(error.value, "bare.gguf: it holds no tokenizer", "byte-level BPE", "SentencePiece")


def test_a_truncated_file_an_unknown_architecture_and_a_split_file_are_one_line(tmp_path, qwen_tokenizer, capsys):
    whole = export_file(tmp_path / "whole", tiny("qwen2"), qwen_tokenizer)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size * 2 // 3])
    sample_error(truncated, capsys, "truncated.gguf", "truncated, damaged or not a GGUF file")
    sample_error(write_bare(tmp_path / "mamba.gguf", "mamba"), capsys, "'mamba'", "gpt2, llama, qwen2, qwen3")
    split = write_bare(tmp_path / "part.gguf", "llama", split_count=2, split_no=0)
    sample_error(split, capsys, "part 1 of a GGUF model split into 2 files", "llama-gguf-split --merge")
    (tmp_path / "whole" / "other.gguf").write_bytes(b"")
    sample_error(tmp_path / "whole", capsys, "holds 2 GGUF files")


def test_a_block_count_beyond_the_blocks_held_and_a_missing_matrix_are_one_line(
    tmp_path, monkeypatch, qwen_tokenizer, capsys
):
    """Said from the metadata and the tensors' names, before a model of the size the metadata gives is made."""
    model = tiny("llama-untied", n_layer=2)
    write_count, write_tensor = gguf.GGUFWriter.add_block_count, gguf.GGUFWriter.add_tensor
    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_block_count", lambda writer, count: write_count(writer, 50))
        many = export_file(tmp_path / "many", model, qwen_tokenizer)
    sample_error(many, capsys, "50 layers in its llama.block_count, but its weights hold layers 0 to 1 (2)", "damaged")

    def without_query(writer, name, *args, **kwargs):
        if name != "blk.1.attn_q.weight":
            write_tensor(writer, name, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", without_query)
        lacking = export_file(tmp_path / "lacking", model, qwen_tokenizer)
    sample_error(lacking, capsys, "tensor blk.1.attn_q.weight is missing (1 of the model's matrices)", "damaged")

    def without_norm(writer, name, *args, **kwargs):
        if name != "output_norm.weight":
            write_tensor(writer, name, *args, **kwargs)

    with monkeypatch.context() as patch:  # a vector, not a matrix: named as the file names it, not as transformers
        patch.setattr(gguf.GGUFWriter, "add_tensor", without_norm)
        normless = export_file(tmp_path / "normless", model, qwen_tokenizer)
    sample_error(normless, capsys, "the weights lack output_norm.weight")


def test_a_matrix_left_in_the_file_in_another_shape_than_the_metadata_s_is_one_line(
    tmp_path, monkeypatch, qwen_tokenizer, capsys
):
    """Q4_0 matrices stay in the file (read as they are needed), so their shapes are checked against the metadata's
    model when they are left there: here an MLP width of 7 beside matrices of the model's own."""
    write_width = gguf.GGUFWriter.add_feed_forward_length
    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_feed_forward_length", lambda writer, width: write_width(writer, 7))
        path = export_file(tmp_path / "narrow", tiny("llama-untied"), qwen_tokenizer, "q4_0")
    sample_error(path, capsys, "the weights blk.0.ffn_gate.weight + blk.0.ffn_up.weight are (", "has (14, 64); ")


def test_token_types_that_do_not_match_the_tokens_and_more_tokens_than_rows_are_one_line(
    tmp_path, monkeypatch, qwen_tokenizer, capsys
):
    """Without a type for each token, which ones are control tokens (a turn's end) is unknown; a vocabulary larger
    than the model's rows is a file whose parts do not belong together (no --data_dir would mend it)."""
    model = tiny("llama-untied")
    write_types, write_tokens = gguf.GGUFWriter.add_token_types, gguf.GGUFWriter.add_token_list
    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_token_types", lambda writer, types: write_types(writer, types[:10]))
        short = export_file(tmp_path / "short", model, qwen_tokenizer)
    sample_error(short, capsys, "tokenizer.ggml.token_type holds 10 types for 640 tokens", "damaged")

    def more_tokens(writer, tokens):
        write_tokens(writer, [*tokens, *(f"extra{i}" for i in range(100))])

    def more_types(writer, types):
        write_types(writer, [*types, *[gguf.TokenType.NORMAL] * 100])

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_token_list", more_tokens)
        patch.setattr(gguf.GGUFWriter, "add_token_types", more_types)
        wide = export_file(tmp_path / "wide", model, qwen_tokenizer)
    error = sample_error(wide, capsys, f"{wide}: its tokenizer has 740 tokens but its model only 640")
    assert "--data_dir" not in error


def test_a_context_whose_position_tables_outgrow_the_machine_is_one_line(tmp_path, monkeypatch, qwen_tokenizer, capsys):
    """2^24 positions of 16 rotary frequencies, float64 while they are computed: 4 GB, on a machine said to hold 1."""
    write_length = gguf.GGUFWriter.add_context_length
    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_context_length", lambda writer, length: write_length(writer, 2**24))
        path = export_file(tmp_path / "long", tiny("llama-untied", n_head=2, n_kv_head=2), qwen_tokenizer)
    monkeypatch.setattr(checkpoint, "physical_memory", lambda: 2**30)
    sample_error(path, capsys, "its context of 16777216 positions needs 4 GB for the position tables alone")
    monkeypatch.setattr(checkpoint, "physical_memory", lambda: None)  # a system that does not say: not checked
    checkpoint.check_context_fits(GPTConfig(block_size=2**24, pos_encoding="rope"), "any")


def test_a_tensor_type_not_read_is_one_line_and_export_writes_nothing(tmp_path, monkeypatch, qwen_tokenizer, capsys):
    monkeypatch.setattr(export_gguf, "encode_tensor", partial(encode_as, {"blk.1.ffn_down.weight": T.I32}, {}))
    path = export_file(tmp_path / "model", tiny("llama-untied", mlp_hidden=256), qwen_tokenizer)
    sample_error(path, capsys, "blk.1.ffn_down.weight is stored as I32", "Q4_K, Q5_K, Q6_K, IQ1_S")
    code, _, err = run_main(
        export.main, [f"--init_from={path}", "--format=hf", f"--export_dir={tmp_path / 'hf'}"], capsys
    )
    assert_one_line_error(code, err, "I32")
    assert not (tmp_path / "hf").exists()


def export_error(init_from: Path, tmp_path: Path, capsys, *fragments: str) -> None:
    """export.py --format=hf on the file: one line, and no export directory."""
    out = tmp_path / "hf-export"
    code, _, err = run_main(export.main, [f"--init_from={init_from}", "--format=hf", f"--export_dir={out}"], capsys)
    assert_one_line_error(code, err, *fragments)
    assert not out.exists()


def damaged(tmp_path: Path, monkeypatch, qwen_tokenizer, name: str, outtype: str, **patches) -> Path:
    """A tiny untied Llama exported with GGUFWriter's methods `patches` replaced (each: name -> new method)."""
    with monkeypatch.context() as patch:
        for method, replacement in patches.items():
            patch.setattr(gguf.GGUFWriter, method, replacement)
        return export_file(tmp_path / name, tiny("llama-untied"), qwen_tokenizer, outtype)


def reshaped(name: str, shape: tuple[int, ...]):
    """A GGUFWriter.add_tensor that writes tensor `name` (float32) in another shape of the same values."""
    write = gguf.GGUFWriter.add_tensor

    def add_tensor(writer, tensor_name, tensor, *args, **kwargs):
        write(writer, tensor_name, tensor.reshape(shape) if tensor_name == name else tensor, *args, **kwargs)

    return add_tensor


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_a_head_of_other_rows_than_the_vocabulary_is_one_line_in_every_path(
    tmp_path, monkeypatch, qwen_tokenizer, capsys, outtype
):
    """A head left in the file (Q8_0 products decode in their blocks) is checked as a float32 one is: a row too few
    would be read past the tensor's end."""
    write = gguf.GGUFWriter.add_tensor

    def short_head(writer, name, tensor, *args, raw_shape=None, **kwargs):
        if name == "output.weight" and raw_shape is None:
            tensor = tensor[:-1]
        elif name == "output.weight":  # Q8_0 blocks: raw bytes a row, and the shape in values
            tensor, raw_shape = tensor[:-1], (raw_shape[0] - 1, *raw_shape[1:])
        write(writer, name, tensor, *args, raw_shape=raw_shape, **kwargs)

    path = damaged(tmp_path, monkeypatch, qwen_tokenizer, "head", outtype, add_tensor=short_head)
    expected = ("output.weight are (639, 64)", "has (640, 64)")
    for decode in ("--decode=eager", "--decode=auto"):
        code, _, err = run_main(sample.main, [f"--init_from={path}", "--max_new_tokens=2", decode], capsys)
        assert_one_line_error(code, err, *expected)
    export_error(path, tmp_path, capsys, *expected)


def test_a_product_of_three_dimensions_or_of_another_width_is_one_line_in_every_path(
    tmp_path, monkeypatch, qwen_tokenizer, capsys
):
    """The same values in three dimensions, or a query of other rows: refused before llama.cpp's row order is undone
    (float32) or a module reads them (left in the file)."""
    cube = damaged(
        tmp_path, monkeypatch, qwen_tokenizer, "cube", "f32", add_tensor=reshaped("blk.0.attn_q.weight", (2, 32, 64))
    )
    sample_error(cube, capsys, "weight blk.0.attn_q.weight has 3 dimensions (64, 32, 2), not 2")
    export_error(cube, tmp_path, capsys, "3 dimensions")
    wide = damaged(
        tmp_path, monkeypatch, qwen_tokenizer, "wide", "f32", add_tensor=reshaped("blk.0.attn_q.weight", (32, 128))
    )
    sample_error(wide, capsys, "blk.0.attn_q.weight + blk.0.attn_k.weight + blk.0.attn_v.weight are (96, 128)")
    export_error(wide, tmp_path, capsys, "are (96, 128)", "has (128, 64)")


@pytest.mark.parametrize(
    "method, value, fragments",
    [
        ("add_head_count", lambda writer, count: writer.add_float32("llama.attention.head_count", 4.0), ("head_count is 4.0, not a whole number",)),
        ("add_block_count", lambda writer, count: writer.add_uint64("llama.block_count", 2**40), ("llama.block_count is 1099511627776, beyond",)),
        ("add_embedding_length", lambda writer, width: writer.add_uint64("llama.embedding_length", 2**62), ("embedding_length is 4611686018427387904, beyond",)),
        ("add_feed_forward_length", lambda writer, width: writer.add_uint64("llama.feed_forward_length", 2**62), ("feed_forward_length is", "beyond")),
        ("add_rope_freq_base", lambda writer, base: writer.add_string("llama.rope.freq_base", "1e4"), ("rope.freq_base is '1e4', not a number",)),
        ("add_chat_template", lambda writer, template: writer.add_uint32("tokenizer.chat_template", 5), ("tokenizer.chat_template is 5, not a string",)),
        ("add_token_merges", lambda writer, merges: writer.add_array("tokenizer.ggml.merges", [1, 2]), ("tokenizer.ggml.merges is [1, 2], not a list of strings",)),
        ("add_tokenizer_pre", lambda writer, pre: writer.add_array("tokenizer.ggml.pre", [pre]), ("tokenizer.ggml.pre is", "not a string")),
    ],
)  # fmt: skip
def test_metadata_of_the_wrong_type_or_beyond_the_tensors_is_one_line_in_every_path(
    tmp_path, monkeypatch, qwen_tokenizer, capsys, method, value, fragments
):
    path = damaged(tmp_path, monkeypatch, qwen_tokenizer, "model", "f32", **{method: value})
    sample_error(path, capsys, *fragments)
    export_error(path, tmp_path, capsys, *fragments)


@pytest.mark.parametrize("factor", [0.0, -2.0, float("nan")])
def test_a_rope_scaling_factor_that_is_no_positive_number_is_one_line(
    tmp_path, monkeypatch, qwen_tokenizer, capsys, factor
):
    write = gguf.GGUFWriter.add_rope_freq_base

    def with_scaling(writer, base):
        write(writer, base)
        writer.add_string("llama.rope.scaling.type", "linear")
        writer.add_float32("llama.rope.scaling.factor", factor)

    path = damaged(tmp_path, monkeypatch, qwen_tokenizer, "model", "f32", add_rope_freq_base=with_scaling)
    sample_error(path, capsys, f"rope.scaling.factor is {factor}; a scaling factor is a positive number")
    export_error(path, tmp_path, capsys, "rope.scaling.factor")
