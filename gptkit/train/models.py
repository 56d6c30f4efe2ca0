"""The model a run trains, made once at set-up, and what its checkpoints keep of it.

create_model starts from one of four places (scratch, a checkpoint to fine-tune, the run's own ckpt.pt to resume,
Hugging Face weights), crops it to block_size, grows its vocabulary for a chat template's new tokens and, for LoRA,
freezes it and adds the adapters. A LoRA run's checkpoints hold the adapters and a record that finds the base
again (checkpoint_weights); everything else about LoRA is settled here, at set-up. frozen_reference is the
starting model DPO and GRPO compare with.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

from gptkit.core.errors import UserError
from gptkit.core.settings import settings_to_dict
from gptkit.data.conversations import is_chat_data
from gptkit.data.tokenizer import padded_vocab_size
from gptkit.model import GPT, GPTConfig
from gptkit.train import ema
from gptkit.train.reference import Reference, starting_point
from gptkit.weights import checkpoint as ckpt
from gptkit.weights.lora import adapter_state, add_lora, lora_record
from gptkit.weights.sources import (
    base_reference,
    check_data_tokenizer,
    checked_lora_record,
    load,
    model_of_checkpoint,
    unchanged_source,
)


def model_config(settings: Any, vocab_size: int = GPTConfig.vocab_size) -> GPTConfig:
    """The model the settings describe: every GPTConfig field that is also a setting (n_layer, dropout,
    pos_encoding, ...) comes from them. GPTConfig checks the values, the one place model settings are checked; its
    ValueError is the user's mistake here."""
    options = {f.name: getattr(settings, f.name) for f in dataclasses.fields(GPTConfig) if hasattr(settings, f.name)}
    try:
        return GPTConfig(**options, vocab_size=vocab_size)
    except ValueError as exc:
        message = str(exc)  # GPTConfig names its fields; here each is a setting, written as one (--dropout)
        first_word = re.match(r"\w+", message)
        setting_named = first_word is not None and first_word.group() in options
        raise UserError(f"--{message}" if setting_named else message) from exc


def create_model(cfg: Any, meta: dict) -> tuple[GPT, dict | None, dict | None]:
    """The model to train (on CPU) for train.py's settings `cfg` and the data's meta.json; the checkpoint a resumed
    run continues (else None); and a LoRA run's checkpoint record (else None)."""
    resumed = resumed_checkpoint(cfg, meta) if cfg.init_from == "resume" else None
    if resumed is not None and "lora" in resumed:  # the base again, and the adapters as they were
        where = str(Path(cfg.out_dir) / ckpt.LATEST_NAME)
        model = model_of_checkpoint(resumed, where, overrides={"dropout": cfg.dropout}, merge=False)
        return model, resumed, resumed["lora"]
    model = starting_model(cfg, meta, resumed)
    base_rows = model.config.vocab_size
    fit_to_data(cfg, model, meta)
    return model, resumed, add_adapters(cfg, model, base_rows) if cfg.lora_rank else None


# What a resume changes by its nature: the run is continued (init_from), longer (max_iters), or only evaluated.
RESUME_SETTINGS = frozenset({"init_from", "max_iters", "eval_only", "overwrite"})


def changed_settings_note(cfg: Any, resumed: dict | None) -> str | None:
    """For a resumed run, a note naming the settings that differ from those its checkpoint was saved with (None:
    none, or not a resume). Why: the data, the loss's scale (dpo_beta) or the batch change what the run trains and
    what its best val loss compares, and a resume takes them silently otherwise."""
    saved = resumed.get("config") if resumed is not None else None
    if not isinstance(saved, dict):
        return None
    shape = {field.name for field in dataclasses.fields(GPTConfig)} - {"dropout"}  # the model's own (unused_shape_note)
    changed = [
        f"{name} {saved[name]!r} -> {value!r}"
        for name, value in settings_to_dict(cfg).items()
        if name in saved and name not in RESUME_SETTINGS | shape and saved[name] != value
    ]
    return f"note: resumed with settings other than the run's: {', '.join(changed)}" if changed else None


def unused_shape_note(cfg: Any, config: GPTConfig) -> str | None:
    """A note naming the model settings changed from their defaults (in a config file or a flag) that a model read
    from init_from does not take: its shape is its own, its context too (dropout and a shorter block_size apply;
    None: nothing to say). Why: a resumed or fine-tuned run would otherwise train another model than the flags
    describe, silently."""
    if cfg.init_from == "scratch":
        return None
    own = {"dropout", "vocab_size"}
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    unused = [
        f"{name}={getattr(cfg, name)!r} (the model's: {getattr(config, name)!r})"
        for name in (f.name for f in dataclasses.fields(GPTConfig))
        if name in fields and name not in own
        if getattr(cfg, name) != fields[name].default and getattr(cfg, name) != getattr(config, name)
        if name != "block_size" or getattr(cfg, name) > config.block_size  # a shorter one crops the model
    ]
    if not unused:
        return None
    return f"note: the model's shape comes from init_from={cfg.init_from}; not used: {', '.join(unused)}"


def resumed_checkpoint(cfg: Any, meta: dict) -> dict:
    """out_dir/ckpt.pt, checked: everything a resume needs, and the data's tokenizer."""
    path = Path(cfg.out_dir) / ckpt.LATEST_NAME
    checkpoint = ckpt.load_checkpoint(path, required_keys=ckpt.RESUME_KEYS)
    ckpt.check_same_tokenizer(checkpoint, meta, path)
    settings = checkpoint.get("config")  # the run's settings (settings_to_dict)
    recorded = settings.get("objective") if isinstance(settings, dict) else None
    if recorded is not None and recorded != cfg.objective:  # another loss on the same weights and optimizer state
        raise UserError(f"{path} was trained with --objective={recorded}; resume it with --objective={recorded}")
    take_lora_settings(cfg, checkpoint.get("lora"), path)
    return checkpoint


