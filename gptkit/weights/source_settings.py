"""The settings with which sample.py, serve.py, eval.py and export.py name their model (ModelLocation, ModelSource),
the source they give gptkit.weights.load, and the model placed for decoding as they ask."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkit.core.errors import UserError
from gptkit.core.settings import setting
from gptkit.model import GPT
from gptkit.weights.checkpoint import resolve_checkpoint
from gptkit.weights.gguf_read import FLOAT_TYPES
from gptkit.weights.hf import GPT2_HUB_NAMES
from gptkit.weights.lora import FrozenLinear, merge_lora
from gptkit.weights.quantization import QUANTIZE_CHOICES, FileLinear, Int4Linear, Int8Linear, apply_quantization
from gptkit.weights.sources import names_a_path, source_kind, unknown_source


@dataclass(kw_only=True)
class ModelLocation:
    """Which trained model a script takes (export.py, and through ModelSource the scripts that run one). Settings
    classes extend it (and call its validate)."""

    out_dir: str = setting("out", "training output directory (or a checkpoint file) to load the model from")
    checkpoint: str = setting("best", "which checkpoint of out_dir: best (best val loss) or latest")
    init_from: str = setting(
        "resume",
        "resume = the out_dir checkpoint; or a Hugging Face dir or hub name (owner/name), a .gguf file or a hub "
        "repository's (owner/name:TAG, e.g. :Q4_K_M), or gpt2*",
    )
    data_dir: str = setting(
        "", "take the tokenizer from this data dir's meta.json: for checkpoints that record none (it must match one)"
    )

    def validate(self) -> None:
        if self.checkpoint not in ("best", "latest"):
            raise UserError(f"--checkpoint must be best or latest, got {self.checkpoint!r}")

    def source(self) -> str:
        """What gptkit.weights.load reads: out_dir's run for init_from=resume, else init_from, which names open
        weights (a run is loaded with --out_dir)."""
        if self.init_from == "resume":
            if source_kind(self.out_dir) != "checkpoint":
                resolve_checkpoint(self.out_dir, self.checkpoint)  # says which files it looked for
                raise UserError(f"--out_dir={self.out_dir} is no checkpoint; give open weights as --init_from")
            return self.out_dir
        kind = source_kind(self.init_from)
        if kind == "checkpoint":  # train.py takes a run as --init_from; the scripts that run one, --out_dir
            raise UserError(
                f"--init_from={self.init_from!r} is a training run's directory; load it with "
                f"--out_dir={self.init_from} (init_from=resume, the default)"
            )
        if kind is None and (Path(self.init_from).is_dir() or names_a_path(self.init_from)):
            raise UserError(f"--init_from={self.init_from!r}: {unknown_source(self.init_from)}")
        if kind is None:
            raise UserError(
                f"--init_from={self.init_from!r}: use resume, a Hugging Face directory or hub name (owner/name), "
                f"or {', '.join(GPT2_HUB_NAMES)}, or a .gguf file"
            )
        return self.init_from


@dataclass(kw_only=True)
class ModelSource(ModelLocation):
    """The settings of the scripts that run a trained model (sample.py, eval.py, serve.py): which model, and how
    its weights are stored."""

    quantize: str = setting(
        "none",
        "none: the weights as stored (a GGUF file all of whose products are Q4_0 or Q4_1 keeps its 4-bit blocks); "
        "int8: int8 weights for CPU decoding (float32 compute); int4: 4-bit weights in groups of 32 with a "
        "scale and minimum each (GGUF's Q4_1), for CPU decoding (float32 compute in the native step)",
        choices=QUANTIZE_CHOICES,
    )
    block_size: int | None = setting(
        None,
        "crop the model's context to this many tokens (None: its own); a server's KV cache holds this many "
        "positions a slot, so a long one (Llama 3's 131072) needs it (sample.py's holds what its samples reach)",
        rule="positive",
    )


def keeps_int4_in_file(settings: ModelSource, device: torch.device, decode: str) -> bool:
    """Whether a GGUF file's Q4_0 and Q4_1 matrices stay in the file, read as they are needed, rather than becoming
    float32 weights (load's keep_int4): when they decode as they are, on the CPU (--quantize none or int4), by a
    backend that reads them as it runs (not compiled: its graph cannot read a file). A 1.7B model's 4-bit file then
    decodes in little more memory than the native step's packed copy of its weights."""
    return device.type == "cpu" and settings.quantize != "int8" and decode != "compiled"


# What a merged LoRA product becomes under each --quantize (apply_quantization's own conversions, done one product
# at a time); "none" keeps it float32.
MERGED_PRODUCT = {"int4": Int4Linear.from_linear, "int8": Int8Linear.from_linear}


def for_inference(model: GPT, settings: ModelSource, device: torch.device, dtype: torch.dtype) -> GPT:
    """`model` (in place; returned) ready to decode as `settings` ask: a LoRA run's adapters merged (given apart:
    load(merge=False)), its context cropped to their block_size, on `device`, with int8 or int4 weights when their
    quantize says so. `dtype` is the compute dtype the script runs under (int8 needs float32)."""
    if any(isinstance(module, FrozenLinear) for module in model.modules()):
        merge_lora(model, MERGED_PRODUCT.get(settings.quantize))  # each product quantized as it is merged
    if settings.block_size is not None and settings.block_size > model.config.block_size:
        raise UserError(
            f"--block_size={settings.block_size} is past the model's context of {model.config.block_size} tokens; "
            "it can only shorten it"
        )
    if settings.block_size is not None and settings.block_size < model.config.block_size:
        model.crop_block_size(settings.block_size)
    model.to(device)  # the engine picks its decoding backend itself (gptkit.infer.decoding)
    note = float_copy_note(model) if settings.quantize == "none" else None
    apply_quantization(model, settings.quantize, dtype)
    if note:  # after the products are read: a damaged file's error stays one line
        print(note, file=sys.stderr, flush=True)
    return model


def float_copy_note(model: GPT) -> str | None:
    """A note for a GGUF file's products in quantized types decoding does not run on (K- and I-quants, Q5_x), which
    --quantize=none makes float32: how large that is, and that --quantize=int4 keeps them in 4 bits. Why: a Q4_K_M
    file, the most common, would otherwise take some seven times its size without a word."""
    quantized = {
        module: module.read.types - set(FLOAT_TYPES) for module in model.modules() if isinstance(module, FileLinear)
    }
    stored = [module for module, types in quantized.items() if types]
    if not stored:
        return None
    types = set().union(*quantized.values())
    size = sum(4 * module.out_features * module.in_features for module in stored)
    shown = f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
    return (
        f"note: the file's {', '.join(sorted(types))} products decode in float32 under --quantize=none ({shown}); "
        "--quantize=int4 keeps them in 4 bits"
    )
