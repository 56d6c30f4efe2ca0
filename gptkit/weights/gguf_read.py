"""GGUF in: a llama.cpp file of GPT-2, Llama, Qwen2 or Qwen3 read as our GPT, by way of the Hugging Face form of the
same model: its metadata become the config.json dict and its tensors the Hugging Face-named tensors that
gptkit/weights/hf.py's mapping (config_args, state_from_hf) turns into our model, so there is one mapping.

What llama.cpp's converter changed is undone here. Llama's q and k rows: it reorders each head's rows so that rotary
pairs are adjacent (Qwen2 and Qwen3 rotate halves as Hugging Face does, so theirs are kept). GPT-2's four projection
matrices: it stores them as nn.Linear's (out, in) where GPT-2's Conv1D holds (in, out). Llama 3's rope scaling: it
stores one factor per rotary frequency (rope_freqs), read back as the llama3 parameters that give those factors. A
head that is missing or holds the token embedding itself is tied to it.

Tensors may be of any type llama.cpp's quantizer writes for such a model (TENSOR_TYPES: float, Q4_0 to Q8_0, the K-,
I- and ternary quants): each is dequantized to float32 with llama.cpp's `gguf` package, one at a time, into a model
made without weights (so the float32 model is the only copy of them). A product (or the token embedding) stored as
Q4_0 or Q4_1 also keeps its blocks, byte for byte, in Int4Linear's layout (keep_q4_blocks): int4 then runs on the
file's own blocks, and a file whose every product and head is so stored decodes in them by default
(gptkit.weights.quantization). Or, for decoding on the CPU (keep_int4), those matrices are never float32: each stays
in the file, read as it is needed (keep_in_file), and so do a Q8_0 file's products (q8_0_layers) and the head beside
either, in its own Q8_0 blocks or quantized to Q8_0 from another type as it is read (head_in_file). Products in other
types (K- and I-quants, Q5_x) stay in the file until quantization asks for their values (FileLinear): float32 under
none, int4 a slice at a time under int4.

The tensors are read with plain reads at their offsets (TensorFile), not through a memory map: every page read
through a map would count in the process's resident memory while the map lives. Any other type, another
architecture, one part of a split file, a damaged file or weights holding NaN or infinity is a UserError of one
line. The tokenizer: gptkit/data/gguf_tokenizer.py.
"""

from __future__ import annotations

import math
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from gptkit.core.errors import UserError
from gptkit.data.gguf_tokenizer import gguf_tokenizer_record, metadata, open_gguf
from gptkit.model import GPT, GPTConfig, scaled_frequencies
from gptkit.weights.checkpoint import all_finite, check_finite, model_for_weights
from gptkit.weights.hf import config_args, state_from_hf
from gptkit.weights.quantization import (
    FileEmbedding,
    FileInt4Embedding,
    FileInt4Linear,
    FileLinear,
    Int4Blocks,
    Int8Blocks,
    Int8GroupedLinear,
    keep_int4_blocks,
    quantize_q8_0_slices,
    quantize_row_slices,
)

ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
TENSOR_TYPES = (
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
    *("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"),
    *("TQ1_0", "TQ2_0"),
)
FLOAT_TYPES = ("F32", "F16", "BF16")
DAMAGED = "the file is damaged; download or export the model again"

# llama.cpp's tensor names (without .weight / .bias) -> the Hugging Face module of each architecture.
GPT2_NAMES = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
    "blk.{i}.attn_norm": "transformer.h.{i}.ln_1",
    "blk.{i}.attn_qkv": "transformer.h.{i}.attn.c_attn",
    "blk.{i}.attn_output": "transformer.h.{i}.attn.c_proj",
    "blk.{i}.ffn_norm": "transformer.h.{i}.ln_2",
    "blk.{i}.ffn_up": "transformer.h.{i}.mlp.c_fc",
    "blk.{i}.ffn_down": "transformer.h.{i}.mlp.c_proj",
}
LLAMA_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")  # stored (out, in); GPT-2's Conv1D holds (in, out)
# Each block's products -> llama.cpp's weights that each fuses, in order (GPT-2's, and the Llama family's).
GPT2_PRODUCTS = {
    "attn.c_attn": ("attn_qkv",),
    "attn.c_proj": ("attn_output",),
    "mlp.c_fc": ("ffn_up",),
    "mlp.c_proj": ("ffn_down",),
}
LLAMA_PRODUCTS = {
    "attn.c_attn": ("attn_q", "attn_k", "attn_v"),
    "attn.c_proj": ("attn_output",),
    "mlp.c_fc": ("ffn_gate", "ffn_up"),
    "mlp.c_proj": ("ffn_down",),
}
Q8_0_BLOCK = 32  # weights a Q8_0 block holds
Q4_HEADER_BYTES = {"Q4_0": 2, "Q4_1": 4}  # ggml's block_q4_0: float16 d; block_q4_1: float16 d and m; then 16 bytes
Q4_K_BYTES = 144  # ggml's block_q4_K: float16 d and dmin, 12 bytes of scales and mins, 128 of codes (256 weights)
READ_BYTES = 1 << 20  # what a check or a comparison of a whole tensor reads at once
_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")


