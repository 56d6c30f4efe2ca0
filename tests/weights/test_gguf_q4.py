"""4-bit GGUF in and out: files whose matrices are Q4_0 or Q4_1 (gguf-py's own quantizer) read as Int4Linear products
holding the file's blocks byte for byte, checked against a float64 decoding of the blocks written from ggml's block
definitions (tests/weights/test_gguf_read.py) with llama.cpp's own row order for Llama's q and k, against
transformers reading the same file, and decoded by the native int4 step as by the eager pass (its inputs rounded as
the step rounds them); export.py's q4_0 and q4_1 read back by both; and LoRA over such a base (QLoRA), trained by
train.py and merged."""

from __future__ import annotations

import gc
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import export
import sample
import train
from gptkit.data.gguf_tokenizer import open_gguf
from gptkit.data.hf_tokenizer import load_hf_tokenizer
from gptkit.infer import native
from gptkit.infer.engine import Engine, Request
from gptkit.infer.native import NativeStep
from gptkit.infer.native import step as native_step
from gptkit.weights import export_gguf, load
from gptkit.weights.checkpoint import load_checkpoint
from gptkit.weights.lora import LoraConfig, LoraLinear, add_lora
from gptkit.weights.quantization import (
    FileEmbedding,
    FileInt4Embedding,
    FileInt4Linear,
    FileLinear,
    Int4Linear,
    Int8Blocks,
    Int8GroupedLinear,
    Int8Linear,
    apply_quantization,
)
from gptkit.weights.sources import base_reference
from helpers import (
    cli_args,
    lively_model,
    peak_rise,
    process_memory,
    qlora_set_up_peaks,
    release_freed_memory,
    run_in_process,
    run_main,
    with_16_bit_group_inputs,
)
from hf_tokenizer_dirs import write_family
from prepare_data import chat as chat_script

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from test_gguf_read import (  # noqa: E402
    CONVERSATIONS,
    IDX,
    K_SCALES,
    ROPE,
    TRAIN,
    dequantized64,
    export_file,
    greedy_text,
    hand_blocks,
    logits,
    tiny,
    transformers_model,
)

T = gguf.GGMLQuantizationType
# Our products -> the file's weights each is made of, in order (llama.cpp's names, its llama-arch.cpp).
GPT2_PARTS = {
    "attn.c_attn": ["attn_qkv"],
    "attn.c_proj": ["attn_output"],
    "mlp.c_fc": ["ffn_up"],
    "mlp.c_proj": ["ffn_down"],
}
LLAMA_PARTS = {
    "attn.c_attn": ["attn_q", "attn_k", "attn_v"],
    "attn.c_proj": ["attn_output"],
    "mlp.c_fc": ["ffn_gate", "ffn_up"],
    "mlp.c_proj": ["ffn_down"],
}


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    """A Qwen2-style byte-level BPE with ChatML (about 600 tokens)."""
    return load_hf_tokenizer(write_family(tmp_path_factory.mktemp("tokenizer") / "qwen2", "qwen2"))


def q4_file(directory: Path, monkeypatch, model, tokenizer, qtype, others: dict | None = None) -> Path:
    """`model` as a GGUF file whose every matrix (but the position table) is `qtype`, quantized by gguf-py, except
    the tensors `others` names, written in the types it gives them (a K-quant: blocks made by hand, test_gguf_read's
    hand_blocks)."""
    encode = export_gguf.encode_tensor

    def every_matrix_in(name, tensor, outtype):
        wanted = (others or {}).get(name, qtype)
        if tensor.dim() != 2 or name == "position_embd.weight":
            return encode(name, tensor, outtype)
        if wanted in K_SCALES:
            return hand_blocks(wanted, tuple(tensor.shape), np.random.default_rng(0)), wanted
        return gguf.quants.quantize(tensor.float().numpy(), wanted), wanted

    with monkeypatch.context() as patch:
        patch.setattr(export_gguf, "encode_tensor", every_matrix_in)
        return export_file(directory, model, tokenizer)


def file_tensors(path: Path) -> dict:
    return {tensor.name: tensor for tensor in open_gguf(path).tensors}


def rows_of(tensor) -> int:
    return int(tensor.shape[1])


def hf_order(name: str, values: torch.Tensor, config) -> torch.Tensor:
    """Llama's q or k rows back in Hugging Face's order: llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.
    permute) wrote file[i] = hf[index[i]], index the permutation applied to 0, 1, 2, ..."""
    if not name.endswith(("attn_q", "attn_k")):
        return values
    heads = config.n_head if name.endswith("attn_q") else config.n_kv_head
    rows = values.shape[0]
    index = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    ordered = torch.empty_like(values)
    ordered[torch.from_numpy(index)] = values
    return ordered


def product_sources(config, arch: str) -> dict[str, list[str]]:
    """Our product modules -> the file's weights each is made of."""
    parts = GPT2_PARTS if arch == "gpt2" else LLAMA_PARTS
    sources = {"lm_head": ["token_embd" if config.tie_embeddings else "output"]}
    for layer in range(config.n_layer):
        for ours, theirs in parts.items():
            sources[f"transformer.h.{layer}.{ours}"] = [f"blk.{layer}.{name}" for name in theirs]
    return sources


def float64_values(stored: dict, names: list[str], config, arch: str) -> torch.Tensor:
    """The float64 decoding of the blocks of `names` among a file's tensors (file_tensors), in our row order, rounded
    once to float32."""
    parts = []
    for name in names:
        tensor = stored[f"{name}.weight"]
        shape = (rows_of(tensor), int(tensor.shape[0]))
        values = torch.from_numpy(dequantized64(np.array(tensor.data), tensor.tensor_type, shape))
        parts.append(hf_order(name, values, config) if arch == "llama" else values)
    return torch.cat(parts).float()


