"""GGUF, the one-file format of llama.cpp, ollama and LM Studio, written with llama.cpp's own `gguf` package.

The model is written as the llama.cpp architecture that runs it exactly: GPT-2 (learned or sinusoidal positions,
LayerNorm, tanh GELU); Qwen3 (rotary positions, RMSNorm, SwiGLU, QK-norm); Qwen2 (the same without QK-norm, with
biases on q, k, v only); Llama (the rest of that family: grouped-query attention, any biases, Llama 3's rope
scaling). Norms without a learned scale are written as scales of ones. The file also holds the tensors (f32, f16,
q8_0, q4_0 or q4_1), the tokenizer (byte-level BPE: tokens, types and merges, plus which of llama.cpp's
pre-tokenizers splits text as ours does; a table of one-byte characters is a byte-level BPE whose merges never apply)
and the chat template; a Hugging Face tokenizer.json goes as its own tokens, merges and special tokens, with the
llama.cpp pre-tokenizer whose regex is its own, or as llama.cpp's SentencePiece tokenizer
(gptkit/weights/gguf_hf_tokenizer.py). A Modelfile beside it runs the model in ollama (`ollama create NAME -f
Modelfile`).

q4_0 and q4_1 write the products (and an untied token embedding) in 4 bits, as llama.cpp's quantizer does, and the
head (a tied token embedding) in q8_0, where llama.cpp uses q6_k, which gguf-py cannot write. A matrix held in 4-bit
blocks (an Int4Linear's, or a GGUF file's Q4_0 or Q4_1 read in) is written as those blocks: as Q4_0 under q4_0 where
every block is one, else as Q4_1.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.core.errors import UserError
from gptkit.data import bpe
from gptkit.data.chat import END_OF_TURN, ROLE_MARKERS
from gptkit.data.hf_tokenizer import HFTokenizer
from gptkit.data.tokenizer import Tokenizer
from gptkit.model import GPT, GPTConfig, scaled_frequencies
from gptkit.weights.export_common import Vocabulary, gpt2_tensors, vocabulary_chat_template, vocabulary_of
from gptkit.weights.gguf_hf_tokenizer import (
    UNREACHABLE_MERGE,
    add_hf_tokenizer,
    byte_level_character,
    gguf_tokenizer,
    hf_modelfile,
)
from gptkit.weights.gguf_read import matrix_sources
from gptkit.weights.quantization import GROUP, Int4Blocks, dequantized_copy, stored_int4

OUTTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
Q4_OUTTYPES = ("q4_0", "q4_1")


def architecture_of(config: GPTConfig) -> str:
    """llama.cpp's architecture (gguf.MODEL_ARCH_NAMES) that runs `config` exactly; UserError naming the setting
    that none of them holds."""
    for name in ("embed_norm", "logit_softcap"):
        if getattr(config, name):
            raise UserError(
                f"cannot export to GGUF: {name}={getattr(config, name)} is in none of llama.cpp's GPT-2, "
                "Llama, Qwen2 or Qwen3 architectures"
            )
    if config.pos_encoding != "rope":
        family = [
            (config.norm != "layernorm", f"norm={config.norm}"),
            (config.activation == "swiglu", "activation=swiglu"),
            (config.n_kv_head != config.n_head, f"n_kv_head={config.n_kv_head}"),
            (config.head_dim * config.n_head != config.n_embd, f"head_dim={config.head_dim}"),
            (config.qk_norm, "qk_norm=True"),
        ]
        for differs, setting in family:
            if differs:
                raise UserError(
                    f"cannot export to GGUF: {setting} with pos_encoding={config.pos_encoding}: "
                    "llama.cpp's GPT-2 lacks it and its Llama-family architectures use rotary positions"
                )
        return "gpt2"
    if config.norm != "rmsnorm" or config.activation != "swiglu":
        raise UserError(
            f"cannot export to GGUF: pos_encoding=rope with norm={config.norm} and activation={config.activation}: "
            "llama.cpp's rotary architectures (Llama, Qwen2, Qwen3) need norm=rmsnorm and activation=swiglu"
        )
    scaling = (config.rope_scaling or {}).get("rope_type")
    if config.qk_norm:
        if config.bias or scaling == "llama3":
            setting = "bias=True" if config.bias else "rope_scaling llama3"
            raise UserError(f"cannot export to GGUF: {setting} with qk_norm=True: llama.cpp's Qwen3 has neither")
        return "qwen3"
    if config.qkv_bias and not config.bias and scaling != "llama3":
        return "qwen2"
    return "llama"


def gguf_tensors(model: GPT) -> tuple[str, dict[str, torch.Tensor]]:
    """(architecture, float32 tensors under llama.cpp's names in nn.Linear's (out, in) layout)."""
    architecture = architecture_of(model.config)
    if architecture == "gpt2":
        return architecture, gpt2_gguf_tensors(model)
    return architecture, llama_family_tensors(model, architecture)


def tensor_name(tensor: Any, kind: str = "weight", block: int | None = None) -> str:
    """llama.cpp's name of a gguf.MODEL_TENSOR, e.g. blk.3.attn_q.weight."""
    import gguf

    return f"{gguf.TENSOR_NAMES[tensor].format(bid=block)}.{kind}"