def read_gguf(
    path: str | os.PathLike,
    overrides: dict[str, Any] | None = None,
    keep_int4: bool = False,
    products_in_file: bool = False,
) -> tuple[GPT, dict[str, Any] | None]:
    """The model of a GGUF file as our GPT (float32, on CPU) and the file's tokenizer record (gguf_tokenizer_record;
    None where the file holds no tokenizer we read), from one read of its metadata: gguf's reader takes seconds over a
    large vocabulary's. `overrides` may change what does not change shapes (dropout; load sets block_size).
    keep_int4: the Q4_0 and Q4_1 matrices stay in the file, read as they are needed (keep_in_file), never float32: for
    decoding on the CPU, not for training. products_in_file: as keep_int4, but for the products alone (the token embedding and the head are read as
    usual): QLoRA's base, whose products add_lora holds as these blocks (gptkit.weights.lora), never float32.
    UserError (one line) for what is not read (module docstring)."""
    reader = open_gguf(path)
    try:
        tokenizer = gguf_tokenizer_record(path, reader)
    except UserError:  # said by whoever asks for the tokenizer; the model may still be read
        tokenizer = None
    arch = architecture_of(reader, path)
    tensors = read_tensors(reader, path)
    hf = hf_config(reader, arch, tensors, path)
    del reader  # its metadata (100k small objects for a large vocabulary) freed before the model is made among them
    architecture = ARCHITECTURES[arch]
    try:
        config = GPTConfig(**{**config_args(hf, architecture), **(overrides or {})})
    except UserError as exc:  # what hf.config_args does not build (e.g. yarn rope scaling), said of this file
        raise UserError(f"{path}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: not a usable {arch} model ({exc})") from None
    model = model_for_weights(config, tensors.file.tensors, str(path), f"{arch}.block_count", DAMAGED)
    check_matrices_present(tensors, arch, config, path)
    check_matrix_shapes(model, tensors, arch)
    kept = keep_in_file(model, tensors, arch, products_only=not keep_int4) if keep_int4 or products_in_file else set()
    named = HFTensors(tensors.without(kept), arch, config, path)
    model.load_state_dict(state_from_hf(named, architecture, model, Path(path)), assign=True)
    if config.tie_embeddings and isinstance(model.transformer.wte, torch.nn.Embedding):
        model.transformer.wte.weight = model.lm_head.weight  # each was put in place apart: one matrix again
    if not keep_int4:
        keep_q4_blocks(model, tensors, arch)  # those of the matrices read in float32
    return model, tokenizer


def check_matrices_present(tensors: FileTensors, arch: str, config: GPTConfig, path: str | os.PathLike) -> None:
    """UserError when the file lacks a matrix of the model its metadata describes."""
    needed = ["token_embd", *(name for names in matrix_sources(config, arch).values() for name in names)]
    missing = [f"{name}.weight" for name in needed if f"{name}.weight" not in tensors.file.tensors]
    if missing:
        raise UserError(f"{path}: tensor {missing[0]} is missing ({len(missing)} of the model's matrices); {DAMAGED}")


def architecture_of(reader: Any, path: str | os.PathLike) -> str:
    """general.architecture, when it is one we read."""
    arch = metadata(reader, "general.architecture", kind=str)
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: its architecture is {arch!r}; we read GGUF files of {', '.join(ARCHITECTURES)}")
    return arch


# ------------------------------------------------------------------------------------------------ tensors


class StoredTensor(NamedTuple):
    """What reading a tensor takes of the reader's record of it (gguf.ReaderTensor), which holds on to the reader."""

    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's dimensions: a row's values first
    n_bytes: int
    data_offset: int
    dtype: np.dtype  # the reader's view of the data: its dtype and shape
    data_shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: Any) -> StoredTensor:
        shape = tuple(int(size) for size in tensor.shape)
        return cls(
            tensor_type=tensor.tensor_type,
            shape=shape,
            n_bytes=tensor.n_bytes,
            data_offset=tensor.data_offset,
            dtype=tensor.data.dtype,
            data_shape=tensor.data.shape,
        )