def block_fields(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, d, m) of a Q4_0 or Q4_1 matrix's blocks, read as ggml lays them out (Q4_0's m: -8 d)."""
    header = 2 if tensor.tensor_type == T.Q4_0 else 4
    blocks = np.array(tensor.data).reshape(rows_of(tensor), -1, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = -8 * d if header == 2 else blocks[..., 2:4].copy().view(np.float16)[..., 0]
    return blocks[..., header:], d, m


def assert_holds_the_blocks(product: Int4Linear, tensor) -> None:
    codes, d, m = block_fields(tensor)
    assert np.array_equal(product.weight_int4.numpy(), codes)
    assert np.array_equal(product.scale.numpy().view(np.uint16), d.view(np.uint16))
    assert np.array_equal(product.minimum.numpy().view(np.uint16), m.view(np.uint16))


def products_of(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Int4Linear))}


ARCHS = {"gpt2": "gpt2", "llama-gqa-tied": "llama", "llama-untied": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# ------------------------------------------------------------------------------------------------ reading


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", sorted(ARCHS))
def test_a_q4_file_decodes_on_its_own_blocks_with_transformers_logits(
    tmp_path, monkeypatch, qwen_tokenizer, shape, qtype
):
    """Every product and the head in Q4_0 or Q4_1: --quantize=none (the default) keeps them as the file's blocks,
    byte for byte, whose values are the float64 decoding of the file's; the logits are transformers'."""
    path = q4_file(tmp_path, monkeypatch, tiny(shape), qwen_tokenizer, T[qtype])
    model = apply_quantization(load(str(path), tokenizer=False).model, "none")
    config, arch = model.config, ARCHS[shape]
    products = products_of(model)
    sources = product_sources(config, arch)
    assert set(products) == set(sources) and all(isinstance(m, Int4Linear) for m in products.values())
    stored = file_tensors(path)
    for name, product in products.items():
        expected = float64_values(stored, sources[name], config, arch)
        assert torch.equal(product.dequantized_weight(), expected), name
        if len(sources[name]) == 1 and not sources[name][0].endswith(("attn_q", "attn_k")):
            assert_holds_the_blocks(product, stored[f"{sources[name][0]}.weight"])
    torch.testing.assert_close(logits(model, IDX), transformers_model(path, shape)(IDX).logits, rtol=0, atol=1e-4)


# How far below the eager pass's largest logit (times the largest magnitude) the native int4 step's greedy token's may
# lie: the step rounds its inputs to 16 bits per group of 32 values, and an input rounded to a neighbouring step moves
# its logits by up to ~1.5e-4 of the largest (tests/infer/test_native.py's INT4_TOLERANCE): two logits closer than
# that tie, and either pass may take either.
TIE = 5e-4


def assert_greedy_up_to_ties(reference, prompt: list[int], output: list[int]) -> None:
    """Each token of `output` takes the reference's largest logit after the prompt and the tokens before it, or one
    within TIE of it."""
    tokens = list(prompt)
    for token in output:
        with torch.no_grad():
            step_logits = reference(torch.tensor([tokens]))[0][0, -1]
        assert step_logits[token] >= step_logits.max() - TIE * step_logits.abs().max()
        tokens.append(token)


@pytest.mark.parametrize("keep_int4", [False, True])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_the_native_int4_step_decodes_a_q4_file_as_the_eager_pass(
    tmp_path, monkeypatch, qwen_tokenizer, qtype, keep_int4
):
    """Blocks read into memory, or left in the file (keep_int4: the token embedding's rows read at each step); one
    request at a time, then two in one engine (steps of several rows, a prefill of two prompts). The greedy tokens
    are the eager pass's over the file's blocks, with each product's input rounded to 16 bits per group of 32 values
    as the native int4 products round it, up to ties (at the first prompt's eighth new token the Q4_0 model's top two
    logits lie 2e-5 of the largest apart: each pass takes one)."""
    path = q4_file(tmp_path, monkeypatch, tiny("llama-gqa-tied"), qwen_tokenizer, T[qtype])
    model = apply_quantization(load(str(path), tokenizer=False, keep_int4=keep_int4).model, "none")
    reference = with_16_bit_group_inputs(apply_quantization(load(str(path), tokenizer=False).model, "none"))
    for prompt in ([5, 9, 300], list(range(100, 117))):
        request = Request(prompt=prompt, max_new_tokens=12, temperature=0)
        list(Engine(model, decode="native").run([request]))
        assert len(request.output) == 12
        assert_greedy_up_to_ties(reference, prompt, request.output)
    requests = [Request(prompt=prompt, max_new_tokens=12, temperature=0) for prompt in ([7, 8, 9], [40, 41, 42])]
    list(Engine(model, slots=2, decode="native").run(requests))
    for request in requests:
        assert len(request.output) == 12
        assert_greedy_up_to_ties(reference, request.prompt, request.output)


def panel_bytes(model, record: int, head_record: int) -> int:
    """The bytes of the native step's int4 panels of `model`'s products (each layer's four, then the head): whole
    panels of rows, `record` bytes a row's group of 32 weights (the head's: `head_record`)."""
    rows = native.extension().int4_panel_rows()
    config = model.config
    qkv = (config.n_head + 2 * config.n_kv_head) * config.head_dim
    fc = (2 if config.activation == "swiglu" else 1) * config.mlp_hidden
    layer = [(qkv, config.n_embd), (config.n_embd, config.n_head * config.head_dim), (fc, config.n_embd)]
    layer.append((config.n_embd, config.mlp_hidden))
    shapes = [(*shape, record) for shape in layer * config.n_layer] + [(config.vocab_size, config.n_embd, head_record)]
    return sum(-(-out // rows) * rows * -(-columns // 32) * size for out, columns, size in shapes)


@pytest.mark.parametrize("keep_int4", [False, True])
def test_q4_0_blocks_are_packed_without_minimums_and_a_file_mixing_q4_1_in_with_them(
    tmp_path, monkeypatch, qwen_tokenizer, keep_int4
):
    """A file of Q4_0 products and head, read into memory or left in the file: the native step's panels take 18 bytes
    a row's group of 32 weights (a float16 scale and the codes; its minimums are -8 times its scales). One Q4_1 part
    of a fused product (blk.0's attn_k) among Q4_0 ones: the layers' panels keep every minimum (20 bytes), the head's
    (Q4_0) are of its own kind. Q4_0 products beside a Q8_0 embedding (export.py's q4_0 files), read for decoding
    (keep_int4): the layers' panels without minimums, the tied head's the file's Q8_0 blocks (34 bytes: 32 codes and
    a scale). Each file's greedy tokens are the eager pass's over its blocks, up to ties."""
    model = tiny("llama-gqa-tied")
    q4_0 = q4_file(tmp_path / "q4_0", monkeypatch, model, qwen_tokenizer, T.Q4_0)
    mixed = q4_file(tmp_path / "mixed", monkeypatch, model, qwen_tokenizer, T.Q4_0, {"blk.0.attn_k.weight": T.Q4_1})
    q8_0_head = q4_file(tmp_path / "q8", monkeypatch, model, qwen_tokenizer, T.Q4_0, {"token_embd.weight": T.Q8_0})
    files = [(q4_0, 18, 18), (mixed, 20, 18)] + ([(q8_0_head, 18, 34)] if keep_int4 else [])
    for path, record, head_record in files:
        read = apply_quantization(load(str(path), tokenizer=False, keep_int4=keep_int4).model, "none")
        assert NativeStep.for_model(read, torch.float32).matrices.numel() == panel_bytes(read, record, head_record)
        reference = with_16_bit_group_inputs(read)  # a copy of the same blocks, run eagerly
        request = Request(prompt=[5, 9, 300], max_new_tokens=12, temperature=0)
        list(Engine(read, decode="native").run([request]))
        assert_greedy_up_to_ties(reference, [5, 9, 300], request.output)


def float_matrices(model) -> set[str]:
    """The names of the model's floating-point parameters and buffers of two or more dimensions."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    return {name for name, tensor in tensors if tensor.is_floating_point() and tensor.dim() > 1}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", sorted(ARCHS))
def test_a_q4_file_read_for_decoding_leaves_its_matrices_in_the_file(
    tmp_path, monkeypatch, qwen_tokenizer, shape, qtype
):
    """keep_int4 (what the scripts that decode on the CPU ask for): every product and the head read their blocks
    from the file (FileInt4Linear), as does the token embedding (FileInt4Embedding); they are the file's blocks, byte
    for byte, whose values are the float64 decoding of the file's; the model holds no float matrix but its position
    tables; its logits are those of the model read in float32, exactly."""
    path = q4_file(tmp_path, monkeypatch, tiny(shape), qwen_tokenizer, T[qtype])
    model = load(str(path), tokenizer=False, keep_int4=True).model
    config, arch = model.config, ARCHS[shape]
    products, sources = products_of(model), product_sources(config, arch)
    assert set(products) == set(sources) and all(isinstance(m, FileInt4Linear) for m in products.values())
    assert isinstance(model.transformer.wte, FileInt4Embedding)
    stored = file_tensors(path)
    for name, product in products.items():
        assert torch.equal(product.dequantized_weight(), float64_values(stored, sources[name], config, arch)), name
        if len(sources[name]) == 1 and not sources[name][0].endswith(("attn_q", "attn_k")):
            assert_holds_the_blocks(product, stored[f"{sources[name][0]}.weight"])
    assert float_matrices(model) <= {"rope_cos", "rope_sin", "transformer.wpe.weight"}
    floats = load(str(path), tokenizer=False).model
    assert torch.equal(model.transformer.wte(IDX), floats.transformer.wte(IDX))
    assert torch.equal(logits(model, IDX), logits(floats, IDX))


@pytest.mark.parametrize("shape", sorted(ARCHS))
def test_a_q8_0_file_read_for_decoding_decodes_in_its_own_blocks(tmp_path, monkeypatch, qwen_tokenizer, shape):
    """keep_int4 on a file whose every matrix is Q8_0 (export.py's and llama.cpp's Q8_0 files): every product and the
    head read their blocks from the file (Int8GroupedLinear), the token embedding its rows (FileEmbedding); each
    product's weight is the float64 decoding of the file's blocks (Llama's q and k rows put back in order); no float
    matrix is held; the logits are those of the model read in float32, exactly; the native step decodes in those
    blocks, with the greedy tokens of the eager pass over them."""
    path = q4_file(tmp_path, monkeypatch, tiny(shape), qwen_tokenizer, T.Q8_0)
    model = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "none")
    config, arch = model.config, ARCHS[shape]
    sources, stored = product_sources(config, arch), file_tensors(path)
    for name, names in sources.items():
        product = model.get_submodule(name)
        assert isinstance(product, Int8GroupedLinear), name
        assert torch.equal(product.dequantized_weight(), float64_values(stored, names, config, arch)), name
    assert isinstance(model.transformer.wte, FileEmbedding)
    assert float_matrices(model) <= {"rope_cos", "rope_sin", "transformer.wpe.weight"}
    assert torch.equal(logits(model, IDX), logits(load(str(path), tokenizer=False).model, IDX))
    assert NativeStep.for_model(model, torch.float32).weights == "q8_0"
    request = Request(prompt=[5, 9, 300], max_new_tokens=12, temperature=0)
    list(Engine(model, decode="native").run([request]))
    assert_greedy_up_to_ties(with_16_bit_group_inputs(model), [5, 9, 300], request.output)


def test_q8_0_products_beside_a_head_of_another_type_decode_with_it_quantized_to_q8_0(
    tmp_path, monkeypatch, qwen_tokenizer
):
    """Q8_0 products and a Q6_K head, read for decoding: the products read their Q8_0 blocks from the file, the head
    its values quantized as they are read, gguf-py's Q8_0 blocks of the float32 read's head; no float matrix is held;
    the logits are the float32 read's with that head, and the native step's greedy tokens the eager pass's."""
    model = tiny("llama-untied", n_embd=256, n_head=4)  # K-quant blocks hold 256 values: a row's
    path = q4_file(tmp_path, monkeypatch, model, qwen_tokenizer, T.Q8_0, {"output.weight": T.Q6_K})
    kept = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "none")
    products = product_sources(kept.config, "llama")
    assert all(isinstance(kept.get_submodule(name), Int8GroupedLinear) for name in products)
    assert float_matrices(kept) <= {"rope_cos", "rope_sin"}
    floats = load(str(path), tokenizer=False).model
    expected = gguf_q8_0(floats.lm_head.weight)
    assert all(map(torch.equal, kept.lm_head.blocks(), expected))
    assert torch.equal(logits(kept, IDX), logits(with_head_of(floats, expected), IDX))
    request = Request(prompt=[5, 9, 300], max_new_tokens=12, temperature=0)
    list(Engine(kept, decode="native").run([request]))
    assert_greedy_up_to_ties(with_16_bit_group_inputs(kept), [5, 9, 300], request.output)