def gpt2_gguf_tensors(model: GPT) -> dict[str, torch.Tensor]:
    import gguf

    T = gguf.MODEL_TENSOR
    top = {
        "transformer.wte": T.TOKEN_EMBD,
        "transformer.wpe": T.POS_EMBD,
        "transformer.ln_f": T.OUTPUT_NORM,
        "lm_head": T.OUTPUT,
    }
    block = {
        "ln_1": T.ATTN_NORM,
        "attn.c_attn": T.ATTN_QKV,
        "attn.c_proj": T.ATTN_OUT,
        "ln_2": T.FFN_NORM,
        "mlp.c_fc": T.FFN_UP,
        "mlp.c_proj": T.FFN_DOWN,
    }
    config, ours = gpt2_tensors(model, exact_gelu=False)
    tensors = {}
    for key, value in ours.items():
        if key == "lm_head.weight" and config.tie_embeddings:
            continue  # no output.weight: llama.cpp's GPT-2 uses the token embedding as the head
        module, kind = key.rsplit(".", 1)
        if module in top:
            tensors[tensor_name(top[module], kind)] = value
        else:  # transformer.h.<layer>.<module>
            _, _, layer, rest = module.split(".", 3)
            tensors[tensor_name(block[rest], kind, int(layer))] = value
    return tensors


