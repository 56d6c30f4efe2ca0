"""Hugging Face checkpoints: read a directory (local, or a hub repository's in huggingface_hub's cache) of GPT-2 or
the Llama family as our GPT, and write a GPT back as the transformers class that holds it exactly.

A directory holds config.json and model.safetensors, or shards named by model.safetensors.index.json (GPT-2 also
an older pytorch_model.bin). config.json's `architectures` picks the family (ARCHITECTURES). The tensors are
renamed, and fused where our model computes in one product: q, k, v into attn.c_attn; gate and up into mlp.c_fc.
GPT-2 stores its four projections as Conv1D weights (in, out), the transpose of nn.Linear's, and `attn.bias` /
`attn.masked_bias` are old causal-mask buffers. nanochat turns its rotary pairs the other way round; negating the
second half of each query and key head turns ours into its (the product q.k is the same). A missing lm_head.weight
means the head is tied to the token embedding. Our norms without a learned scale (RMSNorm, QK-norm) are written to
Llama and Qwen3 as scales of ones.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from gptkit.core.errors import UserError
from gptkit.core.fileio import atomic_write_bytes, atomic_write_json
from gptkit.model import GPT, GPTConfig
from gptkit.weights.checkpoint import check_finite, model_for_weights
from gptkit.weights.export_common import gpt2_problem, gpt2_tensors
from gptkit.weights.quantization import int4_block_products

GPT2_HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "NanoChatForCausalLM")
MODEL_TYPES = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "NanoChatForCausalLM": "nanochat",
}
STORED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a file's weights may be stored as
DAMAGED = "the files are damaged; download or export the model again"  # what to do about a NaN or infinity
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]  # what a hub download fetches (not *.bin, *.pt)
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

# Our module in each block -> the Llama family's modules it fuses, in order (nanochat's MLP: fc1, fc2).
LAYER_PARTS = {
    "ln_1": ("input_layernorm",),
    "ln_2": ("post_attention_layernorm",),
    "attn.c_attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.c_proj": ("self_attn.o_proj",),
    "attn.q_norm": ("self_attn.q_norm",),
    "attn.k_norm": ("self_attn.k_norm",),
    "mlp.c_fc": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.c_proj": ("mlp.down_proj",),
}
NANOCHAT_MLP = {"mlp.c_fc": ("mlp.fc1",), "mlp.c_proj": ("mlp.fc2",)}
TOP_LEVEL = {"transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.norm", "lm_head": "lm_head"}
_LAYER_KEY = re.compile(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)$")

# ------------------------------------------------------------------------------------------------ finding files


def is_hub_name(name: str) -> bool:
    """Whether `name` reads as a hub repository id (owner/name), not a path."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not name.startswith((".", "/"))


def hub_gguf_name(name: str) -> tuple[str, str] | None:
    """(repository, tag) of a name of a hub repository's GGUF file, owner/name:TAG (a quantization, Q4_K_M or q8_0:
    how llama.cpp's -hf and ollama's hf.co/ name one); None for any other name."""
    repository, colon, tag = name.rpartition(":")
    return (repository, tag) if colon and is_hub_name(repository) and re.fullmatch(r"[\w.-]+", tag) else None


def hub_snapshot(name: str) -> Path:
    """The directory of a hub repository's config, weights and tokenizer files in huggingface_hub's cache, fetched
    once (HF_ENDPOINT; HF_HUB_OFFLINE=1: the cache only). GPT-2's names stand for openai-community's repositories.
    UserError when it is neither cached nor reachable, or holds GGUF files instead (which to take is the user's
    choice: owner/name:TAG)."""
    repository = f"openai-community/{name}" if name in GPT2_HUB_NAMES else name
    snapshot = fetch_snapshot(name, repository, HUB_FILES)
    if not (snapshot / "config.json").is_file():
        tags = gguf_tags(repository, snapshot.name)
        if tags:
            raise UserError(
                f"{name} holds GGUF files, not a Hugging Face model: name one by its quantization, e.g. "
                f"{name}:{'Q4_K_M' if 'Q4_K_M' in tags else tags[0]} (its files: {', '.join(tags)})"
            )
        raise UserError(f"{name}: the hub repository has no config.json, so it holds no Hugging Face model")
    return snapshot