@pytest.mark.parametrize("shape", ["llama-untied", "qwen2", "gpt2"])
def test_products_in_other_types_read_for_decoding_stay_in_the_file_until_quantization(
    tmp_path, monkeypatch, qwen_tokenizer, shape
):
    """A file whose products are Q6_K and Q5_0 (llama.cpp's K-quant files mix types), read for decoding: every layer's
    product is a FileLinear, and so is the head (the file's output, or the Q6_K token embedding it is tied to), so no
    float matrix of theirs is held; under none they become the float32 read's Linear layers (the same logits,
    exactly); under int4 each is a FileInt4Linear whose blocks, quantized a slice at a time as they are read, are
    int4's of the float32 read, and the native step's panels are that model's."""
    hidden = {} if shape == "gpt2" else {"mlp_hidden": 512}  # GPT-2's MLP: 4 x 256
    model = tiny(shape, n_embd=256, n_head=4, **hidden)  # K-quant blocks hold 256 values: a row's
    others = {f"blk.{layer}.ffn_down.weight": T.Q5_0 for layer in range(model.config.n_layer)}
    path = q4_file(tmp_path, monkeypatch, model, qwen_tokenizer, T.Q6_K, others)
    kept = load(str(path), tokenizer=False, keep_int4=True).model
    layers = [name for name in product_sources(kept.config, ARCHS[shape]) if name != "lm_head"]
    assert all(isinstance(kept.get_submodule(name), FileLinear) for name in [*layers, "lm_head"])
    assert float_matrices(kept) <= {"rope_cos", "rope_sin", "transformer.wpe.weight"}
    floats = load(str(path), tokenizer=False).model
    assert torch.equal(logits(apply_quantization(kept, "none"), IDX), logits(floats, IDX))
    int4 = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "int4")
    reference = apply_quantization(floats, "int4")
    assert all(isinstance(int4.get_submodule(name), FileInt4Linear) for name in layers)
    for name in [*layers, "lm_head"]:
        assert all(map(torch.equal, int4.get_submodule(name).blocks(), reference.get_submodule(name).blocks())), name
    step = NativeStep.for_model(int4, torch.float32)
    assert torch.equal(step.matrices, NativeStep.for_model(reference, torch.float32).matrices)


