"""GGUF files that llama.cpp's own quantizer wrote (llama_cpp.llama_model_quantize, from the f32 file our exporter
wrote) read back with transformers' logits on the same file, for every architecture we export (the Q8_0 and Q4_0
files read for decoding too, in their own blocks, and the Q4_K_M one under int4), and with its tokenizer ids. Slow: needs llama-cpp-python, built from source
(pip install llama-cpp-python)."""

from __future__ import annotations

import copy
import ctypes
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.data.gguf_tokenizer import load_gguf_tokenizer, open_gguf
from gptkit.data.hf_tokenizer import load_hf_tokenizer
from gptkit.infer.engine import Engine, Request
from gptkit.weights import export_gguf, gguf_hf_tokenizer, load
from gptkit.weights.gguf_read import matrix_sources, read_tensors
from gptkit.weights.quantization import FileInt4Linear, Int8GroupedLinear, apply_quantization, block_products
from helpers import with_16_bit_group_inputs
from hf_tokenizer_dirs import VARIED, write_family

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from test_gguf_q4 import assert_greedy_up_to_ties  # noqa: E402
from test_gguf_read import (  # noqa: E402
    IDX,
    OTHER_SCALES,
    OTHER_TYPES,
    SHAPES,
    encode_as,
    export_file,
    logits,
    tiny,
    transformers_model,
)

# llama.cpp's file types (llama.h's LLAMA_FTYPE_MOSTLY_*) and the block type each writes for most matrices: those
# its quantizer writes without an importance matrix.
FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
FILE_TYPES |= {"Q2_K": 10, "Q3_K_M": 12, "IQ3_M": 27, "IQ4_NL": 25, "IQ4_XS": 30, "TQ2_0": 37}
MAIN_TYPE = {"Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K"}
MAIN_TYPE |= {
    "Q2_K": "Q2_K",
    "Q3_K_M": "Q3_K",
    "IQ3_M": "IQ3_S",
    "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS",
    "TQ2_0": "TQ2_0",
}


# K-quant super-blocks hold 256 weights a row: a model 256 wide (a SwiGLU MLP 512 wide, GPT-2's 1024) keeps
# llama.cpp from falling back to other types for most of its matrices.
def wide(shape: str) -> dict:
    return dict(n_embd=256) if shape == "gpt2" else dict(n_embd=256, mlp_hidden=512)


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    """A Qwen2-style byte-level BPE with ChatML."""
    return load_hf_tokenizer(write_family(tmp_path_factory.mktemp("tokenizer") / "qwen2", "qwen2"))


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)")


def quantize(llama_cpp, source: Path, file_type: str) -> Path:
    """The file llama.cpp's quantizer writes from `source` as `file_type`."""
    target = source.parent / f"{source.stem}-{file_type}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) == 0
    return target


def tensor_types(path: Path) -> set[str]:
    return {tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors if tensor.data.ndim > 1}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_llama_cpp_s_quantized_files_read_with_transformers_logits(tmp_path, llama_cpp, qwen_tokenizer, shape):
    source = export_file(tmp_path, tiny(shape, **wide(shape)), qwen_tokenizer)
    for file_type in FILE_TYPES:
        path = quantize(llama_cpp, source, file_type)
        assert MAIN_TYPE[file_type] in tensor_types(path), file_type
        ours = load(str(path), tokenizer=False).model
        expected = transformers_model(path, shape)(IDX).logits
        # 1e-4, plus float32's rounding of logits this model makes up to ~70 (each of the two float32 passes is
        # about 1.5e-4 from a float64 pass over the same dequantized weights there)
        torch.testing.assert_close(logits(ours, IDX), expected, rtol=2e-6, atol=1e-4, msg=file_type)
        if file_type in ("Q8_0", "Q4_0"):  # read for decoding: every product in its own blocks
            assert_decodes_in_its_blocks(path, ours, file_type)
        if file_type == "Q4_K_M":  # read for decoding under int4: Q4_K's codes kept, the rest quantized as read
            assert_int4_of_k_quants(path, ours)


def assert_int4_of_k_quants(path: Path, floats) -> None:
    """A Q4_K_M file under int4: its Q4_K products keep their codes and group scales, each weight the file's value
    within float16's rounding of a scale and a minimum; the others (Q6_K, Q5_K) are the int4 blocks of their values,
    as quantize_int4 makes them of the float32 model's."""
    int4 = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "int4")
    reference = apply_quantization(copy.deepcopy(floats), "int4")
    reader = gguf.GGUFReader(path)
    q4_k = {tensor.name for tensor in reader.tensors if tensor.tensor_type.name == "Q4_K"}
    sources = matrix_sources(floats.config, reader.fields["general.architecture"].contents())
    kept = 0
    for name in [*block_products(reference), "lm_head"]:
        blocks = int4.get_submodule(name).blocks()
        if not q4_k.issuperset(f"{part}.weight" for part in sources.get(name, ("token_embd",))):
            assert all(map(torch.equal, blocks, reference.get_submodule(name).blocks())), name
            continue
        codes, scale, minimum = (part.double() for part in blocks)
        codes = torch.cat([codes.to(torch.uint8) & 15, codes.to(torch.uint8) >> 4], dim=-1).double()
        values = (scale[..., None] * codes + minimum[..., None]).flatten(1)
        weight = floats.get_submodule(name).weight.double()
        rounding = ((15 * scale.abs() + minimum.abs())[..., None] * 2**-11).expand(*scale.shape, 32).flatten(1)
        assert ((values[:, : weight.shape[1]] - weight).abs() <= rounding[:, : weight.shape[1]] + 1e-7).all(), name
        kept += 1
    assert kept > 0