LORA_SETTINGS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_base_weights")


def take_lora_settings(cfg: Any, record: dict | None, path: Path) -> None:
    """A resumed run trains what its checkpoint holds: a LoRA run's settings become cfg's (its log line, saved
    settings and reference are then the run's), and LoRA settings given otherwise are refused in one line, as is any
    for a run that trained every weight. Why: the adapters of the checkpoint's rank and targets train whatever the
    flags say."""
    defaults = {field.name: field.default for field in dataclasses.fields(cfg)}
    given = {name: getattr(cfg, name) for name in LORA_SETTINGS if getattr(cfg, name) != defaults[name]}
    if record is None:
        if given:
            flags = ", ".join(f"--{name}" for name in given)
            raise UserError(
                f"{path} trained every weight, and a resume trains what it holds: leave out {flags}, or put adapters "
                f"on its model in a new run (--init_from={path.parent} --out_dir=ANOTHER)"
            )
        return
    config = checked_lora_record(record, str(path))["config"]
    runs = {f"lora_{key}": value for key, value in config.items()} | {"lora_base_weights": record["base_weights"]}
    changed = [
        f"--{name}={value!r} (the run's: {runs[name]!r})" for name, value in given.items() if value != runs[name]
    ]
    if changed:
        raise UserError(f"{path} trains adapters of other settings: {', '.join(changed)}; leave those flags out")
    for name, value in runs.items():
        setattr(cfg, name, value)


def starting_model(cfg: Any, meta: dict, resumed: dict | None) -> GPT:
    """The model as init_from gives it: new weights, the resumed checkpoint's, a checkpoint's weights to fine-tune
    (no optimizer), or Hugging Face weights."""
    overrides = {"dropout": cfg.dropout}
    if cfg.init_from == "scratch":
        return GPT(model_config(cfg, data_vocab_size(cfg, meta)))
    if resumed is not None:
        weights = resumed if cfg.eval_only else ema.trained_weights(resumed)  # not the EMA's
        return model_of_checkpoint(weights, str(Path(cfg.out_dir) / ckpt.LATEST_NAME), overrides=overrides)
    # a checkpoint, open weights or a GGUF file, whose 4-bit products QLoRA holds as they are, never float32
    qlora = bool(cfg.lora_rank) and cfg.lora_base_weights == "int4"
    loaded = load(cfg.init_from, overrides=overrides, tokenizer=False, int4_products=qlora)
    check_data_tokenizer(loaded, meta)
    return loaded.model.train()


def fit_to_data(cfg: Any, model: GPT, meta: dict) -> None:
    """Crop the model to block_size, and grow its vocabulary for a chat template's special tokens; UserError for
    data in a larger vocabulary it cannot read."""
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)  # e.g. GPT-2's 1024 positions fine-tuned on shorter windows
    if meta["vocab_size"] > model.config.vocab_size and (cfg.init_from == "resume" or not is_chat_data(meta)):
        raise UserError(
            f"the data's vocab_size ({meta['vocab_size']}) is larger than the model's ({model.config.vocab_size}); "
            f"init_from={cfg.init_from} cannot read this data's tokens, use data from the model's tokenizer"
        )
    if meta["vocab_size"] > model.config.vocab_size:
        model.grow_vocabulary(data_vocab_size(cfg, meta))


def data_vocab_size(cfg: Any, meta: dict) -> int:
    """The model's vocabulary for this data: its vocab_size, rounded up to a multiple of 64 under pad_vocab."""
    return padded_vocab_size(meta["vocab_size"]) if cfg.pad_vocab else meta["vocab_size"]


def add_adapters(cfg: Any, model: GPT, base_rows: int) -> dict:
    """LoRA: freeze the model and add the adapters (the token rows from `base_rows` on, a chat template's, train
    too); returns the record that a LoRA checkpoint keeps to find its base again."""
    add_lora(model, cfg.lora_config(), cfg.lora_base_weights, first_new_row=base_rows)
    return lora_record(cfg.lora_config(), cfg.lora_base_weights, base_reference(cfg.init_from), base_rows)


def frozen_reference(cfg: Any, meta: dict, model: GPT, resumed: dict | None, device: torch.device) -> Reference:
    """The starting model, frozen, as DPO and GRPO's KL term compare with it: for LoRA the base with the adapters
    off (no copy), else a copy of `model` as it starts, or when a run resumes (`resumed`) the model it started
    from, loaded again."""
    if cfg.lora_rank or resumed is None:
        return Reference(model)
    source = starting_point(cfg.init_from, resumed)
    if isinstance(resumed.get("reference"), dict):  # else a checkpoint written before digests: its source alone
        where = Path(cfg.out_dir) / ckpt.LATEST_NAME
        remedy = "resume with the model this run started from, or start a new run"
        source = unchanged_source(resumed["reference"], f"{where}: the starting model", "this run started", remedy)
    start, _, _ = create_model(dataclasses.replace(cfg, init_from=source, lora_rank=0), meta)
    return Reference(start.to(device))


def checkpoint_weights(model: GPT, lora: dict | None, average: ema.WeightAverage, model_state: dict) -> dict:
    """The weights entries of a checkpoint: "model" (and "trained_model" under an EMA); for LoRA, the adapters
    and the record that finds their base again."""
    if lora is None:
        return average.checkpoint_entries(model_state)
    return {"model": adapter_state(model), "lora": lora}