@pytest.mark.parametrize("shape", ["gpt2", "llama-gqa-tied"])
def test_rows_read_from_the_file_are_those_of_the_blocks_read_whole(tmp_path, monkeypatch, qwen_tokenizer, shape):
    """A product left in the file reads any range of its rows (across its fused parts, and within a head of Llama's
    reordered q and k) as those rows of its blocks read whole into memory; the token embedding reads any rows, in any
    order; and the native step packed a slice of one panel at a time holds the same bytes as from blocks in memory."""
    path = q4_file(tmp_path, monkeypatch, tiny(shape), qwen_tokenizer, T.Q4_1)
    kept = load(str(path), tokenizer=False, keep_int4=True).model
    whole = apply_quantization(load(str(path), tokenizer=False).model, "none")
    for name, product in products_of(kept).items():
        blocks = whole.get_submodule(name).blocks()
        for start, stop in ((0, product.out_features), (3, 27), (17, 18), (5, 5)):
            expected = blocks.rows(lambda part, start=start, stop=stop: part[start:stop])
            assert all(map(torch.equal, product.row_blocks(start, stop), expected)), (name, start, stop)
    rows = [7, 0, 639, 7]
    assert torch.equal(kept.transformer.wte(torch.tensor(rows)), whole.transformer.wte.weight[rows])
    monkeypatch.setattr(native_step, "PACKED_WEIGHTS", 1)
    packed = NativeStep.for_model(kept, torch.float32).matrices
    assert torch.equal(packed, NativeStep.for_model(whole, torch.float32).matrices)


@pytest.mark.parametrize(
    ("shape", "head"),
    [("llama-untied", "output.weight"), ("llama-gqa-tied", "token_embd.weight"), ("gpt2", "output.weight")],
)
def test_a_q8_0_head_beside_q4_products_decodes_in_its_own_8_bits(tmp_path, monkeypatch, qwen_tokenizer, shape, head):
    """Q4_0 products and a Q8_0 head (as export.py's Q4_0 files keep it; a tied head is the token embedding), read for
    decoding (keep_int4) under none: the head stays in the file too, its blocks the file's byte for byte (as gguf's
    reader gives them) and its weight their float64 decoding; no float matrix is held (a tied head's table stays in
    the file); the logits are the float32 read's exactly, and the native step's greedy tokens the eager pass's over
    the same blocks. Under int4 the head is quantized to Q4_1 as int4 quantizes the model read in float32."""
    path = q4_file(tmp_path, monkeypatch, tiny(shape), qwen_tokenizer, T.Q4_0, {head: T.Q8_0})
    kept = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "none")
    floats = load(str(path), tokenizer=False).model
    stored = file_tensors(path)
    assert isinstance(kept.lm_head, Int8GroupedLinear)
    raw = np.array(stored[head].data).reshape(rows_of(stored[head]), -1, 34)
    blocks = kept.lm_head.blocks()
    assert np.array_equal(blocks.codes.numpy(), raw[..., 2:].view(np.int8))
    assert np.array_equal(blocks.scale.numpy().view(np.uint16), raw[..., :2].copy().view(np.uint16)[..., 0])
    expected = float64_values(stored, [head.removesuffix(".weight")], kept.config, ARCHS[shape])
    assert torch.equal(kept.lm_head.dequantized_weight(), expected)
    assert all(isinstance(product, FileInt4Linear) for product in products_of(kept).values())
    assert float_matrices(kept) <= {"rope_cos", "rope_sin", "transformer.wpe.weight"}
    assert torch.equal(logits(kept, IDX), logits(floats, IDX))
    request = Request(prompt=[5, 9, 300], max_new_tokens=12, temperature=0)
    list(Engine(kept, decode="native").run([request]))
    assert_greedy_up_to_ties(with_16_bit_group_inputs(kept), [5, 9, 300], request.output)
    int4 = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "int4")
    reference = apply_quantization(floats, "int4")
    assert all(map(torch.equal, int4.lm_head.blocks(), reference.lm_head.blocks()))
    step = NativeStep.for_model(int4, torch.float32)
    assert torch.equal(step.matrices, NativeStep.for_model(reference, torch.float32).matrices)


