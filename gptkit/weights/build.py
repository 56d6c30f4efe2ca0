"""The names train.py imports to build its starting model, each one call of gptkit.weights.sources, where
gptkit.weights.load reads every source; this module goes once train.py loads through that door."""

from __future__ import annotations

from typing import Any

from gptkit.model import GPT
from gptkit.weights.sources import (
    base_reference,
    check_open_weights_tokenizer,
    load,
    model_of_checkpoint,
    model_with_adapters,
    open_weights_path,
    source_kind,
)

__all__ = [
    "base_reference",
    "check_hf_base_tokenizer",
    "load_model",
    "model_from_checkpoint",
    "model_of_checkpoint",
    "model_with_adapters",
]


def model_from_checkpoint(checkpoint: dict[str, Any], source: str, overrides: dict[str, Any] | None = None) -> GPT:
    return model_of_checkpoint(checkpoint, source, overrides=overrides)


def load_model(init_from: str, overrides: dict[str, Any] | None = None) -> GPT:
    return load(init_from, overrides=overrides, tokenizer=False).model.train()


def check_hf_base_tokenizer(meta: dict[str, Any], init_from: str) -> None:
    kind = source_kind(init_from)
    check_open_weights_tokenizer(meta, init_from, kind, open_weights_path(init_from, kind))
