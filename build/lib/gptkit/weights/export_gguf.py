"""GGUF, the one-file format of llama.cpp, ollama and LM Studio, written with llama.cpp's own `gguf` package.

The file holds the GPT-2 architecture's hyperparameters, the tensors (f32, f16 or q8_0), the tokenizer (byte-level
BPE: tokens, types and merges, plus which of llama.cpp's pre-tokenizers splits text as ours does) and the chat
template. A Modelfile beside it runs the model in ollama (`ollama create NAME -f Modelfile`).

llama.cpp knows tokenizers as byte-level BPE or SentencePiece-like vocabularies, neither of which reproduces a
character table exactly, so character models are refused (export them with --format=hf).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.core.errors import UserError
from gptkit.data import bpe
from gptkit.data.chat import END_OF_TURN, ROLE_MARKERS
from gptkit.data.tokenizer import Tokenizer
from gptkit.model import GPT
from gptkit.weights.export_common import Vocabulary, gpt2_tensors, vocabulary_chat_template, vocabulary_of

OUTTYPES = ("f32", "f16", "q8_0")
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which the model uses

# Our GPT-2 tensor names -> llama.cpp's (gguf.TENSOR_NAMES for MODEL_ARCH.GPT2).
_TOP_NAMES = {
    "transformer.wte.weight": "token_embd.weight",
    "transformer.wpe.weight": "position_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight",
    "transformer.ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
}
_BLOCK_NAMES = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    """llama.cpp's name for one of our GPT-2 tensors."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, _, layer, rest = name.split(".", 3)  # transformer.h.<layer>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK_NAMES[module]}.{kind}"


def export_gguf(model: GPT, tokenizer: Tokenizer, directory: Path, outtype: str, name: str) -> list[str]:
    """Write `<name>-<outtype>.gguf` and an ollama Modelfile into `directory`; returns the file names."""
    import gguf

    if outtype not in OUTTYPES:
        raise UserError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    config, tensors = gpt2_tensors(model, exact_gelu=False)
    vocabulary = vocabulary_of(tokenizer)
    if vocabulary.is_char:
        raise UserError(
            "cannot export a character vocabulary to GGUF: llama.cpp's tokenizers (byte-level BPE, SentencePiece) "
            "do not encode it as ours does; use --format=hf, or train on a BPE tokenizer"
        )
    if vocabulary.size > config.vocab_size:
        raise UserError(f"the tokenizer has {vocabulary.size} tokens but the model only {config.vocab_size} rows")
    filename = f"{name}-{outtype}.gguf"
    writer = gguf.GGUFWriter(str(directory / filename), arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT2])
    writer.add_name(name)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(4 * config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(LAYER_NORM_EPS)
    writer.add_file_type(_FILE_TYPES[outtype](gguf))
    add_tokenizer(writer, vocabulary, config.vocab_size)
    for key, tensor in tensors.items():
        if key == "lm_head.weight" and config.tie_embeddings:
            continue  # no output.weight: llama.cpp's GPT-2 uses the token embedding as the head
        data, qtype = encode_tensor(gguf_name(key), tensor, outtype)
        writer.add_tensor(gguf_name(key), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (directory / "Modelfile").write_text(modelfile(filename, vocabulary, config.block_size), encoding="utf-8")
    return [filename, "Modelfile"]


_FILE_TYPES = {
    "f32": lambda gguf: gguf.LlamaFileType.ALL_F32,
    "f16": lambda gguf: gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": lambda gguf: gguf.LlamaFileType.MOSTLY_Q8_0,
}


def encode_tensor(name: str, tensor: torch.Tensor, outtype: str) -> tuple[np.ndarray, Any]:
    """The tensor's data and GGML type. As llama.cpp's converter does, norms, biases and the position table stay f32;
    q8_0 needs rows of whole 32-value blocks, so a matrix whose rows are not falls back to f16."""
    import gguf

    array = tensor.float().numpy()
    if outtype == "f32" or array.ndim == 1 or name == "position_embd.weight":
        return array, gguf.GGMLQuantizationType.F32
    if outtype == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return array.astype(np.float16), gguf.GGMLQuantizationType.F16


def pre_tokenizer(vocabulary: Vocabulary) -> str:
    """llama.cpp's name for the pre-tokenisation pattern (its own implementation of each regex)."""
    if vocabulary.pattern is None:
        return "gpt-2"
    if vocabulary.pattern == bpe.GPT4_PATTERN:
        return "llama-bpe"  # Llama 3's pattern: GPT-4's split, which ours equals
    raise UserError("cannot export to GGUF: the BPE's pre-tokenisation pattern has no llama.cpp equivalent")


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
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(vocabulary))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{left} {right}" for left, right in vocabulary.merges])
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