def gguf_q8_0(weight: torch.Tensor) -> Int8Blocks:
    """gguf-py's Q8_0 blocks of `weight` (rows, in: whole groups of 32)."""
    raw = gguf.quants.quantize(weight.detach().numpy(), T.Q8_0).reshape(weight.shape[0], -1, 34)
    scale = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0])
    return Int8Blocks(torch.from_numpy(raw[..., 2:].copy().view(np.int8)), scale)


def with_head_of(model, blocks: Int8Blocks):
    """`model` (in place, returned) with its head the Int8GroupedLinear of `blocks`."""
    rows, groups, _ = blocks.codes.shape
    model.lm_head = Int8GroupedLinear(lambda start, stop: blocks.rows(lambda part: part[start:stop]), rows, groups * 32)
    return model


@pytest.mark.parametrize(("shape", "embedding"), [("llama-gqa-tied", "Q5_0"), ("qwen2", "Q6_K"), ("gpt2", "Q5_1")])
def test_a_token_embedding_in_more_bits_stays_in_the_file_and_its_tied_head_is_quantized_to_q8_0(
    tmp_path, monkeypatch, qwen_tokenizer, shape, embedding
):
    """Q4_0 products and a tied token embedding in another type than Q8_0 (llama.cpp's Q4_0 files: Q6_K), read for
    decoding (keep_int4): the embedding stays in the file, its lookups of any rows in any order the float32 read's
    values exactly; the model holds no float matrix but its position tables; the head's blocks, quantized as the
    table is read, are gguf-py's Q8_0 blocks of the float32 read's table (nearer its precision than 4 bits), so the
    logits under none are the float32 read's with that head. Under int4 the head is int4's of the float32 read."""
    model = tiny(shape, n_embd=256, n_head=4, tie_embeddings=True)  # K-quant blocks hold 256 values: a row's
    path = q4_file(tmp_path, monkeypatch, model, qwen_tokenizer, T.Q4_0, {"token_embd.weight": T[embedding]})
    kept = load(str(path), tokenizer=False, keep_int4=True).model
    assert isinstance(kept.transformer.wte, FileEmbedding) and isinstance(kept.lm_head, Int8GroupedLinear)
    assert float_matrices(kept) <= {"rope_cos", "rope_sin", "transformer.wpe.weight"}
    floats = load(str(path), tokenizer=False).model
    rows = [639, 7, 0, 7, 300, 1]
    assert torch.equal(kept.transformer.wte(torch.tensor(rows)), floats.transformer.wte.weight[rows])
    assert torch.equal(kept.transformer.wte(IDX), floats.transformer.wte(IDX))
    expected = gguf_q8_0(floats.lm_head.weight)
    assert all(map(torch.equal, kept.lm_head.blocks(), expected))
    kept = apply_quantization(kept, "none")
    assert torch.equal(logits(kept, IDX), logits(with_head_of(floats, expected), IDX))
    assert NativeStep.for_model(kept, torch.float32).weights == "int4"
    int4 = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "int4")
    reference = apply_quantization(load(str(path), tokenizer=False).model, "int4")
    assert all(map(torch.equal, int4.lm_head.blocks(), reference.lm_head.blocks()))
    step = NativeStep.for_model(int4, torch.float32)
    assert torch.equal(step.matrices, NativeStep.for_model(reference, torch.float32).matrices)


def test_an_untied_token_embedding_in_q8_0_stays_in_the_file(tmp_path, monkeypatch, qwen_tokenizer):
    """A Q8_0 token embedding beside its own Q4_0 head, read for decoding: the embedding stays in the file (no float
    matrix but the position tables), its lookups the float32 read's values, the logits under none those of the
    float32 read under int4."""
    path = q4_file(tmp_path, monkeypatch, tiny("llama-untied"), qwen_tokenizer, T.Q4_0, {"token_embd.weight": T.Q8_0})
    kept = load(str(path), tokenizer=False, keep_int4=True).model
    assert isinstance(kept.transformer.wte, FileEmbedding) and float_matrices(kept) <= {"rope_cos", "rope_sin"}
    floats = load(str(path), tokenizer=False).model
    assert torch.equal(kept.transformer.wte(IDX), floats.transformer.wte(IDX))
    kept, reference = apply_quantization(kept, "none"), apply_quantization(floats, "int4")
    assert torch.equal(logits(kept, IDX), logits(reference, IDX))


def test_a_token_past_a_file_embeddings_table_is_an_index_error(tmp_path, monkeypatch, qwen_tokenizer):
    """A lookup (the module's or the decoding step's) of a row outside the table reads nothing past it."""
    path = q4_file(tmp_path, monkeypatch, tiny("llama-untied"), qwen_tokenizer, T.Q4_0, {"token_embd.weight": T.Q8_0})
    embedding = load(str(path), tokenizer=False, keep_int4=True).model.transformer.wte
    for row in (embedding.num_embeddings, -1):
        with pytest.raises(IndexError, match="past the embedding"):
            embedding(torch.tensor([0, row]))
        with pytest.raises(IndexError, match="past the embedding"):
            embedding.lookup([row])