def rope_pairs_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q or k reordered for llama.cpp's Llama, which rotates adjacent pairs (x[2i], x[2i+1]) where ours
    rotates halves (x[i], x[i + d/2]): the permutation llama.cpp's own converter applies to Hugging Face's Llama."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def llama_family_tensors(model: GPT, architecture: str) -> dict[str, torch.Tensor]:
    import gguf

    T = gguf.MODEL_TENSOR
    config = model.config
    state = {key: value.detach().float().cpu() for key, value in model.state_dict().items()}
    ones = torch.ones(config.n_embd)  # a norm without a learned scale multiplies by one
    tensors = {
        tensor_name(T.TOKEN_EMBD): state["transformer.wte.weight"],
        tensor_name(T.OUTPUT_NORM): state.get("transformer.ln_f.weight", ones),
    }
    if not config.tie_embeddings:
        tensors[tensor_name(T.OUTPUT)] = state["lm_head.weight"]
    if (config.rope_scaling or {}).get("rope_type") == "llama3":
        tensors[tensor_name(T.ROPE_FREQS)] = rope_factors(config)
    widths = [config.n_head * config.head_dim] + 2 * [config.n_kv_head * config.head_dim]
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}."
        tensors[tensor_name(T.ATTN_NORM, block=layer)] = state.get(prefix + "ln_1.weight", ones)
        tensors[tensor_name(T.FFN_NORM, block=layer)] = state.get(prefix + "ln_2.weight", ones)
        for kind in ("weight", "bias"):
            qkv = state.get(f"{prefix}attn.c_attn.{kind}")
            if qkv is not None:
                q, k, v = qkv.split(widths)
                if architecture == "llama":
                    q, k = rope_pairs_interleaved(q, config.n_head), rope_pairs_interleaved(k, config.n_kv_head)
                tensors[tensor_name(T.ATTN_Q, kind, layer)] = q
                tensors[tensor_name(T.ATTN_K, kind, layer)] = k
                tensors[tensor_name(T.ATTN_V, kind, layer)] = v
            gate_up = state.get(f"{prefix}mlp.c_fc.{kind}")
            if gate_up is not None:
                gate, up = gate_up.split(config.mlp_hidden)
                tensors[tensor_name(T.FFN_GATE, kind, layer)] = gate
                tensors[tensor_name(T.FFN_UP, kind, layer)] = up
            for ours, theirs in (("attn.c_proj", T.ATTN_OUT), ("mlp.c_proj", T.FFN_DOWN)):
                if f"{prefix}{ours}.{kind}" in state:
                    tensors[tensor_name(theirs, kind, layer)] = state[f"{prefix}{ours}.{kind}"]
        if architecture == "qwen3":
            head_ones = torch.ones(config.head_dim)
            tensors[tensor_name(T.ATTN_Q_NORM, block=layer)] = state.get(prefix + "attn.q_norm.weight", head_ones)
            tensors[tensor_name(T.ATTN_K_NORM, block=layer)] = state.get(prefix + "attn.k_norm.weight", head_ones)
    return tensors


