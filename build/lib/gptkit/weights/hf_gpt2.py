"""GPT-2 in Hugging Face's file layout: read a local or downloaded directory, and write one transformers loads.

A directory holds config.json and model.safetensors (or an older pytorch_model.bin). Its tensor names are this
toolkit's (nanoGPT's) with or without the `transformer.` prefix; the four attention/MLP projections are stored
as Conv1D weights (in, out), the transpose of nn.Linear's; `attn.bias`/`attn.masked_bias` are old causal-mask
buffers; a missing lm_head.weight means the head is tied to the token embedding.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from gptkit.core.errors import UserError
from gptkit.model import GPT, GPTConfig

GPT2_HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_CONFIG_KEYS = {
    "block_size": "n_positions",
    "vocab_size": "vocab_size",
    "n_layer": "n_layer",
    "n_head": "n_head",
    "n_embd": "n_embd",
}
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def locate(name_or_dir: str) -> Path:
    """The directory for a local path, or for a hub name after downloading it (once) into the cache."""
    directory = Path(name_or_dir)
    if directory.is_dir():
        return directory
    if name_or_dir not in GPT2_HUB_NAMES:
        raise UserError(f"{name_or_dir} is neither a directory nor one of {', '.join(GPT2_HUB_NAMES)}")
    return download(name_or_dir)


def download(name: str) -> Path:
    """Fetch a GPT-2 checkpoint's config.json and model.safetensors from the Hugging Face Hub (HF_ENDPOINT)
    into the download cache, once; returns the directory. UserError when offline or unreachable."""
    from gptkit.core.download import fetch

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        raise UserError(f"cannot download {name}: HF_HUB_OFFLINE is set (offline); pass a local GPT-2 directory")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    for filename in ("config.json", "model.safetensors"):
        path = fetch(f"{endpoint}/openai-community/{name}/resolve/main/{filename}", name=f"hf/{name}/{filename}")
    return path.parent


def read_config(directory: Path) -> dict[str, Any]:
    """GPTConfig arguments (sizes, bias, activation) from the directory's config.json."""
    try:
        hf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        sizes = {ours: int(hf[theirs]) for ours, theirs in _CONFIG_KEYS.items()}
        activation = _ACTIVATIONS[hf.get("activation_function", "gelu_new")]
    except FileNotFoundError:
        raise UserError(f"{directory} has no config.json; is it a Hugging Face GPT-2 directory?") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # bad JSON, missing or odd entries
        raise UserError(f"{directory}/config.json is not a usable GPT-2 config ({type(exc).__name__}: {exc})") from None
    return {**sizes, "bias": True, "activation": activation}


def read_state(directory: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The directory's weights under this model's names, checked against the `expected` state dict's shapes."""
    state = _read_tensors(directory)
    missing = [k for k in expected if k not in state and k != "lm_head.weight"]
    if missing:
        raise UserError(f"{directory}: weights file lacks {len(missing)} tensors, e.g. {missing[0]}")
    state.setdefault("lm_head.weight", state["transformer.wte.weight"])
    for key, value in expected.items():
        if state[key].shape != value.shape:
            raise UserError(f"{directory}: {key} has shape {tuple(state[key].shape)}, expected {tuple(value.shape)}")
    return {key: state[key] for key in expected}


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / "model.safetensors").exists():
        from safetensors.torch import load_file

        loader, path = load_file, directory / "model.safetensors"
    elif (directory / "pytorch_model.bin").exists():
        path = directory / "pytorch_model.bin"

        def loader(file: Path) -> dict:
            return torch.load(file, map_location="cpu", weights_only=True)
    else:
        raise UserError(f"{directory} has neither model.safetensors nor pytorch_model.bin")
    try:
        raw = loader(path)
    except Exception as exc:  # truncated or foreign files, and pickles that would run code, are all refused
        raise UserError(f"cannot read weights {path}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise UserError(f"{path} does not hold a state dict of tensors")
    state = {}
    for key, value in raw.items():
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # old causal-mask buffers, not weights
        if not key.startswith(("transformer.", "lm_head.")):
            key = "transformer." + key
        state[key] = value.t() if key.endswith(CONV1D_WEIGHTS) else value
    return state


def write(
    directory: str | os.PathLike,
    model_args: dict[str, Any],
    state: dict[str, torch.Tensor],
    eot_token: int | None = 50256,
) -> None:
    """Write config.json and model.safetensors for a GPT-2-shaped model (its model_args and state dict; an untied
    head is written as lm_head.weight). `eot_token`: the beginning- and end-of-sequence id (None: there is none)."""
    from safetensors.torch import save as safetensors_bytes

    from gptkit.core.fileio import atomic_write_bytes, atomic_write_json

    dropout = model_args["dropout"]
    tied = model_args.get("tie_embeddings", True)
    hf_config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model_args["vocab_size"],
        "n_positions": model_args["block_size"],
        "n_ctx": model_args["block_size"],
        "n_embd": model_args["n_embd"],
        "n_layer": model_args["n_layer"],
        "n_head": model_args["n_head"],
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new" if model_args["activation"] == "gelu_tanh" else "gelu",
        "resid_pdrop": dropout,
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
        "initializer_range": 0.02,
        "tie_word_embeddings": tied,
        "bos_token_id": eot_token,
        "eos_token_id": eot_token,
    }
    tensors = {}
    for key, value in state.items():
        if key == "lm_head.weight" and tied:
            continue  # tied to transformer.wte.weight (safetensors stores no shared tensors)
        value = value.detach().cpu()
        tensors[key] = value.t().contiguous() if key.endswith(CONV1D_WEIGHTS) else value.contiguous()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / "model.safetensors", safetensors_bytes(tensors, metadata={"format": "pt"}))
    atomic_write_json(directory / "config.json", hf_config)


def load_gpt2(name_or_dir: str, override_args: dict[str, Any] | None = None) -> GPT:
    """GPT-2 weights from a local Hugging Face directory or a hub name (gpt2, gpt2-medium, ...) as our GPT.

    override_args may change what does not change shapes (dropout).
    """
    directory = locate(name_or_dir)
    try:
        config = GPTConfig(**read_config(directory), **(override_args or {}))
    except (TypeError, ValueError) as exc:
        raise UserError(f"{directory}/config.json describes a model we cannot build ({exc})") from exc
    model = GPT(config)
    model.load_state_dict(read_state(directory, model.state_dict()))
    return model


def save_gpt2(model: GPT, directory: str | os.PathLike) -> None:
    """Write config.json and model.safetensors that transformers' GPT2LMHeadModel.from_pretrained loads."""
    config = model.config
    standard = config.pos_encoding == "learned" and config.bias and config.activation != "relu2"
    if not (standard and config.tie_embeddings and not config.qk_norm):
        raise UserError("only GPT-2-shaped models (learned positions, bias, GELU, tied head) export to GPT-2")
    write(directory, dataclasses.asdict(config), model.state_dict())