def test_a_tied_q8_0_embedding_beside_float_products_is_read_as_float32_for_the_head(
    tmp_path, monkeypatch, qwen_tokenizer
):
    """A tied Q8_0 token embedding where a product is Q8_0 too (so the model does not decode in 4 bits): the head is
    the float32 table, the embedding's lookups read the file, and the logits under none are the float32 read's."""
    others = {"token_embd.weight": T.Q8_0, "blk.0.ffn_up.weight": T.Q8_0}
    path = q4_file(tmp_path, monkeypatch, tiny("llama-gqa-tied"), qwen_tokenizer, T.Q4_0, others)
    kept = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "none")
    floats = load(str(path), tokenizer=False).model
    assert isinstance(kept.transformer.wte, FileEmbedding) and type(kept.lm_head) is torch.nn.Linear
    assert torch.equal(kept.lm_head.weight, floats.lm_head.weight)
    assert torch.equal(logits(kept, IDX), logits(floats, IDX))


def test_a_q4_file_read_for_decoding_costs_a_fraction_of_its_size_and_packs_beside_nothing(
    tmp_path, monkeypatch, qwen_tokenizer
):
    """Measured: a Q4_0 file of some 29M weights (float32: 7 times the file) read with keep_int4 raises the
    process's peak resident memory by less than half the file (a copy of its blocks would be the whole file; what else
    a read allocates varies with what the process ran before), where reading it in float32 raises it by more
    than its float32 weights; packing the native step's int4 panels from the file then raises it by the panels and
    less than half the file more (no copy of the blocks beside them)."""
    native.extension()  # built and loaded before anything is measured
    source = lively_model(**{**ROPE, "vocab_size": 640, "n_layer": 4, "n_embd": 512, "mlp_hidden": 4096})
    path = q4_file(tmp_path, monkeypatch, source, qwen_tokenizer, T.Q4_0)
    del source
    size, weights = path.stat().st_size, sum(int(np.prod(t.shape)) for t in file_tensors(path).values())
    floats, rise = peak_rise(lambda: load(str(path), tokenizer=False).model)
    assert rise > 4 * weights
    del floats

    def read_int4() -> torch.nn.Module:
        return apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "none")

    read_int4()  # once unmeasured: what the first read imports or caches is not the read's cost
    model, rise = peak_rise(read_int4)
    assert rise < size / 2
    step, rise = peak_rise(lambda: NativeStep.for_model(model, torch.float32))
    assert step.matrices.numel() < rise < step.matrices.numel() + size / 2


def test_products_in_other_types_quantized_to_int4_as_they_are_read_hold_no_float32_copy(
    tmp_path, monkeypatch, qwen_tokenizer
):
    """Measured: a file of Q6_K products (some 29M weights), read for decoding under int4 and packed into the native
    step's panels, raises the process's peak resident memory by less than half its float32 weights (each product is
    quantized a slice of rows at a time as the packing reads it), where reading it in float32 raises it by more than
    them."""
    native.extension()  # built and loaded before anything is measured
    source = lively_model(**{**ROPE, "vocab_size": 640, "n_layer": 4, "n_embd": 512, "mlp_hidden": 4096})
    path = q4_file(tmp_path, monkeypatch, source, qwen_tokenizer, T.Q6_K)
    del source
    weights = sum(int(np.prod(t.shape)) for t in file_tensors(path).values())
    floats, rise = peak_rise(lambda: load(str(path), tokenizer=False).model)
    assert rise > 4 * weights
    del floats

    def read_and_pack() -> NativeStep:
        model = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "int4")
        return NativeStep.for_model(model, torch.float32)

    read_and_pack()  # once unmeasured: what the first read imports or caches is not the read's cost
    step, rise = peak_rise(read_and_pack)
    assert step.weights == "int4" and rise < 2 * weights


def test_sample_py_decodes_a_q4_file_natively_as_transformers_does(tmp_path, monkeypatch, qwen_tokenizer, capsys):
    path = q4_file(tmp_path / "model", monkeypatch, tiny("qwen2"), qwen_tokenizer, T.Q4_1)
    start = "def square(x):"
    expected = start + greedy_text(path, qwen_tokenizer.encode(start), 12, set()) + "\n"
    args = cli_args(init_from=path, start=start, max_new_tokens=12, temperature=0, stop_at_eot=False)
    result = run_in_process(sample.main, [*args, "--stream=False", "--device=cpu", "--decode=native"], capsys)
    assert result.returncode == 0, result.stderr
    assert result.stdout.replace("\ufffd", "") == expected.replace("\ufffd", "")  # see test_gguf_read


def test_a_file_of_other_types_too_loads_in_float_and_int4_keeps_its_q4_blocks(tmp_path, monkeypatch, qwen_tokenizer):
    """Products in Q4_0 and the head in Q8_0 (llama.cpp's Q4_0 files keep the head in more bits): none keeps the
    file's precision (float32 values, not 4-bit: the products are not all 4-bit); int4 takes the products' blocks as
    they are and quantizes the head; a weight changed since it was read (trained) is quantized anew."""
    path = q4_file(tmp_path, monkeypatch, tiny("llama-untied"), qwen_tokenizer, T.Q4_0, {"output.weight": T.Q8_0})
    floats = load(str(path), tokenizer=False).model
    kept = apply_quantization(load(str(path), tokenizer=False).model, "none")
    assert not any(isinstance(m, Int4Linear) for m in kept.modules())
    torch.testing.assert_close(logits(kept, IDX), logits(floats, IDX), rtol=0, atol=0)

    int4 = apply_quantization(load(str(path), tokenizer=False).model, "int4")
    stored, products = file_tensors(path), products_of(int4)
    assert all(isinstance(m, Int4Linear) for m in products.values())
    for name, product in products.items():
        weight = floats.get_submodule(name).weight
        if name == "lm_head":  # Q8_0's values, quantized as those of a plain Linear are
            assert all(map(torch.equal, product.blocks(), Int4Linear.from_linear(plain_linear(weight)).blocks()))
            continue
        assert torch.equal(product.dequantized_weight(), weight), name  # the file's values, not re-quantized ones
    assert_holds_the_blocks(products["transformer.h.0.mlp.c_proj"], stored["blk.0.ffn_down.weight"])
    requantized = Int4Linear.from_linear(plain_linear(floats.transformer.h[0].mlp.c_proj.weight))
    assert not torch.equal(requantized.dequantized_weight(), floats.transformer.h[0].mlp.c_proj.weight)

    trained = load(str(path), tokenizer=False).model
    with torch.no_grad():
        trained.transformer.h[0].attn.c_proj.weight.add_(1e-3)
    changed = trained.transformer.h[0].attn.c_proj.weight.detach().clone()
    apply_quantization(trained, "int4")
    expected = Int4Linear.from_linear(plain_linear(changed))
    assert torch.equal(trained.transformer.h[0].attn.c_proj.weight_int4, expected.weight_int4)
    assert isinstance(
        apply_quantization(load(str(path), tokenizer=False).model, "int8").lm_head, Int8Linear
    )  # as before


