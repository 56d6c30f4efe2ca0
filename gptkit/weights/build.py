"""Every way to get a GPT, in one place: from one of our checkpoints, from a LoRA run's checkpoint (its base with the
adapters), from a Hugging Face directory or hub name, or from a GGUF file. The formats themselves live beside it:
checkpoint.py (our files), lora.py (the adapters), hf.py (Hugging Face's files), gguf_read.py (llama.cpp's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptkit.core.errors import UserError
from gptkit.core.fileio import sha256_file
from gptkit.data.gguf_tokenizer import find_gguf, gguf_tokenizer_record
from gptkit.data.hf_tokenizer import is_hf_tokenizer_dir, read_hf_record
from gptkit.model import GPT, config_from_dict
from gptkit.weights.checkpoint import (
    is_checkpoint_source,
    load_checkpoint,
    load_model_weights,
    model_args_of,
    resolve_checkpoint,
)
from gptkit.weights.gguf_read import load_gguf
from gptkit.weights.hf import (
    GPT2_HUB_NAMES,
    is_gpt2_directory,
    is_hub_name,
    load_hf,
    locate,
    read_torch_bin,
    weight_files,
)
from gptkit.weights.lora import LoraConfig, add_lora, load_adapter_state, merge_lora


def model_from_checkpoint(checkpoint: dict[str, Any], source: str, overrides: dict[str, Any] | None = None) -> GPT:
    """Rebuild the GPT a checkpoint describes and load its weights (on CPU).

    `overrides` replaces model_args entries that do not change shapes, e.g. {"dropout": 0.1}. Raises UserError
    when model_args are invalid or do not match the weights.
    """
    try:
        config = config_from_dict({**model_args_of(checkpoint), **(overrides or {})})
    except (TypeError, ValueError) as exc:  # ValueError: GPTConfig refuses the values
        raise UserError(f"checkpoint {source} has invalid model_args ({exc}); the file is damaged") from exc
    model = GPT(config)
    load_model_weights(model, checkpoint["model"], source)
    return model


def model_of_checkpoint(checkpoint: dict[str, Any], where: str, overrides: dict[str, Any] | None = None) -> GPT:
    """The model a checkpoint holds, as plain weights: a LoRA run's adapters merged into its base."""
    if "lora" in checkpoint:
        return merge_lora(model_with_adapters(checkpoint, where, overrides))
    return model_from_checkpoint(checkpoint, where, overrides)


def is_hf_source(init_from: str) -> bool:
    """Whether --init_from names open weights: a Hugging Face directory (config.json), a GPT-2 name or a hub name, or
    a GGUF file (or the directory of one)."""
    hf = (Path(init_from) / "config.json").is_file() or init_from in GPT2_HUB_NAMES or is_hub_name(init_from)
    return hf or find_gguf(init_from) is not None


def check_hf_base_tokenizer(meta: dict[str, Any], init_from: str) -> None:
    """UserError unless data for fine-tuning Hugging Face weights was tokenized as the model's: the Llama family's
    own tokenizer.json (the record prepare_data --tokenizer=DIR writes), GPT-2's BPE for chat data on GPT-2, a GGUF
    file's own tokenizer."""
    gguf = find_gguf(init_from)
    if gguf is not None:
        if meta["tokenizer"].get("tokenizer_json_sha256") != gguf_tokenizer_record(gguf)["tokenizer_json_sha256"]:
            raise UserError(
                f"init_from={init_from} needs data in its own tokenizer; prepare it with --tokenizer={gguf}"
            )
        return
    directory = locate(init_from)
    tokenizer = meta["tokenizer"]
    if not is_gpt2_directory(directory):
        own = read_hf_record(directory)["tokenizer_json_sha256"] if is_hf_tokenizer_dir(directory) else None
        if own is not None and tokenizer.get("tokenizer_json_sha256") != own:
            raise UserError(
                f"init_from={init_from} needs data in its own tokenizer; prepare it with --tokenizer={directory}"
            )
    elif "chat" in tokenizer and (tokenizer["kind"] != "tiktoken" or tokenizer.get("encoding") != "gpt2"):
        raise UserError(
            f"init_from={init_from} needs data in GPT-2's BPE; prepare it with prepare_data/chat.py --tokenizer=gpt2"
        )