def hub_gguf_file(name: str) -> Path:
    """The GGUF file owner/name:TAG names: the one *.gguf file of the repository whose name ends in -TAG.gguf or
    .TAG.gguf (in any case), fetched once into huggingface_hub's cache as hub_snapshot fetches. UserError when the
    repository holds none, or several."""
    repository, tag = hub_gguf_name(name)
    patterns = sorted({f"*{spelling}.gguf" for spelling in (tag, tag.upper(), tag.lower())})
    snapshot = fetch_snapshot(name, repository, patterns)
    found = sorted(path for path in snapshot.rglob("*.gguf") if gguf_tag(path.name) == tag.upper())
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(str(path.relative_to(snapshot)) for path in found)
        raise UserError(f"{repository} holds several GGUF files tagged {tag} ({names}); download the one you want")
    tags = gguf_tags(repository, snapshot.name)
    if tags is None:
        raise UserError(f"{name}: no GGUF file tagged {tag} of {repository} in the cache (offline?)")
    listed = f"its GGUF files' tags: {', '.join(tags)}" if tags else "it holds none"
    raise UserError(f"{repository} holds no GGUF file tagged {tag} ({listed})")


def gguf_tag(filename: str) -> str | None:
    """The quantization a GGUF file's name ends in, upper-cased (Q4_K_M of model-Q4_K_M.gguf or model.q4_k_m.gguf);
    None for another file, or one part of a split file (model-Q4_K_M-00001-of-00002.gguf)."""
    if not filename.lower().endswith(".gguf") or re.search(r"-\d+-of-\d+\.gguf$", filename, re.IGNORECASE):
        return None
    match = re.search(r"[-.](\w+)\.gguf$", filename, re.IGNORECASE)
    return match[1].upper() if match else None


def gguf_tags(repository: str, revision: str) -> list[str] | None:
    """The quantization tags of the GGUF files of a hub repository at `revision` (gguf_tag), or None when its list
    of files cannot be read (offline)."""
    from huggingface_hub import HfApi

    try:
        files = HfApi().list_repo_files(repository, revision=revision)  # HF_ENDPOINT as it reads now
    except (OSError, ValueError):  # offline (huggingface_hub's errors are OSErrors): the message then says less
        return None
    return sorted({tag for tag in map(gguf_tag, (Path(file).name for file in files)) if tag})