def plain_linear(weight: torch.Tensor) -> torch.nn.Linear:
    """An nn.Linear of `weight` that was read from no blocks."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def test_an_all_q4_file_with_a_weight_changed_since_stays_in_float(tmp_path, monkeypatch, qwen_tokenizer):
    path = q4_file(tmp_path, monkeypatch, tiny("qwen3"), qwen_tokenizer, T.Q4_1)
    model = load(str(path), tokenizer=False).model
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1.5)
    apply_quantization(model, "none")
    assert not any(isinstance(m, Int4Linear) for m in model.modules())


# ------------------------------------------------------------------------------------------------ writing


@pytest.mark.parametrize("outtype", ["q4_0", "q4_1"])
@pytest.mark.parametrize("shape", ["gpt2", "llama-gqa-tied", "llama-untied", "qwen3"])
def test_export_q4_writes_the_products_in_4_bits_and_reads_back_with_transformers_logits(
    tmp_path, qwen_tokenizer, shape, outtype
):
    """The products are gguf-py's own quantization of the model's weights; the head (the token embedding when tied)
    is Q8_0, an untied token embedding in 4 bits as llama.cpp's quantizer has it, norms and biases F32."""
    source = tiny(shape)
    path = export_file(tmp_path, source, qwen_tokenizer, outtype)
    qtype = T[outtype.upper()]
    stored = file_tensors(path)
    head = "token_embd.weight" if source.config.tie_embeddings else "output.weight"
    for name, tensor in stored.items():
        if name == head:
            assert tensor.tensor_type == T.Q8_0
        elif len(tensor.shape) == 2 and name != "position_embd.weight":
            assert tensor.tensor_type == qtype, name
        else:
            assert tensor.tensor_type == T.F32, name
    down = source.transformer.h[1].mlp.c_proj.weight.detach().numpy()
    assert np.array_equal(np.array(stored["blk.1.ffn_down.weight"].data), gguf.quants.quantize(down, qtype))
    ours = apply_quantization(load(str(path), tokenizer=False).model, "none")
    torch.testing.assert_close(logits(ours, IDX), transformers_model(path, shape)(IDX).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("outtype", ["q4_0", "q4_1"])
def test_an_int4_model_exports_its_blocks_as_they_are(tmp_path, qwen_tokenizer, outtype):
    """quantize_int4's blocks (Q4_1's) go into the file unchanged under either outtype, the head's too; read back,
    every product holds them again, and the logits are transformers'."""
    source = apply_quantization(tiny("llama-untied"), "int4")
    path = export_file(tmp_path, source, qwen_tokenizer, outtype)
    stored = file_tensors(path)
    assert stored["output.weight"].tensor_type == T.Q4_1 and stored["blk.0.attn_q.weight"].tensor_type == T.Q4_1
    assert_holds_the_blocks(source.lm_head, stored["output.weight"])
    back = apply_quantization(load(str(path), tokenizer=False).model, "none")
    for name, product in products_of(back).items():
        original = source.get_submodule(name)
        assert isinstance(product, Int4Linear), name
        for field in ("weight_int4", "scale", "minimum"):
            assert torch.equal(getattr(product, field), getattr(original, field)), (name, field)
    torch.testing.assert_close(logits(back, IDX), transformers_model(path, "llama")(IDX).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("shape", ["gpt2", "llama-gqa-tied", "llama-untied"])
def test_a_q4_0_file_read_and_exported_as_q4_0_is_the_same_blocks(tmp_path, monkeypatch, qwen_tokenizer, shape):
    path = q4_file(tmp_path / "first", monkeypatch, tiny(shape), qwen_tokenizer, T.Q4_0)
    again = export_file(tmp_path / "again", load(str(path), tokenizer=False).model, qwen_tokenizer, "q4_0")
    first, second = file_tensors(path), file_tensors(again)
    matrices = [name for name, tensor in first.items() if tensor.tensor_type == T.Q4_0]
    assert len(matrices) >= 9
    for name in matrices:
        assert second[name].tensor_type == T.Q4_0, name
        assert np.array_equal(np.array(second[name].data), np.array(first[name].data)), name


# ------------------------------------------------------------------------------------------------ QLoRA


def test_lora_over_a_q4_file_holds_the_file_s_blocks(tmp_path, monkeypatch, qwen_tokenizer):
    path = q4_file(tmp_path, monkeypatch, tiny("llama-gqa-tied"), qwen_tokenizer, T.Q4_1)
    int4 = apply_quantization(load(str(path), tokenizer=False).model, "none")
    adapted = add_lora(load(str(path), tokenizer=False).model, LoraConfig(rank=4, targets="all"), base_weights="int4")
    layers = {name: m for name, m in adapted.named_modules() if isinstance(m, LoraLinear)}
    assert len(layers) == 4 * adapted.config.n_layer
    for name, layer in layers.items():
        product = int4.get_submodule(name)
        assert layer.weight is None
        assert torch.equal(layer.weight_int4, product.weight_int4) and torch.equal(layer.weight_scale, product.scale)
        assert torch.equal(layer.weight_minimum, product.minimum)
    torch.testing.assert_close(logits(adapted, IDX), logits(int4, IDX), rtol=0, atol=1e-6)  # B = 0: the base


@pytest.mark.parametrize("shape", ["qwen2", "llama-gqa-tied"])
def test_qlora_from_a_q4_file_left_in_it_is_the_model_of_a_float32_read(tmp_path, monkeypatch, qwen_tokenizer, shape):
    """load's int4_products (train.py's QLoRA set-up) and add_lora give the model that a float32 read and add_lora
    give, tensor for tensor: every product's blocks (the file's; attention targets only, so the MLP's are held as
    the base without adapters), the embedding and the head, the adapters' initial values."""
    path = q4_file(tmp_path, monkeypatch, tiny(shape), qwen_tokenizer, T.Q4_1)
    config = LoraConfig(rank=4, targets="attention")
    models = []
    for int4_products in (False, True):
        model = load(str(path), tokenizer=False, int4_products=int4_products).model
        torch.manual_seed(0)
        models.append(add_lora(model, config, base_weights="int4"))
    read, left = (model.state_dict() for model in models)
    assert read.keys() == left.keys() and all(torch.equal(read[key], left[key]) for key in read)
    assert not any(isinstance(module, Int4Linear) for module in models[1].modules())
    torch.testing.assert_close(logits(models[1], IDX), logits(models[0], IDX), rtol=0, atol=0)


def test_qlora_from_a_q4_file_never_holds_its_products_in_float32(tmp_path, monkeypatch, qwen_tokenizer):
    """Measured: QLoRA's set-up (load with int4_products, then add_lora over every product) raises the process's
    peak resident memory by less than a third of the products' float32 bytes (their blocks, held as Q4_1's, are 0.16
    of them; the largest product alone in float32, a seventh), where a float32 read and add_lora raise it by
    more than those bytes."""
    source = lively_model(**{**ROPE, "vocab_size": 640, "n_layer": 4, "n_embd": 512, "mlp_hidden": 4096})
    path = q4_file(tmp_path, monkeypatch, source, qwen_tokenizer, T.Q4_0)
    products = 4 * sum(
        m.weight.numel()
        for name, m in source.named_modules()
        if ".h." in f".{name}" and hasattr(m, "weight") and m.weight.dim() == 2
    )
    float32_rise, int4_rise = qlora_set_up_peaks(path)
    assert float32_rise > products
    assert int4_rise < products / 3, int4_rise / products


@pytest.mark.heavy
def test_train_py_lora_over_a_q4_file_learns_and_merges_to_its_blocks_plus_the_adapters(
    tmp_path, monkeypatch, qwen_tokenizer, capsys
):
    """--lora_base_weights=int4 from a Q4_1 file: the loss falls, the checkpoint names the file (path and sha256) and
    the base precision, and export.py's merged checkpoint is the file's values plus the adapters' update."""
    path = q4_file(tmp_path / "model", monkeypatch, tiny("qwen2", block_size=64), qwen_tokenizer, T.Q4_1)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS), encoding="utf-8")
    data = tmp_path / "data"
    code, _, err = run_main(chat_script.main, [f"--input={chats}", f"--out_dir={data}", f"--tokenizer={path}"], capsys)
    assert code == 0, err
    run = tmp_path / "run"
    settings = {**TRAIN, "max_iters": 12, "eval_interval": 12, "learning_rate": 1e-2}
    lora = dict(lora_rank=4, lora_alpha=8.0, lora_targets="all", lora_base_weights="int4")
    code, _, err = run_main(
        train.main, cli_args(init_from=path, data_dir=data, out_dir=run, **settings, **lora), capsys
    )
    assert code == 0, err
    evals = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    losses = [entry["val/loss"] for entry in evals if "val/loss" in entry]
    assert len(losses) == 2 and losses[1] < losses[0] - 0.1, losses
    checkpoint = load_checkpoint(run / "ckpt.pt")
    assert checkpoint["lora"]["base"] == base_reference(str(path))
    assert checkpoint["lora"]["base_weights"] == "int4"

    merged_dir = tmp_path / "merged"
    args = ["--format=merged", f"--out_dir={run}", "--checkpoint=latest", f"--export_dir={merged_dir}"]
    done = run_in_process(export.main, args, capsys)
    assert done.returncode == 0, done.stderr
    merged = load_checkpoint(merged_dir / "ckpt.pt")["model"]
    base = load(str(path), tokenizer=False).model
    for layer in range(base.config.n_layer):
        for product in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            name = f"transformer.h.{layer}.{product}"
            a, b = checkpoint["model"][f"{name}.lora_A"].double(), checkpoint["model"][f"{name}.lora_B"].double()
            expected = base.get_submodule(name).weight.double() + 2.0 * (b @ a)  # alpha / rank = 8 / 4
            torch.testing.assert_close(merged[f"{name}.weight"].double(), expected, rtol=0, atol=1e-6)