class TensorFile:
    """The file's tensors (StoredTensor, by name) read with plain reads at their offsets, a range of rows at a time.
    What is read is this process's memory only while it is used; the kernel's page cache keeps the file's pages
    (shared, and given back under pressure) where a memory map would count them in this process for its lifetime."""

    def __init__(self, path: str | os.PathLike, tensors: dict[str, StoredTensor]) -> None:
        self.path, self.tensors = path, tensors
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 (open while a model reads from it)
        weakref.finalize(self, self._file.close)
        self._lock = threading.Lock()  # one position in the file: reads from several threads take turns

    def __deepcopy__(self, memo: dict) -> TensorFile:
        return self  # read only: a copy of a model reads the same file

    def rows(self, name: str) -> int:
        """The rows of a tensor: its dimensions past the first (a vector is one row)."""
        return math.prod(int(size) for size in self.tensors[name].shape[1:])

    def row_ranges(self, name: str, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, int]]:
        """(first, last) of the tensor's rows start .. stop - 1 (all: stop None), about READ_BYTES at a time."""
        rows = self.rows(name)
        stop = rows if stop is None else stop
        step = max(1, READ_BYTES * rows // self.tensors[name].n_bytes)
        return ((first, min(first + step, stop)) for first in range(start, stop, step))

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The bytes of rows start .. stop - 1 (all: stop None) of tensor `name`, (rows, bytes a row) uint8."""
        tensor, rows = self.tensors[name], self.rows(name)
        stop = rows if stop is None else stop
        row_bytes = tensor.n_bytes // rows
        data = np.empty((stop - start, row_bytes), np.uint8)
        view, done = memoryview(data.reshape(-1)), 0
        with self._lock:
            self._file.seek(tensor.data_offset + start * row_bytes)
            while done < data.nbytes:
                count = self._file.readinto(view[done:])
                if not count:
                    raise UserError(f"{self.path}: the file ends inside tensor {name}; it is truncated")
                done += count
        return data

    def dequantized(self, name: str) -> torch.Tensor:
        """Tensor `name` in float32, in numpy's order of the file's dimensions (a matrix as nn.Linear's (out, in))."""
        return self.row_values(name, 0, self.rows(name)).reshape(list(reversed(self.tensors[name].shape)))

    def row_values(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start .. stop - 1 of matrix `name` in float32, (rows, values a row), dequantized as gguf does."""
        return self._values(name, self.read(name, start, stop))

    def finite_values(self, name: str, start: int, stop: int) -> torch.Tensor:
        """row_values, and a UserError as for any weight (checkpoint.check_finite) when they hold NaN or infinity."""
        values = self.row_values(name, start, stop)
        check_finite({name: values}, str(self.path), DAMAGED)
        return values

    def picked_values(self, name: str, rows: list[int]) -> torch.Tensor:
        """Rows `rows` of matrix `name` in float32, in that order (a lookup's), each read alone."""
        if not rows:
            return torch.empty(0, self.tensors[name].shape[0])
        return self._values(name, np.concatenate([self.read(name, row, row + 1) for row in rows]))

    def _values(self, name: str, data: np.ndarray) -> torch.Tensor:
        import gguf

        tensor = self.tensors[name]
        if tensor.tensor_type.name == "Q8_0":
            return q8_0_values(data, tensor.shape[0])
        values = gguf.quants.dequantize(data.view(tensor.dtype), tensor.tensor_type)  # as the reader's view of rows
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(len(data), tensor.shape[0]))

    def q4_blocks(self, name: str, start: int, stop: int) -> Int4Blocks:
        """Rows start .. stop - 1 of a Q4_0 or Q4_1 matrix, its blocks as they are in Int4Linear's layout. ggml's blocks
        of 32 weights: Q4_0 a float16 d and 16 bytes of codes, weight = d * (code - 8), which is minimum -8 d (exact
        in float16); Q4_1 a float16 d, a float16 m and the codes, weight = d * code + m. Byte j of the codes holds
        weight j's in its low 4 bits and weight j + 16's in its high ones, as Int4Linear's. The codes, scales (and
        Q4_1's minimums) are views of the bytes read."""
        header = Q4_HEADER_BYTES[self.tensors[name].tensor_type.name]
        data = self.read(name, start, stop)
        raw = torch.from_numpy(data).view(stop - start, data.shape[1] // (header + 16), header + 16)
        scale = raw[..., 0:2].view(torch.float16)[..., 0]
        minimum = -8 * scale if header == 2 else raw[..., 2:4].view(torch.float16)[..., 0]
        return Int4Blocks(raw[..., header:], scale, minimum)

    def q8_blocks(self, name: str, start: int, stop: int) -> Int8Blocks:
        """Rows start .. stop - 1 of a Q8_0 matrix, its blocks as they are (ggml's blocks of 32 weights: a float16 d
        and 32 int8 codes, weight = d * code): views of the bytes read."""
        data = self.read(name, start, stop)
        raw = torch.from_numpy(data).view(stop - start, data.shape[1] // (2 + Q8_0_BLOCK), 2 + Q8_0_BLOCK)
        return Int8Blocks(raw[..., 2:].view(torch.int8), raw[..., 0:2].view(torch.float16)[..., 0])

    def q4_k_blocks(self, name: str, start: int, stop: int) -> Int4Blocks:
        """Rows start .. stop - 1 of a Q4_K matrix as Int4Linear's blocks, its codes as they are. ggml's super-blocks
        of 256 weights: float16 d and dmin, 12 bytes of 6-bit scales sc_j and mins m_j of 8 groups of 32, 128 bytes
        of codes, weight = d sc_j q - dmin m_j: a group's scale d sc_j and minimum -dmin m_j (products taken in
        float32, rounded to float16), where quantizing the values again would move codes wherever a group's do not
        span 0 .. 15. Bytes 32 i + l of the codes hold group 2 i's weight l in their low 4 bits and group 2 i + 1's in
        their high ones; the scales and mins pack as ggml's get_scale_min_k4 reads them (q4_k_scales)."""
        data = torch.from_numpy(self.read(name, start, stop))
        raw = data.view(stop - start, -1, Q4_K_BYTES)
        d, dmin = (raw[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float() for at in (0, 2))
        check_finite({name: torch.stack([d, dmin])}, str(self.path), DAMAGED)
        scale, mins = q4_k_scales(raw[..., 4:16])
        codes = raw[..., 16:].reshape(*raw.shape[:2], 4, 1, 32)
        codes = torch.cat([codes & 0x0F, codes >> 4], dim=3).reshape(stop - start, -1, 32)  # each group's 32 codes
        packed = codes[..., :16] | (codes[..., 16:] << 4)  # Int4Linear's: weight j low, weight j + 16 high
        minimum = (-dmin[..., None] * mins).flatten(1).half()
        return Int4Blocks(packed, (d[..., None] * scale).flatten(1).half(), minimum)

    def blocks(self, name: str, start: int, stop: int) -> Int4Blocks | Int8Blocks:
        """Rows start .. stop - 1 of a Q4_0, Q4_1, Q4_K or Q8_0 matrix as blocks (q4_blocks, q4_k_blocks,
        q8_blocks)."""
        kind = self.tensors[name].tensor_type.name
        if kind == "Q8_0":
            return self.q8_blocks(name, start, stop)
        return self.q4_k_blocks(name, start, stop) if kind == "Q4_K" else self.q4_blocks(name, start, stop)

    def same_data(self, a: str, b: str) -> bool:
        """Whether tensors `a` and `b` hold the same bytes."""
        first, second = self.tensors[a], self.tensors[b]
        if first.tensor_type != second.tensor_type or first.shape != second.shape:
            return False
        return all(np.array_equal(self.read(a, *rows), self.read(b, *rows)) for rows in self.row_ranges(a))


def q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 groups' 6-bit scales and mins of Q4_K super-blocks (their 12 bytes, (..., 12) uint8), as float32
    (..., 8) each: groups 0-3 in the low 6 bits of bytes j and j + 4; groups 4-7 from byte j + 8's low (scale) and
    high (min) 4 bits, with the top 2 bits of bytes j - 4 (scale) and j (min) above them."""
    low, high, rest = packed[..., 0:4].int(), packed[..., 4:8].int(), packed[..., 8:12].int()
    scale = torch.cat([low & 63, (rest & 0x0F) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([high & 63, (rest >> 4) | ((high >> 6) << 4)], dim=-1)
    return scale.float(), mins.float()


def q8_0_values(data: np.ndarray, columns: int) -> torch.Tensor:
    """Rows of Q8_0 blocks (rows, bytes a row) as float32 (rows, columns): a block of 32 is a float16 d and 32 int8
    codes, weight = d * code, as gguf dequantizes it. Why not gguf's own: a decoding step reads one row a token, and
    a few tensor operations cost a fraction of its generic path's."""
    blocks = torch.from_numpy(data).view(len(data), columns // Q8_0_BLOCK, 2 + Q8_0_BLOCK)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    return (blocks[..., 2:].view(torch.int8).float() * scale).view(len(data), columns)


class FileTensors(Mapping):
    """The file's tensors by llama.cpp's names, each read, dequantized to float32 (TensorFile.dequantized) and
    checked for NaN and infinity when it is asked for; none is kept."""

    def __init__(self, file: TensorFile, names: list[str]) -> None:
        self.file, self.names = file, dict.fromkeys(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        value = self.file.dequantized(name)
        check_finite({name: value}, str(self.file.path), DAMAGED)
        return value

    def __contains__(self, name: object) -> bool:
        return name in self.names  # Mapping's own would read the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape as it reads (numpy's order of the file's dimensions), without reading it."""
        return tuple(reversed(self.file.tensors[name].shape))

    def without(self, names: set[str]) -> FileTensors:
        return FileTensors(self.file, [name for name in self.names if name not in names])


def read_tensors(reader: Any, path: str | os.PathLike) -> FileTensors:
    """Every tensor of the file, read when it is asked for (FileTensors). A head stored as a copy of the token
    embedding (llama.cpp's older GPT-2 files) is left out: tied."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in TENSOR_TYPES:
            raise UserError(
                f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}; we read {', '.join(TENSOR_TYPES)}"
            )
    file = TensorFile(path, {tensor.name: StoredTensor.of(tensor) for tensor in reader.tensors})
    names = list(file.tensors)
    if {"output.weight", "token_embd.weight"} <= set(names) and file.same_data("output.weight", "token_embd.weight"):
        names.remove("output.weight")
    return FileTensors(file, names)


class HFTensors(Mapping):
    """The file's tensors under their Hugging Face names, as Hugging Face holds them (llama.cpp's changes undone),
    each read when it is asked for. rope_freqs, read into the config, is none of them."""

    def __init__(self, tensors: FileTensors, arch: str, config: GPTConfig, path: str | os.PathLike) -> None:
        self.tensors, self.arch, self.config = tensors, arch, config
        self.sources = {hf_name(name, arch, path): name for name in tensors if name != "rope_freqs.weight"}

    def __getitem__(self, key: str) -> torch.Tensor:
        name = self.sources[key]
        value = self.tensors[name]
        part, kind = _TENSOR_NAME.fullmatch(name).group(2, 3)
        if self.arch == "gpt2" and part in GPT2_CONV1D and kind == "weight":
            return value.t()
        if self.arch == "llama" and part in ("attn_q", "attn_k"):
            return rotate_halves(value, self.config.n_head if part == "attn_q" else self.config.n_kv_head)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self.sources  # Mapping's own would read the tensor

    def file_name(self, name: str) -> str:
        """llama.cpp's name for the Hugging Face tensor `name` (model.norm.weight: output_norm.weight), as an error
        about the file should say it; `name` itself where none maps to it."""
        stem, _, kind = name.rpartition(".")
        for theirs, ours in (GPT2_NAMES if self.arch == "gpt2" else LLAMA_NAMES).items():
            found = re.fullmatch(re.escape(ours).replace(re.escape("{i}"), r"(\d+)"), stem)
            if found:
                return f"{theirs.format(i=found.group(1)) if found.groups() else theirs}.{kind}"
        return name

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def hf_name(name: str, arch: str, path: str | os.PathLike) -> str:
    """The Hugging Face name of the file's tensor `name`; UserError for one our model has no place for."""
    names = GPT2_NAMES if arch == "gpt2" else LLAMA_NAMES
    match = _TENSOR_NAME.fullmatch(name)
    block, part, kind = match.groups() if match else (None, name, "")
    key = part if block is None else f"blk.{{i}}.{part}"
    if key not in names:
        raise UserError(f"{path}: tensor {name} has no place in the {arch} model we build")
    return f"{names[key].format(i=block)}.{kind}"


# ------------------------------------------------------------------------------------------------ 4-bit matrices


def matrix_sources(config: GPTConfig, arch: str) -> dict[str, tuple[str, ...]]:
    """Our modules whose weights are matrices -> llama.cpp's weights that each is made of, in order; the head
    (output) only when it is not the token embedding."""
    sources = {"transformer.wte": ("token_embd",)}
    if not config.tie_embeddings:
        sources["lm_head"] = ("output",)
    products = GPT2_PRODUCTS if arch == "gpt2" else LLAMA_PRODUCTS
    for layer in range(config.n_layer):
        for ours, theirs in products.items():
            sources[f"transformer.h.{layer}.{ours}"] = tuple(f"blk.{layer}.{name}" for name in theirs)
    return sources


@dataclass(frozen=True, kw_only=True)
class StoredMatrix:
    """One of our matrices as the file stores it in Q4_0 and Q4_1 blocks, or in Q8_0 blocks: the file's weights it is
    made of, one after another (a fused product's parts), each with the heads whose rows llama.cpp reordered (Llama's
    q and k; 0: none). Called with (start, stop): the blocks of those rows in our order (Int4Blocks or Int8Blocks),
    read from the file (whole rows move: a block lies in one); with `values`, in any type, those rows' float32 values
    (checked for NaN and infinity)."""

    file: TensorFile
    parts: tuple[tuple[str, int], ...]  # (weight's name, heads)
    values: bool = False

    @property
    def rows(self) -> int:
        return sum(self.file.rows(name) for name, _ in self.parts)

    @property
    def symmetric(self) -> bool:
        """Whether every part is Q4_0 (every minimum -8 times its scale)."""
        return all(self.file.tensors[name].tensor_type.name == "Q4_0" for name, _ in self.parts)

    @property
    def eight_bit(self) -> bool:
        """Whether the parts are Q8_0 (else Q4_0 and Q4_1)."""
        return self.file.tensors[self.parts[0][0]].tensor_type.name == "Q8_0"

    @property
    def columns(self) -> int:
        return self.file.tensors[self.parts[0][0]].shape[0]

    @property
    def types(self) -> set[str]:
        """The block types its parts are stored in (Q4_K, Q6_K, F16, ...)."""
        return {self.file.tensors[name].tensor_type.name for name, _ in self.parts}

    # Read as the forward pass needs the rows, maybe under the CPU's autocast (--dtype=bfloat16), which refuses
    # float16 operands in ops such as torch.cat: the blocks' scales are float16. Reading is no product: no autocast.
    @torch.autocast("cpu", enabled=False)
    def __call__(self, start: int, stop: int) -> Int4Blocks | Int8Blocks | torch.Tensor:
        pieces, first = [], 0
        for name, heads in self.parts:
            rows = self.file.rows(name)
            low, high = max(start - first, 0), min(stop - first, rows)
            if low < high:
                pieces.append(self._part_rows(name, heads, low, high))
            first += rows
        if not pieces:  # no rows
            return self._read(self.parts[0][0], 0, 0)
        return pieces[0] if len(pieces) == 1 else joined(pieces)

    def _part_rows(self, name: str, heads: int, low: int, high: int) -> Int4Blocks | Int8Blocks | torch.Tensor:
        if not heads:
            return self._read(name, low, high)
        per_head = self.file.rows(name) // heads  # a head's rows move among themselves: whole heads are read
        first, last = low // per_head * per_head, -(-high // per_head) * per_head
        rows = moved(self._read(name, first, last), partial(rotate_halves, heads=(last - first) // per_head))
        return moved(rows, lambda part: part[low - first : high - first])

    def _read(self, name: str, low: int, high: int) -> Int4Blocks | Int8Blocks | torch.Tensor:
        return self.file.finite_values(name, low, high) if self.values else self.file.blocks(name, low, high)

    @torch.autocast("cpu", enabled=False)
    def picked(self, rows: list[int]) -> Int4Blocks | Int8Blocks:
        """The blocks of `rows`, in that order (a lookup's)."""
        return joined([self(row, row + 1) for row in rows] or [self(0, 0)])


def joined(pieces: list[Int4Blocks] | list[Int8Blocks] | list[torch.Tensor]) -> Int4Blocks | Int8Blocks | torch.Tensor:
    """Blocks (or values) of rows one after another, as one."""
    if isinstance(pieces[0], torch.Tensor):
        return torch.cat(pieces)
    return type(pieces[0])(*(torch.cat(part) for part in zip(*pieces)))


def moved(rows: Int4Blocks | Int8Blocks | torch.Tensor, change: Callable[[torch.Tensor], torch.Tensor]):
    """Blocks (or values) with their rows moved or picked by `change`."""
    return change(rows) if isinstance(rows, torch.Tensor) else rows.rows(change)


def stored_matrices(
    tensors: FileTensors, arch: str, config: GPTConfig, types: tuple[str, ...] = tuple(Q4_HEADER_BYTES)
) -> dict[str, StoredMatrix]:
    """Our modules whose matrices the file stores all in `types` (Q4_0 and Q4_1, or Q8_0; a fused product: every
    part) -> the StoredMatrix of each; the head is the token embedding's rows when tied."""
    sources = {**matrix_sources(config, arch), "lm_head": ("token_embd",) if config.tie_embeddings else ("output",)}
    found = {}
    for module, names in sources.items():
        matrix = matrix_of(tensors, arch, config, names)
        if all(tensors.file.tensors[name].tensor_type.name in types for name, _ in matrix.parts):
            found[module] = matrix
    return found


def matrix_of(
    tensors: FileTensors, arch: str, config: GPTConfig, names: tuple[str, ...], values: bool = False
) -> StoredMatrix:
    """The StoredMatrix of the file's weights `names` (llama.cpp's, one after another), of their blocks or, with
    `values`, of their float32 values."""
    weights = [f"{name}.weight" for name in names]
    parts = tuple((weight, reordered_heads(weight, arch, config)) for weight in weights)
    return StoredMatrix(file=tensors.file, parts=parts, values=values)


def reordered_heads(name: str, arch: str, config: GPTConfig) -> int:
    """The heads whose rows llama.cpp reordered in weight `name` (Llama's q and k), else 0."""
    if arch != "llama" or not name.endswith(("attn_q.weight", "attn_k.weight")):
        return 0
    return config.n_head if name.endswith("attn_q.weight") else config.n_kv_head


def keep_q4_blocks(model: GPT, tensors: FileTensors, arch: str) -> None:
    """Give each product whose weights the file stores in Q4_0 or Q4_1 (a fused one: all its parts) the blocks they
    are read from, and the token embedding too (quantization.keep_int4_blocks). The head is the token embedding's
    blocks when tied. Llama's q and k rows are reordered as their values are."""
    for module, matrix in stored_matrices(tensors, arch, model.config).items():
        if not isinstance(model.get_submodule(module), FileInt4Linear):  # left in the file
            keep_int4_blocks(model.get_submodule(module), matrix(0, matrix.rows))


def keep_in_file(model: GPT, tensors: FileTensors, arch: str, products_only: bool = False) -> set[str]:
    """Each module of `model` (made without weights) whose matrix the file stores in Q4_0 or Q4_1 becomes one that
    reads its blocks from the file as it needs them: FileInt4Linear, and for the token embedding FileInt4Embedding
    (a tied head: a FileInt4Linear of the same rows); where every layer's products are Q8_0 (q8_0_layers), each is
    an Int8GroupedLinear reading its blocks so. Their scales are checked for NaN and infinity here. A layer's product
    in any other type is a FileLinear of its values (module_in_file: float32 under none, int4 blocks quantized as they
    are read under int4, never a float32 copy of it whole). An untied head in another type stays in the file as well:
    beside layer products all kept in blocks, in Q8_0 blocks (head_in_file); beside products in other types, as they
    are (a FileLinear). A token embedding in another quantized type stays there (keep_embedding_in_file).
    products_only: the products alone, not the embedding or the head. Returns the file's weights so kept: nothing
    else reads them."""
    config, kept = model.config, set()
    stored = stored_matrices(tensors, arch, config)
    if products_only:
        stored = {module: matrix for module, matrix in stored.items() if module not in ("transformer.wte", "lm_head")}
    else:
        stored |= q8_0_layers(tensors, arch, config)
    for module, matrix in stored.items():
        for name, _ in matrix.parts:
            check_blocks_finite(tensors, name)
        model.set_submodule(module, module_in_file(model, module, matrix))
        kept.update(name for name, _ in matrix.parts)
    layers, sources = layer_modules(config, arch), matrix_sources(config, arch)
    if not products_only:
        for module in sorted(layers - set(stored)):  # in other types: read as quantization asks for them
            matrix = matrix_of(tensors, arch, config, sources[module], values=True)
            model.set_submodule(module, module_in_file(model, module, matrix))
            kept.update(name for name, _ in matrix.parts)
    head, products_in_file = "output.weight", layers <= set(stored)
    if not products_only and "lm_head" not in stored and head in tensors.file.tensors:
        if products_in_file:
            model.lm_head = head_in_file(tensors, head)
        else:  # beside products in other types: as they are
            matrix = matrix_of(tensors, arch, config, ("output",), values=True)
            model.lm_head = module_in_file(model, "lm_head", matrix)
        kept.add(head)
    embedding = "token_embd.weight"
    if (
        not products_only
        and embedding not in kept
        and tensors.file.tensors[embedding].tensor_type.name not in FLOAT_TYPES
    ):
        kept |= keep_embedding_in_file(model, tensors, products_in_file)
    return kept


def check_matrix_shapes(model: GPT, tensors: FileTensors, arch: str) -> None:
    """check_matrix_shape for every matrix of `model` (made without weights; the head too, the token embedding's
    rows when tied), before any is read: in float32 (llama.cpp's row order undone, fused products joined) or left in
    the file."""
    config = model.config
    sources = {**matrix_sources(config, arch), "lm_head": ("token_embd",) if config.tie_embeddings else ("output",)}
    for module, names in sources.items():
        old = model.get_submodule(module)
        embedding = module == "transformer.wte"
        shape = (old.num_embeddings, old.embedding_dim) if embedding else (old.out_features, old.in_features)
        check_matrix_shape(matrix_of(tensors, arch, config, names), shape)


def check_matrix_shape(matrix: StoredMatrix, shape: tuple[int, ...]) -> None:
    """UserError when a matrix of the file is not two-dimensional or not of the shape of the module the metadata's
    model has for it (a damaged file's widths): a module left in the file reads its rows as it runs, so no state dict
    check would see them."""
    for name, _ in matrix.parts:
        stored = matrix.file.tensors[name].shape
        if len(stored) != 2:
            raise UserError(
                f"{matrix.file.path}: weight {name} has {len(stored)} dimensions {stored}, not 2; {DAMAGED}"
            )
    if (matrix.rows, matrix.columns) != shape:
        names = " + ".join(name for name, _ in matrix.parts)
        raise UserError(
            f"{matrix.file.path}: the weights {names} are ({matrix.rows}, {matrix.columns}) where the model its "
            f"metadata describes has {shape}; {DAMAGED}"
        )


def module_in_file(model: GPT, module: str, matrix: StoredMatrix) -> torch.nn.Module:
    """What module `module` of `model` becomes to read `matrix` from the file: a FileInt4Embedding (the token
    embedding in Q4_0 or Q4_1), a FileInt4Linear, for Q8_0 blocks an Int8GroupedLinear, and for values a FileLinear
    (its int4 blocks as int4_rows reads them)."""
    config, old = model.config, model.get_submodule(module)
    embedding = module == "transformer.wte"
    check_matrix_shape(
        matrix, (old.num_embeddings, old.embedding_dim) if embedding else (old.out_features, old.in_features)
    )
    if embedding:
        return FileInt4Embedding(matrix.picked, config.vocab_size, config.n_embd)
    bias = None if old.bias is None else torch.empty_like(old.bias)  # on meta: read with the other tensors
    if matrix.values:
        return FileLinear(matrix, old.out_features, old.in_features, bias, int4_read=int4_rows(matrix))
    if matrix.eight_bit:
        return Int8GroupedLinear(matrix, old.out_features, old.in_features, bias)
    return FileInt4Linear(matrix, old.out_features, old.in_features, bias, matrix.symmetric)


def layer_modules(config: GPTConfig, arch: str) -> set[str]:
    """Our modules of the layers' products (matrix_sources but the token embedding and the head)."""
    return set(matrix_sources(config, arch)) - {"transformer.wte", "lm_head"}


def q8_0_layers(tensors: FileTensors, arch: str, config: GPTConfig) -> dict[str, StoredMatrix]:
    """The layers' products (each a StoredMatrix) when the file stores every one in Q8_0 (a Q8_0 file's); else
    none."""
    layers = layer_modules(config, arch)
    found = stored_matrices(tensors, arch, config, ("Q8_0",))
    return {module: found[module] for module in layers} if layers <= set(found) else {}


def keep_embedding_in_file(model: GPT, tensors: FileTensors, products_in_file: bool) -> set[str]:
    """The token embedding, stored in a quantized type but Q4_0 and Q4_1, as a FileEmbedding: its lookups read and
    dequantize their rows. A tied head reads the table from the file too, so that no float32 table is held: where
    every layer's product stays in the file in blocks, its Q8_0 blocks, or its values quantized to Q8_0 a slice of rows
    at a time as they are read (head_in_file); where the products are in other types, as they are (a FileLinear:
    float32 under --quantize=none, int4 under int4, as they become). Returns {token_embd.weight}: nothing else reads
    it."""
    config, name = model.config, "token_embd.weight"
    model.transformer.wte = FileEmbedding(partial(tensors.file.picked_values, name), config.vocab_size, config.n_embd)
    if config.tie_embeddings and products_in_file:
        model.lm_head = head_in_file(tensors, name)
    elif config.tie_embeddings:
        model.lm_head = module_in_file(
            model, "lm_head", StoredMatrix(file=tensors.file, parts=((name, 0),), values=True)
        )
    else:
        for rows in tensors.file.row_ranges(name):
            tensors.file.finite_values(name, *rows)
    return {name}


def head_in_file(tensors: FileTensors, name: str) -> Int8GroupedLinear:
    """The head of products left in the file, read from matrix `name` (stored in another type than Q4_0 and Q4_1)
    as Q8_0 blocks, so that the native step reads it beside them: the file's own where it is Q8_0 (their scales
    checked for NaN and infinity here), else quantized to Q8_0 from the file's values as they are read (QuantizedRows;
    nearer the precision of the types a head comes in, Q6_K's, Q5_K's or float, than 4 bits would be)."""
    vocab, width = tensors.shape(name)
    kind = tensors.file.tensors[name].tensor_type.name
    if kind != "Q8_0":
        table = StoredMatrix(file=tensors.file, parts=((name, 0),), values=True)
        eight_bit = QuantizedRows(values=table, rows=vocab, columns=width, eight_bit=True)
        return Int8GroupedLinear(eight_bit, vocab, width, int4_read=int4_rows(table))
    check_blocks_finite(tensors, name)
    return Int8GroupedLinear(partial(tensors.file.q8_blocks, name), vocab, width)


def int4_rows(matrix: StoredMatrix) -> StoredMatrix | QuantizedRows:
    """What int4 reads of a matrix the file holds in another type than Q4_0, Q4_1 and Q8_0 (a StoredMatrix of its
    values): Q4_K's own codes, with their groups' scales and minimums (TensorFile.q4_k_blocks); any other type's
    values quantized a slice of rows at a time (QuantizedRows)."""
    if matrix.types == {"Q4_K"}:
        return replace(matrix, values=False)
    return QuantizedRows(values=matrix, rows=matrix.rows, columns=matrix.columns)


@dataclass(frozen=True, kw_only=True)
class QuantizedRows:
    """A matrix the file stores in another type than Q4_0 or Q4_1, as int4 blocks (or Q8_0's, eight_bit): called with
    (start, stop) as a StoredMatrix is, the blocks of those rows quantized from their values (`values(start, stop)`:
    float32 rows read from the file; quantization.quantize_row_slices, quantize_q8_0_slices), about READ_BYTES of
    float32 values at a time. The whole matrix's blocks (what an eager pass asks for at every call) are quantized
    once and held from then on; the slices the native step's packing asks for are quantized at each call, so the
    packing holds no more than its panels."""

    values: Callable[[int, int], torch.Tensor]
    rows: int
    columns: int
    eight_bit: bool = False

    @torch.autocast("cpu", enabled=False)  # as StoredMatrix's reading
    def __call__(self, start: int, stop: int) -> Int4Blocks | Int8Blocks:
        if start == 0 and stop == self.rows:
            return self.whole
        return self.quantized(start, stop)

    @cached_property
    def whole(self) -> Int4Blocks | Int8Blocks:
        return self.quantized(0, self.rows)

    def quantized(self, start: int, stop: int) -> Int4Blocks | Int8Blocks:
        step = max(1, READ_BYTES // (4 * self.columns))
        slices = (self.values(first, min(first + step, stop)) for first in range(start, stop, step))
        return quantize_q8_0_slices(slices) if self.eight_bit else quantize_row_slices(slices)


def check_blocks_finite(tensors: FileTensors, name: str) -> None:
    """UserError as for any weight (checkpoint.check_finite) when a Q4_0, Q4_1 or Q8_0 matrix's scales (or minimums)
    hold a NaN or an infinity: then so do its values."""
    for rows in tensors.file.row_ranges(name):
        halves = [part for part in tensors.file.blocks(name, *rows) if part.is_floating_point()]
        if not all(all_finite(part) for part in halves):
            check_finite({name: tensors.file.dequantized(name)}, str(tensors.file.path), DAMAGED)


def rotate_halves(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Llama's q or k rows: each head's adjacent pairs (2i, 2i + 1) back to the pairs
    (i, i + d/2) that Hugging Face's Llama rotates."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


# ------------------------------------------------------------------------------------------------ config.json


def hf_config(reader: Any, arch: str, tensors: FileTensors, path: str | os.PathLike) -> dict[str, Any]:
    """The config.json of the file's model, from its metadata and which tensors it holds (vocabulary rows, biases,
    a head of its own)."""

    def value(key: str, default: Any = ..., kind: type = int) -> Any:
        found = uniform(metadata(reader, f"{arch}.{key}", kind=kind, per_layer=True), f"{arch}.{key}", path)
        if found is None and default is ...:
            raise UserError(f"{path}: the metadata lack {arch}.{key}; the file is incomplete")
        if kind is int and found is not None and key != "context_length":
            check_count(f"{arch}.{key}", found, tensors, path)
        return default if found is None else found

    if "token_embd.weight" not in tensors:
        raise UserError(f"{path}: the file holds no token_embd.weight; the file is incomplete")
    common = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": tensors.shape("token_embd.weight")[0],
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch == "gpt2":
        return {
            **common,
            "n_positions": value("context_length"),
            "n_embd": value("embedding_length"),
            "n_layer": value("block_count"),
            "n_head": value("attention.head_count"),
            "layer_norm_epsilon": value("attention.layer_norm_epsilon", 1e-5, float),
            "activation_function": "gelu_new",  # llama.cpp's GPT-2 computes the tanh GELU
        }
    heads, width = value("attention.head_count"), value("embedding_length")
    head_dim = value("attention.key_length", None) or value("rope.dimension_count", None) or width // heads
    if value("rope.dimension_count", head_dim) != head_dim:
        raise UserError(
            f"{path}: rotary positions turn {value('rope.dimension_count')} of each head's {head_dim} dimensions; "
            "our model turns them all"
        )
    base = value("rope.freq_base", 10000.0, float)
    return {
        **common,
        "max_position_embeddings": value("context_length"),
        "num_hidden_layers": value("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": value("attention.head_count_kv", heads),
        "hidden_size": width,
        "head_dim": head_dim,
        "intermediate_size": value("feed_forward_length"),
        "rms_norm_eps": value("attention.layer_norm_rms_epsilon", 1e-6, float),
        "rope_parameters": {"rope_theta": base, **rope_scaling(reader, arch, tensors, base, head_dim, path)},
        **biases(arch, tensors),
    }


def check_count(key: str, count: int, tensors: FileTensors, path: str | os.PathLike) -> None:
    """UserError unless a width or count of the metadata is positive and within the file's largest dimension: a
    damaged file's 2**62 heads would otherwise fail in making the model (the tensors' shapes are checked after)."""
    largest = max(max(tensor.shape, default=1) for tensor in tensors.file.tensors.values())
    if not 0 < count <= largest:
        raise UserError(
            f"{path}: {key} is {count}, beyond the file's tensors (their largest size: {largest}); {DAMAGED}"
        )


def biases(arch: str, tensors: FileTensors) -> dict[str, bool]:
    """config.json's bias switches, by which biases the file holds (Qwen2 has q, k and v biases, and no switch)."""
    if arch == "qwen2":
        return {}
    return {"attention_bias": "blk.0.attn_q.bias" in tensors, "mlp_bias": "blk.0.ffn_up.bias" in tensors}


def uniform(found: Any, key: str, path: str | os.PathLike) -> Any:
    """A hyper-parameter llama.cpp may write once a layer (a list): the value when every layer has the same."""
    if not isinstance(found, list):
        return found
    if len(set(found)) != 1:
        raise UserError(f"{path}: {key} differs from layer to layer ({found[:4]}...); our layers are all alike")
    return found[0]


def rope_scaling(
    reader: Any, arch: str, tensors: FileTensors, base: float, head_dim: int, path: str | os.PathLike
) -> dict[str, Any]:
    """rope_type and its parameters (config.json's keys): llama.cpp's rope.scaling keys, or rope_freqs' factors."""
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none", kind=str)
    if "rope_freqs.weight" in tensors:
        if kind != "none":
            raise UserError(f"{path}: both rope_freqs and rope scaling {kind!r}; we read one of them")
        return rope_freqs_scaling(tensors["rope_freqs.weight"], base, head_dim, path)
    if kind == "none":
        return {"rope_type": "default"}
    if kind == "linear":
        factor = metadata(reader, f"{arch}.rope.scaling.factor", 1.0, kind=float)
        if not 0 < factor < math.inf:
            raise UserError(f"{path}: {arch}.rope.scaling.factor is {factor}; a scaling factor is a positive number")
        return {"rope_type": "linear", "factor": factor}
    return {"rope_type": kind}  # refused by hf.config_args, which names what it reads


def rope_freqs_scaling(factors: torch.Tensor, base: float, head_dim: int, path: str | os.PathLike) -> dict[str, Any]:
    """The rope scaling whose per-frequency factors (each frequency is divided by its own) are rope_freqs: none, one
    factor for all (linear), or Llama 3's. Llama 3's blends the two ends by a `smooth` that is a line in the frequency,
    clamped to [0, 1], so it is read by finding that line and is checked by computing the factors back."""
    frequency = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    factors = factors.double().flatten()
    if factors.shape != frequency.shape:
        raise UserError(f"{path}: rope_freqs holds {len(factors)} factors for {len(frequency)} rotary frequencies")
    if not bool(((factors > 0) & factors.isfinite()).all()):
        raise UserError(f"{path}: rope_freqs holds factors that are not positive numbers; the file is damaged")
    factor = factors.max().item()
    if torch.allclose(factors, torch.ones_like(factors)):
        return {"rope_type": "default"}
    if torch.allclose(factors, torch.full_like(factors, factor)):
        return {"rope_type": "linear", "factor": factor}
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)  # 1 where a frequency is kept, 0 where divided by factor
    slope, intercept = smooth_line(frequency, smooth, path)
    if slope <= 0 or intercept >= 0:  # Llama 3 keeps the high frequencies and divides the low ones
        raise UserError(f"{path}: rope_freqs holds factors that are no Llama 3 rope scaling; we read Llama 3's")
    span = -1 / intercept  # high_freq_factor - low_freq_factor, taking low_freq_factor = 1 as Llama 3 does
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0 + span,
        "original_max_position_embeddings": 2 * math.pi * slope * span,
    }
    rounded = {
        **scaling,
        "high_freq_factor": round(1.0 + span, 3),
        "original_max_position_embeddings": round(2 * math.pi * slope * span),
    }
    for candidate in (rounded, scaling):  # the round numbers a real model has, when they give the same factors
        if torch.allclose(frequency / scaled_frequencies(frequency, candidate), factors, rtol=1e-4, atol=0):
            return candidate
    raise UserError(f"{path}: rope_freqs holds factors that are no Llama 3 rope scaling; we read Llama 3's")


def smooth_line(frequency: torch.Tensor, smooth: torch.Tensor, path: str | os.PathLike) -> tuple[float, float]:
    """(slope, intercept) of a line in the frequency that is `smooth` where that lies strictly between 0 and 1, at or
    below 0 where it is 0 and at or above 1 where it is 1: fitted through two or more points between; else the
    steepest through the one point between and the nearest frequency at either end (it then passes the other end
    too); else the line through the nearest frequencies at both ends."""
    between = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if int(between.sum()) >= 2:
        slope, intercept = np.polyfit(frequency[between].numpy(), smooth[between].numpy(), 1)
        return float(slope), float(intercept)
    scaled, kept = frequency[smooth <= 1e-4], frequency[smooth >= 1 - 1e-4]
    ends = ([(scaled.max().item(), 0.0)] if len(scaled) else []) + ([(kept.min().item(), 1.0)] if len(kept) else [])
    if between.any():
        middle = (frequency[between].item(), smooth[between].item())
        lines = [(middle, end) for end in ends]
    else:
        lines = [tuple(ends)] if len(ends) == 2 else []
    lines = [((x0, y0), (x1, y1)) for (x0, y0), (x1, y1) in lines if x0 != x1]
    if not lines:
        raise UserError(f"{path}: rope_freqs holds factors that are no Llama 3 rope scaling; we read Llama 3's")
    slope, (x0, y0) = max(((y1 - y0) / (x1 - x0), (x0, y0)) for (x0, y0), (x1, y1) in lines)
    return slope, y0 - slope * x0