class NoMatchFilter(logging.Filter):
    """Drops huggingface_hub's warning that no file matched a download's patterns: what the repository lacks is
    then said in one line of ours (a GGUF repository has no config.json, a tag no file)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No files matched")


NO_MATCH = NoMatchFilter()


def fetch_snapshot(name: str, repository: str, patterns: list[str]) -> Path:
    """huggingface_hub's snapshot of `repository` (the files matching `patterns`), the one place that turns its
    failures into a UserError naming `name`."""
    # Imported here, not at the top: huggingface_hub is slow to import and only a hub name needs it.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    logging.getLogger("huggingface_hub._snapshot_download").addFilter(NO_MATCH)  # once: the same filter is kept once
    try:
        return Path(snapshot_download(repository, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise UserError(
            f"{name}: no such directory, and no hub repository of that name in the cache (offline?)"
        ) from None
    except (HFValidationError, OSError, ValueError) as exc:  # unknown repository, gated, network errors
        raise UserError(
            f"{name}: no such directory, and the hub cannot give it: {str(exc).splitlines()[0][:200]}"
        ) from None


# ------------------------------------------------------------------------------------------------ config.json


def read_hf_config(directory: Path) -> dict[str, Any]:
    """config.json as a dict; UserError when it is missing or not JSON."""
    try:
        hf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{directory} has no config.json; is it a Hugging Face model directory?") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{directory}/config.json is not JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise UserError(f"{directory}/config.json is not a JSON object")
    return hf


def is_gpt2_directory(directory: Path) -> bool:
    """Whether a Hugging Face directory holds GPT-2 (its config.json names no other architecture)."""
    return architecture_of(read_hf_config(directory), directory) == "GPT2LMHeadModel"


def architecture_of(hf: dict[str, Any], directory: Path) -> str:
    """The transformers class config.json names (GPT-2 directories without `architectures` are GPT-2)."""
    names = hf.get("architectures") or (["GPT2LMHeadModel"] if hf.get("model_type", "gpt2") == "gpt2" else [])
    architecture = names[0] if isinstance(names, list) and names else hf.get("model_type", "unknown")
    if architecture not in ARCHITECTURES:
        raise UserError(
            f"{directory}: architecture {architecture} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return architecture


def config_args(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """GPTConfig arguments from config.json; UserError naming what we cannot build."""
    if architecture == "GPT2LMHeadModel":
        activation = _GPT2_ACTIVATIONS.get(hf.get("activation_function", "gelu_new"))
        if activation is None:
            raise UserError(
                f"activation_function {hf['activation_function']!r} is not one of {list(_GPT2_ACTIVATIONS)}"
            )
        sizes = {"block_size": hf["n_positions"], "n_layer": hf["n_layer"], "n_head": hf["n_head"]}
        return {
            **sizes,
            "vocab_size": hf["vocab_size"],
            "n_embd": hf["n_embd"],
            "bias": True,
            "activation": activation,
            "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "tie_embeddings": hf.get("tie_word_embeddings", True),
        }
    nanochat = architecture == "NanoChatForCausalLM"
    if hf.get("use_sliding_window"):
        raise UserError("sliding-window attention (use_sliding_window=true) is not supported")
    expected_act = "relu2" if nanochat else "silu"
    if hf.get("hidden_act", expected_act) != expected_act:
        raise UserError(f"hidden_act {hf['hidden_act']!r}: {architecture} is read with {expected_act} only")
    attention_bias = bool(hf.get("attention_bias", False))  # on q, k, v and o
    mlp_bias = bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise UserError("attention_bias and mlp_bias differ; our model has one bias setting for both")
    qwen2 = architecture == "Qwen2ForCausalLM"  # q, k, v biases, none elsewhere
    return {
        "vocab_size": hf["vocab_size"],
        "block_size": hf["max_position_embeddings"],
        "n_layer": hf["num_hidden_layers"],
        "n_head": hf["num_attention_heads"],
        "n_kv_head": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "n_embd": hf["hidden_size"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        "mlp_hidden": hf["intermediate_size"],
        "bias": attention_bias,
        "qkv_bias": True if qwen2 else None,
        "pos_encoding": "rope",
        **rope_args(hf),
        "activation": expected_act if nanochat else "swiglu",
        "norm": "rmsnorm",
        "norm_weight": not nanochat,
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "qk_norm": architecture in ("Qwen3ForCausalLM", "NanoChatForCausalLM"),
        "qk_norm_weight": architecture == "Qwen3ForCausalLM",
        "embed_norm": nanochat,
        "logit_softcap": hf.get("final_logit_softcapping", 15.0) if nanochat else None,
        "tie_embeddings": hf.get("tie_word_embeddings") or False,  # null: not tied; "false": refused by GPTConfig
    }


def rope_args(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_base and rope_scaling from config.json: transformers 5's rope_parameters, or the older rope_theta and
    rope_scaling keys."""
    parameters = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or parameters
    base = parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {"rope_base": float(base), "rope_scaling": None}
    if kind == "linear":
        return {"rope_base": float(base), "rope_scaling": {"rope_type": "linear", "factor": scaling["factor"]}}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {"rope_base": float(base), "rope_scaling": {"rope_type": "llama3", **{k: scaling[k] for k in keys}}}
    raise UserError(f"rope scaling {kind!r} is not supported (default, linear and llama3 are)")


def read_config(directory: Path) -> tuple[str, GPTConfig]:
    """The architecture config.json names and the GPTConfig that holds it."""
    hf = read_hf_config(directory)
    architecture = architecture_of(hf, directory)
    try:
        config = GPTConfig(**config_args(hf, architecture))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # missing or odd entries
        raise UserError(f"{directory}/config.json is not a usable {architecture} config ({exc})") from None
    return architecture, config


# ------------------------------------------------------------------------------------------------ tensors