def test_a_tied_q8_0_embedding_read_for_decoding_leaves_no_table_resident(tmp_path, monkeypatch, qwen_tokenizer):
    """Measured: the model read with keep_int4 from a Q4_0 file whose tied embedding (16384 x 512) is Q8_0 holds
    less than half of that table's float32 bytes resident (freeing it gives back no more; the head reads its Q8_0
    blocks from the file too), where a float32 table would hold more than the table. (What freeing gives back moves by
    megabytes with the heap's layout, whatever else lay on the pages freed: a quarter of the table was within
    that.)"""
    source = lively_model(**{**ROPE, "vocab_size": 16384, "n_embd": 512, "mlp_hidden": 1024, "tie_embeddings": True})
    path = q4_file(tmp_path, monkeypatch, source, qwen_tokenizer, T.Q4_0, {"token_embd.weight": T.Q8_0})
    del source
    table = 16384 * 512 * 4
    model = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "none")
    assert torch.equal(
        model.transformer.wte(torch.tensor([5])),
        load(str(path), tokenizer=False).model.transformer.wte(torch.tensor([5])),
    )
    gc.collect()
    release_freed_memory()
    held = process_memory("VmRSS")
    del model
    gc.collect()
    release_freed_memory()
    assert held - process_memory("VmRSS") < table / 2