def load_model(init_from: str, overrides: dict[str, Any] | None = None, dtype: str = "float32") -> GPT:
    """The plain model (on CPU) of a checkpoint file or run directory (a LoRA run merged), of Hugging Face weights or
    of a GGUF file."""
    if is_checkpoint_source(init_from):
        path = resolve_checkpoint(init_from, "best")
        return model_of_checkpoint(load_checkpoint(path), str(path), overrides)
    gguf = find_gguf(init_from)
    if gguf is not None:
        return load_gguf(gguf, dtype=dtype, override_args=overrides)
    return load_hf(init_from, dtype=dtype, override_args=overrides)


# ----------------------------------------------------------------------------- LoRA runs

# A LoRA run's checkpoint stores only what trained ("model": adapter_state) and, under "lora", how to rebuild the
# rest: the settings, and the base it started from by path (or hub name) and the sha256 of its weights files.


def base_reference(init_from: str) -> dict[str, str]:
    """{"source", "sha256"} of the base a LoRA run starts from: one of our checkpoints (a file, or an out_dir's
    best.pt, else ckpt.pt), Hugging Face weights (a hub name or a directory: its weights files) or a GGUF file."""
    if is_checkpoint_source(init_from):
        path = resolve_checkpoint(init_from, "best").resolve()
        return {"source": str(path), "sha256": sha256_file(path)}
    gguf = find_gguf(init_from)
    if gguf is not None:
        return {"source": str(gguf.resolve()), "sha256": sha256_file(gguf)}
    directory = locate(init_from)
    legacy = directory / "pytorch_model.bin"
    if legacy.is_file() and not (directory / "model.safetensors").is_file():
        read_torch_bin(legacy)  # refused here, at the start, if it cannot be read safely
        files = [legacy]
    else:
        files = weight_files(directory)
    digest = ",".join(sha256_file(path) for path in files)
    source = str(Path(init_from).resolve()) if Path(init_from).is_dir() else init_from  # a hub name stays a name
    return {"source": source, "sha256": digest}


def load_base(reference: dict[str, str], where: str, overrides: dict[str, Any] | None = None) -> GPT:
    """The base model a LoRA checkpoint names, after checking that its weights are the ones it was trained on."""
    source = reference["source"]
    if source not in GPT2_HUB_NAMES and not is_hub_name(source) and not Path(source).exists():
        raise UserError(f"{where}: its base {source} is missing; put the base model back there (the adapters need it)")
    found = base_reference(source)["sha256"]
    if found != reference["sha256"]:
        raise UserError(
            f"{where}: its base {source} has changed since the adapters were trained (sha256 {found[:12]}..., expected "
            f"{reference['sha256'][:12]}...); use the base they were trained on"
        )
    return load_model(source, overrides)  # a LoRA base: merged first


def model_with_adapters(checkpoint: dict[str, Any], where: str, overrides: dict[str, Any] | None = None) -> GPT:
    """The model a LoRA checkpoint stands for: its base (checked), cropped and grown to the run's shape, with the
    adapters in place (still separate: call merge_lora for plain weights)."""
    record = checkpoint["lora"]
    config = LoraConfig.from_dict(record.get("config"), where)
    model = load_base(record["base"], where, overrides)
    shape = checkpoint["model_args"]
    if shape["block_size"] < model.config.block_size:
        model.crop_block_size(shape["block_size"])
    if shape["vocab_size"] > model.config.vocab_size:
        model.grow_vocabulary(shape["vocab_size"])
    add_lora(model, config, record["base_weights"], record.get("first_new_row"))
    load_adapter_state(model, checkpoint["model"], where)
    return model