def assert_decodes_in_its_blocks(path: Path, floats, file_type: str) -> None:
    """A Q8_0 file read for decoding: every product and the head in its own Q8_0 blocks, with the float32 read's
    logits exactly. A Q4_0 file (its head in Q6_K): the products in its Q4_0 blocks, the head quantized to Q8_0 as it
    is read. The native step's greedy tokens are the eager pass's over the same blocks, up to ties."""
    kept = apply_quantization(load(str(path), tokenizer=False, keep_int4=True).model, "none")
    layer = Int8GroupedLinear if file_type == "Q8_0" else FileInt4Linear
    assert all(isinstance(kept.get_submodule(name), layer) for name in block_products(floats))
    assert isinstance(kept.lm_head, Int8GroupedLinear)
    if file_type == "Q8_0":
        assert torch.equal(logits(kept, IDX), logits(floats, IDX))
    request = Request(prompt=[5, 9, 300], max_new_tokens=12, temperature=0)
    list(Engine(kept, decode="native").run([request]))
    assert_greedy_up_to_ties(with_16_bit_group_inputs(kept), [5, 9, 300], request.output)


@pytest.mark.slow
def test_the_other_quants_read_as_llama_cpp_s_own_code_dequantizes_them(
    tmp_path, monkeypatch, llama_cpp, qwen_tokenizer
):
    """Each matrix of test_gguf_read's file of Q2_K, Q3_K, I-quants and ternary quants reads as llama.cpp's own C
    dequantizes its rows (ggml's dequantize_row_*, beside the gguf package's numpy code that the reader uses)."""
    written: dict = {}
    monkeypatch.setattr(export_gguf, "encode_tensor", partial(encode_as, OTHER_TYPES, written))
    path = export_file(tmp_path, tiny("llama-untied", n_layer=2, n_embd=256, mlp_hidden=256), qwen_tokenizer)
    assert sorted(qtype for _, qtype, _ in written.values()) == sorted(OTHER_SCALES)
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    reader, tensors = gguf.GGUFReader(path), read_tensors(open_gguf(path), path)
    for tensor in reader.tensors:
        if tensor.name not in written:
            continue
        dequantize_row = getattr(ggml, f"dequantize_row_{tensor.tensor_type.name.lower().replace('_k', '_K')}")
        raw = np.ascontiguousarray(tensor.data).view(np.uint8)
        values = np.empty(tensor.n_elements, np.float32)
        dequantize_row(
            raw.ctypes.data_as(ctypes.c_void_p),
            values.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_int64(tensor.n_elements),
        )
        expected = torch.from_numpy(values.reshape(tensors.shape(tensor.name)))
        torch.testing.assert_close(tensors[tensor.name], expected, rtol=1e-6, atol=1e-9, msg=tensor.name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, name, opens", [("gpt2", "mellum", False), ("llama3", "falcon3", True), ("qwen2", "megrez", False)]
)
def test_llama_cpp_tokenizes_a_pre_tokenizer_s_other_names_as_we_read_them(
    tmp_path, monkeypatch, llama_cpp, family, name, opens
):
    """A file naming its pre-tokenizer by another of llama.cpp's names for the family's regexes, and saying nothing
    of bos: llama.cpp's ids are ours, and it opens a text with bos where our reading, written back, says so."""
    monkeypatch.setattr(gguf_hf_tokenizer, "pre_tokenizer_name", lambda spec: name)
    monkeypatch.setattr(gguf.GGUFWriter, "add_add_bos_token", lambda writer, value: None)
    path = export_file(tmp_path, tiny("llama-untied"), load_hf_tokenizer(write_family(tmp_path / "source", family)))
    ours = load_gguf_tokenizer(path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    opening = [ours.named_token_id("bos_token")] if opens else []
    for text in VARIED:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ours.encode(text), text
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == opening + ours.encode(text), text
    monkeypatch.undo()
    back = export_file(tmp_path / "back", tiny("llama-untied"), ours)
    assert bool(open_gguf(back).fields["tokenizer.ggml.add_bos_token"].contents()) is opens


@pytest.mark.slow
def test_a_quantized_file_s_tokenizer_gives_transformers_ids(tmp_path, llama_cpp, qwen_tokenizer):
    source = export_file(tmp_path, tiny("qwen2", **wide("qwen2")), qwen_tokenizer)
    path = quantize(llama_cpp, source, "Q4_K_M")
    ours = load_gguf_tokenizer(path)
    auto = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in VARIED:
        assert ours.encode_with_added(text) == auto.encode(text, add_special_tokens=False), text
        assert ours.encode(text) == qwen_tokenizer.encode(text), text
    assert ours.chat is not None and ours.chat.source == qwen_tokenizer.chat.source
