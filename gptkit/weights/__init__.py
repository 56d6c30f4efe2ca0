"""A model's weights on disk and in memory: `load(source)` reads any model with its tokenizer (gptkit.weights.sources);
beside it the formats (checkpoints, LoRA adapters, Hugging Face's and llama.cpp's files), int8 and int4 weights, and
the exports."""

from gptkit.weights.sources import Loaded, load, source_kind

__all__ = ["Loaded", "load", "source_kind"]