def rope_factors(config: GPTConfig) -> torch.Tensor:
    """Llama 3's rope scaling as llama.cpp holds it: each rotary frequency is divided by its factor."""
    frequency = config.rope_base ** (-torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
    return (frequency / scaled_frequencies(frequency, config.rope_scaling)).float()


def export_gguf(model: GPT, tokenizer: Tokenizer, directory: Path, outtype: str, name: str) -> list[str]:
    """Write `<name>-<outtype>.gguf` and an ollama Modelfile into `directory`; returns the file names."""
    import gguf

    if outtype not in OUTTYPES:
        raise UserError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    model = dequantized_copy(model)  # int4 products as float weights that keep their blocks
    config = model.config
    architecture, tensors = gguf_tensors(model)
    int4 = int4_gguf_tensors(model, architecture) if outtype in Q4_OUTTYPES else {}
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    hf_tokenizer = tokenizer if isinstance(tokenizer, HFTokenizer) else None
    if hf_tokenizer is not None:
        gguf_tokenizer(hf_tokenizer, config.vocab_size)  # refused before any file is written
    else:
        vocabulary = gguf_vocabulary(vocabulary_of(tokenizer))
        if vocabulary.size > config.vocab_size:
            raise UserError(f"the tokenizer has {vocabulary.size} tokens but the model only {config.vocab_size} rows")
    filename = f"{name}-{outtype}.gguf"
    writer = gguf.GGUFWriter(str(directory / filename), arch=architecture)
    writer.add_name(name)
    add_hyperparameters(writer, config, architecture)
    writer.add_file_type(_FILE_TYPES[outtype](gguf))
    if hf_tokenizer is not None:
        add_hf_tokenizer(writer, hf_tokenizer, config.vocab_size)
    else:
        add_tokenizer(writer, vocabulary, config.vocab_size)
    for key, tensor in tensors.items():
        if key in int4:
            data, qtype = q4_data(int4[key], outtype)
        else:  # the head in 8 bits under q4_0 and q4_1 (llama.cpp keeps it in 6, which gguf-py cannot write)
            data, qtype = encode_tensor(key, tensor, "q8_0" if key == head and outtype in Q4_OUTTYPES else outtype)
        writer.add_tensor(key, data, raw_dtype=qtype)
    write_gguf_file(writer)
    if hf_tokenizer is not None:
        text = hf_modelfile(filename, hf_tokenizer, config.block_size)
    else:
        text = modelfile(filename, vocabulary, config.block_size)
    (directory / "Modelfile").write_text(text, encoding="utf-8")
    return [filename, "Modelfile"]


def write_gguf_file(writer: Any) -> None:
    """The writer's header, metadata and tensors into its file. numpy reports a short write (a full disk, a file
    size limit) as an OSError without an errno, which would read as a bug: it is said as the user's to mend."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except OSError as exc:
        if exc.errno is not None:
            raise
        raise UserError(
            f"the GGUF file was cut short ({exc}): the disk is full or a file size limit was reached; free some "
            "space or choose another --export_dir"
        ) from exc
    finally:
        writer.close()


def add_hyperparameters(writer: Any, config: GPTConfig, architecture: str) -> None:
    import gguf

    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.mlp_hidden)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    if architecture == "gpt2":
        writer.add_layer_norm_eps(config.norm_eps)
        return
    writer.add_head_count_kv(config.n_kv_head)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    if (config.rope_scaling or {}).get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling["factor"])


_FILE_TYPES = {
    "f32": lambda gguf: gguf.LlamaFileType.ALL_F32,
    "f16": lambda gguf: gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": lambda gguf: gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": lambda gguf: gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": lambda gguf: gguf.LlamaFileType.MOSTLY_Q4_1,
}


def encode_tensor(name: str, tensor: torch.Tensor, outtype: str) -> tuple[np.ndarray, Any]:
    """The tensor's data and GGML type. As llama.cpp's converter does, norms, biases and the position table stay f32;
    q8_0, q4_0 and q4_1 (gguf-py's reference quantizers) need rows of whole 32-value blocks, so a matrix whose rows
    are not falls back to f16."""
    import gguf

    array = tensor.float().numpy()
    if outtype == "f32" or array.ndim == 1 or name == "position_embd.weight":
        return array, gguf.GGMLQuantizationType.F32
    if outtype in ("q8_0", *Q4_OUTTYPES) and array.shape[-1] % GROUP == 0:
        qtype = gguf.GGMLQuantizationType[outtype.upper()]
        return gguf.quants.quantize(array, qtype), qtype
    return array.astype(np.float16), gguf.GGMLQuantizationType.F16


def int4_gguf_tensors(model: GPT, architecture: str) -> dict[str, Int4Blocks]:
    """The matrices held in 4-bit blocks (read from a GGUF file's, or an Int4Linear's: stored_int4) as those blocks,
    under llama.cpp's names: split and reordered as gguf_tensors does their values (whole rows move: a block lies in
    one). Only rows of whole blocks: GGUF has no others."""
    config = model.config
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    found = {}
    for module, names in matrix_sources(config, architecture).items():
        int4 = stored_int4(model.get_submodule(module))
        if int4 is None or int4.in_features % GROUP:
            continue
        widths = [q, kv, kv] if len(names) == 3 else [int4.out_features // len(names)] * len(names)
        parts = zip(*(part.cpu().split(widths) for part in int4.blocks()))
        for name, part in zip(names, (Int4Blocks(*part) for part in parts)):
            if architecture == "llama" and name.endswith(("attn_q", "attn_k")):
                heads = config.n_head if name.endswith("attn_q") else config.n_kv_head
                part = part.rows(partial(rope_pairs_interleaved, heads=heads))
            found[f"{name}.weight"] = part
    return found


def q4_data(blocks: Int4Blocks, outtype: str) -> tuple[np.ndarray, Any]:
    """4-bit blocks as they are, as GGUF data: Q4_0 (float16 d, codes) under q4_0 where every block is one (minimum
    = -8 d), else Q4_1 (float16 d and m, codes)."""
    import gguf

    rows, groups, _ = blocks.codes.shape
    scale = blocks.scale.contiguous().view(torch.uint8).reshape(rows, groups, 2)
    if outtype == "q4_0" and torch.equal(blocks.minimum, -8 * blocks.scale):
        parts, qtype = (scale, blocks.codes), gguf.GGMLQuantizationType.Q4_0
    else:
        minimum = blocks.minimum.contiguous().view(torch.uint8).reshape(rows, groups, 2)
        parts, qtype = (scale, minimum, blocks.codes), gguf.GGMLQuantizationType.Q4_1
    return torch.cat(parts, dim=-1).reshape(rows, -1).numpy(), qtype


def pre_tokenizer(vocabulary: Vocabulary) -> str:
    """llama.cpp's name for the pre-tokenisation pattern (its own implementation of each regex)."""
    if vocabulary.pattern is None:
        return "gpt-2"
    if vocabulary.pattern == bpe.GPT4_PATTERN:
        return "llama-bpe"  # Llama 3's pattern: GPT-4's split, which ours equals
    raise UserError("cannot export to GGUF: the BPE's pre-tokenisation pattern has no llama.cpp equivalent")


def gguf_vocabulary(vocabulary: Vocabulary) -> Vocabulary:
    """The vocabulary as llama.cpp's byte-level BPE holds it. A character table whose characters are one byte each
    is such a BPE without merges: llama.cpp splits text into bytes and looks each one up, as our table does."""
    if not vocabulary.is_char:
        return vocabulary
    special = set(vocabulary.special.values())
    tokens = [t if i in special else byte_level_character(t) for i, t in enumerate(vocabulary.tokens)]
    return replace(vocabulary, tokens=tokens, merges=[])


def add_tokenizer(writer: Any, vocabulary: Vocabulary, rows: int) -> None:
    """Tokens (padded with unused "[PADi]" entries up to the model's `rows`), types, merges, special ids, template."""
    import gguf

    special = set(vocabulary.special.values())
    tokens = vocabulary.tokens + [f"[PAD{i}]" for i in range(vocabulary.size, rows)]
    types = [
        gguf.TokenType.UNUSED
        if i >= vocabulary.size
        else gguf.TokenType.CONTROL
        if i in special
        else gguf.TokenType.NORMAL
        for i in range(rows)
    ]
    merges = vocabulary.merges or [UNREACHABLE_MERGE]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(vocabulary))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{left} {right}" for left, right in merges])
    if vocabulary.eot_token is not None:
        writer.add_bos_token_id(vocabulary.eot_token)
        writer.add_eos_token_id(vocabulary.eot_token)
    writer.add_add_bos_token(False)  # our prompts open with no extra token (a chat's template adds its own)
    writer.add_add_eos_token(False)
    if vocabulary.chat:
        writer.add_eot_token_id(vocabulary.chat.end_of_turn)
        writer.add_chat_template(vocabulary_chat_template(vocabulary))


def modelfile(filename: str, vocabulary: Vocabulary, block_size: int) -> str:
    """An ollama Modelfile for the GGUF file: ollama's Go template equivalent of the chat template, and stops."""
    eot = None if vocabulary.eot_token is None else vocabulary.tokens[vocabulary.eot_token]
    lines = [f"FROM ./{filename}"]
    if vocabulary.chat:
        begin = "" if vocabulary.chat.begin is None else vocabulary.tokens[vocabulary.chat.begin]
        roles = "".join(f'{{{{ if eq .Role "{role}" }}}}{marker}{{{{ end }}}}' for role, marker in ROLE_MARKERS.items())
        template = f"{begin}{{{{ range .Messages }}}}{roles}{{{{ .Content }}}}{END_OF_TURN}{{{{ end }}}}"
        lines += [f'TEMPLATE """{template}{ROLE_MARKERS["assistant"]}"""', f'PARAMETER stop "{END_OF_TURN}"']
    else:
        lines.append('TEMPLATE """{{ .Prompt }}"""')
    if eot:
        lines.append(f'PARAMETER stop "{eot}"')
    lines.append(f"PARAMETER num_ctx {block_size}")
    return "\n".join(lines) + "\n"