def weight_files(directory: Path) -> list[Path]:
    """The files holding the weights: model.safetensors, GPT-2's older pytorch_model.bin, or the safetensors shards
    the index names."""
    index = directory / "model.safetensors.index.json"
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (directory / single).exists():
            return [directory / single]
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from None
        missing = [name for name in shards if not (directory / name).exists()]
        if missing:
            raise UserError(f"{directory}: shard {missing[0]} named by model.safetensors.index.json is missing")
        return [directory / name for name in shards]
    raise UserError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")


class StoredTensors(Mapping):
    """The tensors of a directory's safetensors files under their own (Hugging Face) names, each read from the open
    files when it is asked for, and checked then: a dtype we can hold, no NaN or infinity. A reader that quantizes
    each weight as it goes (QLoRA's base) so holds one at a time."""

    def __init__(self, directory: Path, files: list[Path]) -> None:
        self.directory, self.file_of, self.handles = directory, {}, {}
        for path in files:
            try:
                self.handles[path] = safe_open(path, framework="pt")
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise UserError(f"cannot read weights {path}: {str(exc).splitlines()[0][:160]}") from None
            names = self.handles[path].keys()  # a safetensors handle, not a dict: it is not iterable itself
            twice = next((name for name in names if name in self.file_of), None)
            if twice is not None:  # which copy transformers reads depends on the index: neither is taken here
                raise UserError(
                    f"{directory}: tensor {twice} is in both {self.file_of[twice].name} and {path.name}; {DAMAGED}"
                )
            self.file_of.update(dict.fromkeys(names, path))

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        try:
            tensor = self.handles[path].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise UserError(f"cannot read weights {path}: {str(exc).splitlines()[0][:160]}") from None
        return checked_tensor(self.directory, name, tensor)

    def __iter__(self):
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)


