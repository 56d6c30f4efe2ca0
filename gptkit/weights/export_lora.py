"""A LoRA run for other tools (export.py --format=merged|peft): the base with its adapters folded in as an ordinary
checkpoint, or the adapters as Hugging Face PEFT reads them beside their base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from gptkit.core.errors import UserError
from gptkit.data.tokenizer import tokenizer_from_meta
from gptkit.model import GPT, config_from_dict, config_to_dict
from gptkit.weights.checkpoint import save_checkpoint
from gptkit.weights.export_hf import export_hf
from gptkit.weights.hf import GPT2_HUB_NAMES
from gptkit.weights.lora import FrozenLinear, LoraConfig, write_peft_adapter
from gptkit.weights.quantization import block_products
from gptkit.weights.sources import checked_lora_record, lora_base, model_of_checkpoint


def merge_to(checkpoint: dict[str, Any], where: str, directory: Path) -> None:
    """Write the merged model of a LoRA run's checkpoint as DIR/ckpt.pt: sample.py, serve.py, eval.py and train.py
    read it like any other."""
    model = model_of_checkpoint(checkpoint, where)
    directory.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "model_args": config_to_dict(model.config)}
    save_checkpoint(directory / "ckpt.pt", {**state, "tokenizer": checkpoint.get("tokenizer")})


def peft_to(checkpoint: dict[str, Any], where: str, directory: Path, final: Path | None = None) -> None:
    """Write a LoRA run's adapters for PEFT into `directory`, with the base beside them (DIR/base, as export.py
    --format=hf writes it: weights and tokenizer) unless the base is a GPT-2 hub model the run added no token rows
    to. Added rows (a chat template's markers) are in DIR/base at their starting values, and their trained values
    in the adapter (the embedding's, and an untied head's). `final`: where `directory` will be moved (the adapter
    names its base there, by its absolute path)."""
    record = checked_lora_record(checkpoint["lora"], where)
    vocab_size = checkpoint["model_args"]["vocab_size"]
    base = record["base"]["source"]
    grown = record.get("first_new_row") is not None and record["first_new_row"] < vocab_size
    model_config = config_from_dict(checkpoint["model_args"])
    if (grown or base not in GPT2_HUB_NAMES) and not checkpoint.get("tokenizer"):
        raise UserError(f"{where} records no tokenizer, which the base's Hugging Face directory needs")
    held = record["base_weights"]
    directory.mkdir(parents=True, exist_ok=True)
    if grown or base not in GPT2_HUB_NAMES or held != "float32":
        # Any base export.py takes (no biases: zero ones; an untied head), with the tokenizer the run trained on,
        # holding the values the run's frozen base held (its int4 blocks as the run read them).
        model = held_base(lora_base(record["base"], where, int4_products=held == "int4"), held)
        if vocab_size > model.config.vocab_size:
            model.grow_vocabulary(vocab_size)  # the rows the run added, as it started them
        export_hf(model, tokenizer_from_meta(checkpoint["tokenizer"]), directory / "base")
        base = str(((final or directory) / "base").resolve())  # PEFT finds it from any working directory
    config = LoraConfig.from_dict(record["config"], where)
    rows = record.get("first_new_row") if grown else None
    write_peft_adapter(directory, checkpoint["model"], config, base, rows, model_config=model_config)


def held_base(model: GPT, base_weights: str) -> GPT:
    """`model` (in place; returned) with each product of its blocks a float32 Linear of the values a LoRA run's frozen
    base held under `base_weights` (bfloat16, int8 and int4 round the float32 ones): the base its adapters trained
    against, so that PEFT gives the run's logits."""
    for name in block_products(model):
        parent_name, _, child = name.rpartition(".")
        product = model.get_submodule(name)
        if base_weights == "float32" and isinstance(product, nn.Linear):
            continue
        setattr(model.get_submodule(parent_name), child, FrozenLinear(product, base_weights).merged())
    return model
