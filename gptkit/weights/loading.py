"""A model and its tokenizer, from a training run's checkpoint, from Hugging Face weights or from a GGUF file: what
sample.py, eval.py and serve.py load before they generate or score, and the settings that say where it comes from.

"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gptkit.core.errors import UserError
from gptkit.core.settings import setting
from gptkit.data.gguf_tokenizer import find_gguf, load_gguf_tokenizer
from gptkit.data.hf_tokenizer import is_hf_tokenizer_dir, load_hf_tokenizer
from gptkit.data.meta import read_meta
from gptkit.data.tokenizer import Tokenizer, make_tokenizer, tokenizer_from_meta
from gptkit.model import GPT
from gptkit.weights.build import is_hf_source, load_model, model_of_checkpoint
from gptkit.weights.checkpoint import is_checkpoint_source, load_checkpoint, resolve_checkpoint
from gptkit.weights.hf import GPT2_HUB_NAMES, is_gpt2_directory, locate
from gptkit.weights.quantization import QUANTIZE_CHOICES, apply_quantization


def load_model_and_tokenizer(
    init_from: str, out_dir: str, checkpoint: str = "best", data_dir: str = ""
) -> tuple[GPT, Tokenizer]:
    """The model (on CPU, eval mode) and its tokenizer.

    init_from: "resume" (the checkpoint of out_dir, `checkpoint` = best or latest; out_dir
    may also be a checkpoint file), a Hugging Face directory or hub name, or a GGUF file (hf_source_tokenizer says
    which tokenizer).
    data_dir: take the tokenizer
    from that data directory's meta.json (for checkpoints without one; a checkpoint's own tokenizer wins, and a
    data directory with another one is refused). UserError for every problem.
    """
    if init_from == "resume":
        path = resolve_checkpoint(out_dir, checkpoint)
        state = load_checkpoint(path)
        model = model_of_checkpoint(state, str(path))  # a LoRA run: its base plus the adapters, merged
        tokenizer_meta = state.get("tokenizer")
        if data_dir:
            tokenizer_meta = data_dir_tokenizer(data_dir, tokenizer_meta, path)
        if not tokenizer_meta:
            raise UserError(
                f"checkpoint {path} records no tokenizer; pass --data_dir=DIR with the meta.json it was trained on"
            )
        try:
            tokenizer = tokenizer_from_meta(tokenizer_meta)
        except UserError as exc:  # say where the tokenizer description came from
            raise UserError(f"{data_dir or f'checkpoint {path}'}: {exc}") from exc
    elif is_hf_source(init_from):
        model = load_model(init_from)
        tokenizer = hf_source_tokenizer(init_from, data_dir)
    else:
        raise unknown_init_from(init_from)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}; "
            "pass the --data_dir the model was trained on"
        )
    return model.eval(), tokenizer


def unknown_init_from(init_from: str) -> UserError:
    """The mistake of an --init_from that names no model these scripts load, said for what it does name."""
    if is_checkpoint_source(init_from):  # train.py takes a run as --init_from; the scripts that run one, --out_dir
        return UserError(
            f"--init_from={init_from!r} is a training run's directory; load it with --out_dir={init_from} "
            "(init_from=resume, the default)"
        )
    if Path(init_from).is_dir():
        return UserError(
            f"--init_from={init_from!r}: {init_from} holds no config.json, so it is no Hugging Face model directory "
            "(nor a training run: no best.pt or ckpt.pt; nor a GGUF file's: no *.gguf)"
        )
    return UserError(
        f"--init_from={init_from!r}: use resume, a Hugging Face directory or hub name (owner/name), "
        f"or {', '.join(GPT2_HUB_NAMES)}, or a .gguf file"
    )


def hf_source_tokenizer(init_from: str, data_dir: str) -> Tokenizer:
    """The tokenizer of Hugging Face weights: the Llama family's own tokenizer.json or a GGUF file's own tokenizer
    (a data_dir must hold the same one), else data_dir's; GPT-2's is data_dir's, else GPT-2's BPE."""
    gguf = find_gguf(init_from)
    directory = gguf or locate(init_from)
    if gguf is not None:
        own = load_gguf_tokenizer(gguf)
    else:
        own = (
            None if is_gpt2_directory(directory) or not is_hf_tokenizer_dir(directory) else load_hf_tokenizer(directory)
        )
    if own is not None and data_dir:
        own_sha = own.to_meta()["tokenizer_json_sha256"]
        if read_meta(data_dir)["tokenizer"].get("tokenizer_json_sha256") != own_sha:
            raise UserError(f"{data_dir} was not tokenized with {init_from}'s own tokenizer; leave out --data_dir")
    if own is not None:
        return own
    if data_dir:
        return tokenizer_from_meta(read_meta(data_dir)["tokenizer"])
    if is_gpt2_directory(directory):
        return make_tokenizer("gpt2")
    raise UserError(
        f"{directory} has no tokenizer.json; pass --data_dir=DIR whose meta.json holds the model's tokenizer"
    )


def data_dir_tokenizer(data_dir: str, recorded: dict | None, path: Path) -> dict:
    """The tokenizer object of data_dir's meta.json, which must be the one the checkpoint at `path` records (when it
    records one): sampling a model through another tokenizer gives garbage."""
    tokenizer_meta = read_meta(data_dir)["tokenizer"]
    # A checkpoint's record is meta.json's tokenizer object plus vocab_size and eot_token (checkpoint.tokenizer_record)
    own = None if recorded is None else {k: v for k, v in recorded.items() if k not in ("vocab_size", "eot_token")}
    if own is not None and own != tokenizer_meta:
        raise UserError(
            f"--data_dir={data_dir} holds another tokenizer than the one checkpoint {path} records; leave --data_dir "
            "out (the checkpoint's own tokenizer is used)"
        )
    return tokenizer_meta


@dataclass
class ModelLocation:
    """Which trained model a script takes (export.py, and through ModelSource the scripts that run one). Settings
    classes extend it (and call its validate)."""

    out_dir: str = setting("out", "training output directory (or a checkpoint file) to load the model from")
    checkpoint: str = setting("best", "which checkpoint of out_dir: best (best val loss) or latest")
    init_from: str = setting(
        "resume",
        "resume = the out_dir checkpoint; or a Hugging Face dir or hub name (owner/name), a .gguf file, or gpt2*",
    )
    data_dir: str = setting(
        "", "take the tokenizer from this data dir's meta.json: for checkpoints that record none (it must match one)"
    )

    def validate(self) -> None:
        if self.checkpoint not in ("best", "latest"):
            raise UserError(f"--checkpoint must be best or latest, got {self.checkpoint!r}")


@dataclass
class ModelSource(ModelLocation):
    """The settings of the scripts that run a trained model (sample.py, eval.py, serve.py): which model, and how
    its weights are stored."""

    quantize: str = setting(
        "none",
        "none; int8: int8 weights for CPU decoding (float32 compute); int4: 4-bit weights in groups of 32 with a "
        "scale and minimum each (GGUF's Q4_1), for CPU decoding (float32 compute in the native step)",
        choices=QUANTIZE_CHOICES,
    )
    block_size: int | None = setting(
        None,
        "crop the model's context to this many tokens (None: its own); the KV cache holds this many positions, "
        "so a long one (Llama 3's 131072) needs it",
        rule="positive",
    )


def load_for_inference(source: ModelSource, device: torch.device, dtype: torch.dtype) -> tuple[GPT, Tokenizer]:
    """The model of `source` on `device` (eval mode, int8 or int4 weights when source.quantize says so) and its
    tokenizer. `dtype` is the compute dtype the script will run under (int8 needs float32)."""
    model, tokenizer = load_model_and_tokenizer(source.init_from, source.out_dir, source.checkpoint, source.data_dir)
    if source.block_size is not None and source.block_size < model.config.block_size:
        model.crop_block_size(source.block_size)
    model.to(device)  # the engine picks its decoding backend itself (gptkit.infer.decoding)
    apply_quantization(model, source.quantize, dtype)
    return model, tokenizer