def checked_tensor(directory: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, when we hold its dtype and it is finite; else UserError naming it."""
    if tensor.dtype not in STORED_DTYPES:
        raise UserError(
            f"{directory}: {name} is stored as {str(tensor.dtype).removeprefix('torch.')}; we load float32, "
            "bfloat16 or float16 weights (not quantized ones)"
        )
    check_finite({name: tensor}, str(directory), DAMAGED)
    return tensor


def read_tensors(directory: Path) -> Mapping[str, torch.Tensor]:
    """Every tensor of the directory's weight files under its own (Hugging Face) name: safetensors files read a
    tensor at a time as they are asked for (StoredTensors), GPT-2's older pytorch_model.bin at once. UserError for
    a damaged file, a dtype we cannot hold (quantized and 8-bit float weights) or a NaN or infinity."""
    files = weight_files(directory)
    if files[0].suffix == ".safetensors":
        return StoredTensors(directory, files)
    tensors = read_torch_bin(files[0])  # its old causal-mask buffers may be of any dtype: only finiteness is checked
    check_finite(tensors, str(directory), DAMAGED)
    return tensors


def read_torch_bin(path: Path) -> dict[str, torch.Tensor]:
    """An older GPT-2 pytorch_model.bin, read with weights_only (a pickle that would run code is refused)."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated or foreign files, and pickles that would run code, are all refused
        raise UserError(f"cannot read weights {path}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise UserError(f"{path} does not hold a state dict of tensors")
    return raw


def flip_rotation(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Negate the second half of each head's rows: turns our rotary direction into nanochat's (its own inverse)."""
    heads = weight.view(-1, 2, head_dim // 2, *weight.shape[1:]).clone()
    heads[:, 1] = -heads[:, 1]
    return heads.view(weight.shape)


def layer_parts(architecture: str) -> dict[str, tuple[str, ...]]:
    return {**LAYER_PARTS, **NANOCHAT_MLP} if architecture == "NanoChatForCausalLM" else LAYER_PARTS


def hf_names(key: str, architecture: str) -> list[str]:
    """The Hugging Face tensors (in fusing order) behind one of our Llama-family state dict keys."""
    match = _LAYER_KEY.fullmatch(key)
    if match:
        layer, module, kind = match.groups()
        return [f"model.layers.{layer}.{part}.{kind}" for part in layer_parts(architecture)[module]]
    module, kind = key.rsplit(".", 1)
    return [f"{TOP_LEVEL[module]}.{kind}"]


def holds_its_own_head(tensors: Mapping[str, torch.Tensor], architecture: str) -> bool:
    """Whether the weights hold a head that is not the token embedding, where config.json ties them: transformers
    then keeps the two apart (and says so), and so does the model built here."""
    if architecture == "GPT2LMHeadModel":  # GPT-2's files name it with or without the prefix
        embedding = "transformer.wte.weight" if "transformer.wte.weight" in tensors else "wte.weight"
    else:
        embedding = "model.embed_tokens.weight"
    if "lm_head.weight" not in tensors or embedding not in tensors:
        return False
    head, table = tensors["lm_head.weight"], tensors[embedding]
    return head.shape != table.shape or not torch.equal(head, table)


def hf_tensor(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """A Llama-family tensor by name; a missing head is the token embedding (tied)."""
    found = tensors.get(name)
    return tensors.get("model.embed_tokens.weight") if found is None and name == "lm_head.weight" else found


def gpt2_state(tensors: Mapping[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """GPT-2's tensors under our names: `transformer.` prefixed, Conv1D weights transposed, mask buffers dropped."""
    state = {}
    for key, value in tensors.items():
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # old causal-mask buffers, not weights
        if not key.startswith(("transformer.", "lm_head.")):
            key = "transformer." + key
        if key.endswith(CONV1D_WEIGHTS) and value.dim() != 2:  # transposed before its shape is checked
            raise UserError(f"{where}: {key} has shape {tuple(value.shape)}, not a matrix")
        state[key] = value.t() if key.endswith(CONV1D_WEIGHTS) else value
    state.setdefault("lm_head.weight", state.get("transformer.wte.weight"))
    return state


def state_from_hf(tensors: Mapping[str, torch.Tensor], architecture: str, model: GPT, where: Path) -> dict:
    """Our state dict for `model` from the Hugging Face tensors, each looked up once (a mapping may read each one
    when asked: read_tensors, gptkit.weights.gguf_read), for the entries still on the meta device (a module the
    reader has put in place itself keeps its own); UserError for a missing or misshapen tensor."""
    expected = {key: value for key, value in model.state_dict(keep_vars=True).items() if value.is_meta}
    if architecture == "GPT2LMHeadModel":
        state = gpt2_state(tensors, where)
    else:
        state, first_name = {}, {}
        for key, tensor in expected.items():
            if id(tensor) in first_name:  # one tensor under two names (a tied head): looked up once
                state[key] = state[first_name[id(tensor)]]
                continue
            first_name[id(tensor)] = key
            state[key] = hf_entry(tensors, architecture, model, key, where)
    for key, value in expected.items():
        if state.get(key) is None:
            raise UserError(f"{where}: the weights lack {key}")
        fitted(key, state[key], value.shape, where)
    return {key: state[key] for key in expected}


def fitted(key: str, value: torch.Tensor, shape: torch.Size, where: Path) -> torch.Tensor:
    """`value`, when it has the shape (`shape`) of the model's entry `key`; else UserError naming both."""
    if value.shape != shape:
        raise UserError(f"{where}: {key} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    return value


def source_name(tensors: Mapping[str, torch.Tensor], name: str) -> str:
    """What the weights' own files call the Hugging Face tensor `name`: a GGUF file's mapping (gguf_read.HFTensors)
    names it as llama.cpp does."""
    file_name = getattr(tensors, "file_name", None)
    return file_name(name) if file_name is not None else name


def hf_entry(tensors: Mapping[str, torch.Tensor], architecture: str, model: GPT, key: str, where: Path) -> torch.Tensor:
    """Our state dict entry `key` of a Llama-family model from its Hugging Face tensors (fused where we fuse them);
    UserError for a missing one."""
    names = hf_names(key, architecture)
    parts = [hf_tensor(tensors, name) for name in names]
    missing = [name for name, part in zip(names, parts) if part is None]
    if missing:
        raise UserError(f"{where}: the weights lack {source_name(tensors, missing[0])}")
    owner, _, attribute = key.rpartition(".")
    shape = getattr(model.get_submodule(owner), attribute).shape
    for name, part in zip(names, parts if len(parts) > 1 else []):  # before fusing: the rows are checked joined
        if part.shape[1:] != shape[1:]:
            raise UserError(
                f"{where}: {name} has shape {tuple(part.shape)}, expected (rows, {', '.join(map(str, shape[1:]))})"
            )
    if architecture == "NanoChatForCausalLM" and ".attn.c_attn." in key:
        parts[:2] = [flip_rotation(part, model.config.head_dim) for part in parts[:2]]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def hf_product(
    tensors: Mapping[str, torch.Tensor], architecture: str, model: GPT, where: Path, key: str
) -> torch.Tensor:
    """hf_entry for a product's weight or bias, checked against its shape in `model`."""
    return fitted(key, hf_entry(tensors, architecture, model, key, where), model.get_parameter(key).shape, where)


# ------------------------------------------------------------------------------------------------ reading


def read_hf_model(directory: Path, overrides: dict[str, Any] | None = None, int4_products: bool = False) -> GPT:
    """The model of a Hugging Face directory of one of ARCHITECTURES as our GPT (float32, on CPU). `overrides` may
    change what does not change shapes (dropout; load sets block_size). int4_products: the blocks' products as
    Int4Linear blocks quantized from the stored weights, never float32 (QLoRA's base)."""
    architecture, config = read_config(directory)
    if overrides:
        try:
            config = GPTConfig(**{**vars(config), **overrides})
        except (TypeError, ValueError) as exc:
            raise UserError(f"{directory}: {exc}") from None
    tensors = read_tensors(directory)
    if config.tie_embeddings and holds_its_own_head(tensors, architecture):
        config = GPTConfig(**{**vars(config), "tie_embeddings": False})
    model = model_for_weights(config, tensors, str(directory), "config.json", DAMAGED)
    if int4_products and architecture != "GPT2LMHeadModel":  # each product read when it is quantized
        int4_block_products(model, partial(hf_product, tensors, architecture, model, directory))
    state = state_from_hf(tensors, architecture, model, directory)
    del tensors  # the files closed: state holds what it needs
    if int4_products and architecture == "GPT2LMHeadModel":  # GPT-2's tensors are renamed all at once
        int4_block_products(model, state.pop)
    model.take_weights(state)
    return model


# ------------------------------------------------------------------------------------------------ writing


def export_architecture(config: GPTConfig) -> str:
    """The transformers class that computes exactly what `config` does; UserError naming what it would need."""
    gpt2 = gpt2_problem(config, exact_gelu=True)
    if gpt2 is None:
        return "GPT2LMHeadModel"
    if config.pos_encoding != "rope" or config.norm != "rmsnorm" or config.qkv_bias not in (None, True, config.bias):
        _refuse(gpt2, "pos_encoding=rope and norm=rmsnorm")
    if (config.activation, config.norm_weight, config.embed_norm) == ("relu2", False, True):
        if config.qk_norm and not config.qk_norm_weight and config.qkv_bias in (None, config.bias):
            return "NanoChatForCausalLM"
        _refuse(gpt2, "nanochat's qk_norm without a weight and one bias setting")
    if config.activation != "swiglu" or config.embed_norm or config.logit_softcap:
        _refuse(gpt2, "activation=swiglu, no embed_norm or logit_softcap (or nanochat's shape)")
    # Norms without a learned scale (norm_weight=False, qk_norm without qk_norm_weight) are written with scales of
    # ones, which compute the same (unit_norm_scales).
    if config.qkv_bias and not config.bias:
        return "Qwen2ForCausalLM" if not config.qk_norm else _refuse(gpt2, "no qkv_bias with qk_norm")
    if config.qk_norm and config.bias:
        _refuse(gpt2, "bias=False with qk_norm (Qwen3's MLP has no biases)")
    return "Qwen3ForCausalLM" if config.qk_norm else "LlamaForCausalLM"


def unit_norm_scales(config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a scale of ones for each norm the model computes without a learned one, as the Llama family's
    classes (whose norms always have a scale) hold it: x * 1 is x, so their logits are ours exactly."""
    state = dict(state)
    if not config.norm_weight:
        names = ["transformer.ln_f"] + [f"transformer.h.{i}.ln_{n}" for i in range(config.n_layer) for n in (1, 2)]
        state.update({f"{name}.weight": torch.ones(config.n_embd) for name in names})
    if config.qk_norm and not config.qk_norm_weight:
        for i, part in ((i, part) for i in range(config.n_layer) for part in ("q", "k")):
            state[f"transformer.h.{i}.attn.{part}_norm.weight"] = torch.ones(config.head_dim)
    return state


def _refuse(gpt2: str, llama: str) -> str:
    raise UserError(
        f"no Hugging Face class computes this model exactly: not GPT-2 ({gpt2}); the Llama family needs {llama}"
    )


def hf_config(config: GPTConfig, architecture: str, bos: int | None, eos: int | list[int] | None) -> dict[str, Any]:
    """config.json for `config` written as `architecture` (float32 weights)."""
    common = {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": "float32",
    }
    if architecture == "GPT2LMHeadModel":
        return {
            **common,
            "n_positions": config.block_size,
            "n_ctx": config.block_size,
            "n_embd": config.n_embd,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "layer_norm_epsilon": config.norm_eps,
            "activation_function": "gelu_new" if config.activation == "gelu_tanh" else "gelu",
            **{name: config.dropout for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop")},
            "initializer_range": 0.02,
        }
    rope = {"rope_type": "default", "rope_theta": config.rope_base, **(config.rope_scaling or {})}
    family = {
        "hidden_size": config.n_embd,
        "intermediate_size": config.mlp_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": rope,
        "rope_theta": config.rope_base,  # the key transformers 4 reads
        "hidden_act": "relu2" if architecture == "NanoChatForCausalLM" else "silu",
        "attention_dropout": config.dropout,
    }
    if architecture != "Qwen2ForCausalLM":
        family["attention_bias"] = config.bias
    if architecture == "LlamaForCausalLM":
        family["mlp_bias"] = config.bias
    if architecture == "NanoChatForCausalLM":
        family["final_logit_softcapping"] = config.logit_softcap
    return {**common, **family}


def state_to_hf(config: GPTConfig, state: dict[str, torch.Tensor], architecture: str) -> dict[str, torch.Tensor]:
    """A state dict of `config`'s model as float32 tensors under the Hugging Face names of `architecture` (a tied
    head left out)."""
    tensors = {}
    for key, value in state.items():
        value = value.detach().float().cpu()
        if key == "lm_head.weight" and config.tie_embeddings:
            continue  # tied to the embedding (safetensors stores no shared tensors)
        if architecture == "GPT2LMHeadModel":
            tensors[key] = value.t() if key.endswith(CONV1D_WEIGHTS) else value
            continue
        names = hf_names(key, architecture)
        if ".attn.c_attn." in key:
            widths = [config.n_head * config.head_dim] + [config.n_kv_head * config.head_dim] * 2
        else:
            widths = [value.shape[0] // len(names)] * len(names)
        parts = list(value.split(widths))
        if architecture == "NanoChatForCausalLM" and ".attn.c_attn." in key:
            parts[:2] = [flip_rotation(part, config.head_dim) for part in parts[:2]]
        tensors.update(zip(names, parts))
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def write_hf(
    model: GPT, directory: str | os.PathLike, bos: int | None = None, eos: int | list[int] | None = None
) -> str:
    """Write config.json and model.safetensors that transformers' class for the model loads with our logits;
    returns that class's name. UserError when no class computes the model exactly."""
    architecture = export_architecture(model.config)
    if architecture == "GPT2LMHeadModel":  # biases of zero, a sinusoidal table as learned positions
        config, state = gpt2_tensors(model, exact_gelu=True)
    elif architecture == "NanoChatForCausalLM":  # nanochat's norms have no scale, as ours
        config, state = model.config, model.state_dict()
    else:
        config, state = model.config, unit_norm_scales(model.config, model.state_dict())
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = state_to_hf(config, state, architecture)
    atomic_write_bytes(directory / "model.safetensors", safetensors_bytes(tensors, metadata={"format": "pt"}))
    atomic_write_json(directory / "config.json", hf_config(config, architecture, bos, eos))
    return architecture
