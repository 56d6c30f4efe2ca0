"""Checkpoints: atomic saves, safe loads with clear errors, random-number-generator state, latest/best lookup.

A checkpoint is a dict saved with torch.save. The keys are nanoGPT's (`model`, `optimizer`, `model_args`,
`iter_num`, `best_val_loss`, `config`) plus `scaler` (GradScaler state), `rng` (Python, numpy, torch and CUDA
generator states), `sampler` (the training data sampler's state) and `tokenizer` (meta.json's tokenizer object
with `vocab_size` and `eot_token`), so a checkpoint alone is enough to sample from. Every value is a tensor or a
plain type so that `torch.load(weights_only=True)` reads it: nothing in a checkpoint can run code on load.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gptkit.core.distributed import is_fsdp
from gptkit.core.errors import UserError, describe_os_error
from gptkit.core.fileio import atomic_open
from gptkit.data.gguf_tokenizer import SUFFIX as GGUF_SUFFIX
from gptkit.model import GPT, GPTConfig

if TYPE_CHECKING:
    from gptkit.data.loader import BatchSampler

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blk)\.(\d+)\.")  # model.layers.3., transformer.h.3., GGUF's blk.3.
LATEST_NAME = "ckpt.pt"
BEST_NAME = "best.pt"
MODEL_KEYS = ("model", "model_args")  # enough to rebuild the model (sampling, evaluation)
RESUME_KEYS = ("model", "model_args", "optimizer", "iter_num", "best_val_loss")  # enough to continue training
WEIGHT_KEYS = ("model", "trained_model")  # the entries that hold weights (trained_model: see gptkit.train.ema)

# Prefixes torch.compile and DistributedDataParallel put in front of parameter names.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def save_checkpoint(path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
    """Write `checkpoint` to `path` atomically (temp file beside it, fsync, rename): never a half-written file.

    A failed write (disk full, quota, permissions) is a UserError naming the file; `path` is left as it was.
    """
    try:
        with atomic_open(path, "wb") as handle:
            torch.save(checkpoint, handle)
    except (OSError, RuntimeError) as exc:
        # torch reports a failed write as a RuntimeError ("unexpected pos"); the OSError behind it says why.
        os_error = exc if isinstance(exc, OSError) else exc.__context__
        if not isinstance(os_error, OSError):
            raise
        unnamed = OSError(os_error.errno, os_error.strerror)  # the message names the file itself
        left = "; the earlier file was left as it was" if Path(path).exists() else ""
        raise UserError(f"cannot write checkpoint {path}: {describe_os_error(unnamed)}{left}") from exc


def load_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device = "cpu", required_keys: tuple[str, ...] = MODEL_KEYS
) -> dict[str, Any]:
    """Load a checkpoint with torch.load(weights_only=True) and check it has `required_keys`.

    Returns the checkpoint dict. Any failure (missing, empty, truncated or foreign file, a pickle that asks for
    code to run, weights that hold NaN or infinity when "model" is required) is a UserError of one line naming the
    file.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; train first or check --out_dir")
    if path.stat().st_size == 0:
        raise UserError(f"checkpoint {path} is empty; the file is damaged, use another checkpoint")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, UnpicklingError, EOFError, ... for bad files
        raise UserError(f"cannot load checkpoint {path}: {_load_failure_reason(exc)}") from exc
    if not isinstance(checkpoint, dict):
        raise UserError(f"checkpoint {path} holds a {type(checkpoint).__name__}, not a checkpoint dict")
    missing = [key for key in required_keys if key not in checkpoint]
    if missing:
        raise UserError(f"checkpoint {path} lacks {', '.join(missing)}; it is not a training checkpoint")
    if "model" in required_keys:  # every model loaded from a file passes here (a LoRA run's adapters too)
        for key in WEIGHT_KEYS:
            if isinstance(checkpoint.get(key), dict):
                check_finite(checkpoint[key], f"checkpoint {path}", NONFINITE_CHECKPOINT_REMEDY)
    return checkpoint


NONFINITE_CHECKPOINT_REMEDY = (
    "the run diverged before it was saved, or the file is damaged; use another checkpoint (a run keeps best.pt and "
    "ckpt.pt) or train again, e.g. with a lower --learning_rate"
)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds no NaN and no infinity: then its smallest and largest values are finite
    (a NaN is both). Why not isfinite().all(): that first writes a mask as large as the tensor, and loading checks
    every weight; this is one pass that keeps two numbers."""
    if tensor.numel() == 0:
        return True
    smallest, largest = torch.aminmax(tensor)
    return bool(smallest.isfinite()) and bool(largest.isfinite())


def physical_memory() -> int | None:
    """The machine's memory in bytes, None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_context_fits(config: GPTConfig, source: str) -> None:
    """UserError when the model's position tables, made whole for its context before any weight is read, would take
    more memory than the machine has (a damaged file's context length): one line, where torch's allocator fails."""
    width = {"rope": config.head_dim, "sinusoidal": config.n_embd}.get(config.pos_encoding)
    memory = physical_memory()
    need = config.block_size * (width or 0) * 8  # float64 while they are computed
    if memory is not None and need > memory:
        raise UserError(
            f"{source}: its context of {config.block_size} positions needs {need / 2**30:.0f} GB for the position "
            f"tables alone, more than this machine's {memory / 2**30:.0f} GB; the file is damaged, or the model is "
            "beyond this machine"
        )


def check_layers_present(names: Iterable[str], n_layer: int, source: str, config_name: str, remedy: str) -> None:
    """UserError when weights' names (_LAYER_INDEX) hold other layers than the n_layer their config (config_name:
    what the source calls it) gives: a count beyond them would have a model of that many layers made before any
    weight is read."""
    layers = sorted({int(match.group(1)) for name in names if (match := _LAYER_INDEX.search(name))})
    if len(layers) != n_layer or layers != list(range(n_layer)):  # the length first: n_layer may be 2**62
        held = f"layers {layers[0]} to {layers[-1]} ({len(layers)})" if layers else "no layer"
        raise UserError(f"{source}: {n_layer} layers in its {config_name}, but its weights hold {held}; {remedy}")


def model_for_weights(config: GPTConfig, names: Iterable[str], source: str, config_name: str, remedy: str) -> GPT:
    """GPT.without_weights(config) for a source whose weights are named `names` (a checkpoint's, a Hugging Face
    directory's, a GGUF file's), once nothing about the config could make that model outgrow the machine: its
    position tables fit in memory (check_context_fits) and its layers are those the weights hold
    (check_layers_present)."""
    check_context_fits(config, source)
    check_layers_present(names, config.n_layer, source, config_name, remedy)
    return GPT.without_weights(config)


def check_finite(tensors: dict[str, Any], source: str, remedy: str) -> None:
    """UserError naming `source` and the first floating-point tensor of `tensors` that holds a NaN or an infinity,
    then `remedy`. Why: such a weight makes every logit NaN, and decoding would choose tokens from them."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not all_finite(tensor):
            counts = {"NaN": int(tensor.isnan().sum()), "infinity": int(tensor.isinf().sum())}
            found = " and ".join(f"{kind} in {count}" for kind, count in counts.items() if count)
            raise UserError(f"{source}: weight {name} holds {found} of its {tensor.numel()} values; {remedy}")


def _load_failure_reason(exc: Exception) -> str:
    text = str(exc)
    forbidden = re.search(r"GLOBAL ([\w.]+)", text)
    if "Weights only load failed" in text and forbidden:  # the file names a Python callable to run
        return (
            f"it asks to run code on load ({forbidden.group(1)}), which is refused; "
            "only use checkpoints written by this toolkit or nanoGPT"
        )
    # torch's messages are long and multi-line; the line naming the actual problem is the useful one, and of it the
    # first sentence (the rest is advice to torch's own developers).
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = next((line for line in lines if line.startswith(("Unsupported", "PytorchStreamReader", "["))), None)
    detail = first_sentence(detail or (lines[0] if lines else ""), 160)
    if not re.search(r"[A-Za-z]{3}", detail):  # e.g. a KeyError of a number: the kind of error says more
        detail = f"{type(exc).__name__} {detail}".strip()
    return (
        f"the file is truncated, damaged or not a checkpoint (torch: {detail}); use another checkpoint (a run keeps "
        "best.pt and ckpt.pt) or train again"
    )


def first_sentence(text: str, limit: int) -> str:
    """The first sentence of `text` without its full stop, cut at a word and marked "..." beyond `limit` characters."""
    sentence = re.split(r"(?<=[^.\s][.!?])\s", text.strip(), maxsplit=1)[0].rstrip(".")
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0] + "..."


def resolve_checkpoint(out_dir: str | os.PathLike, which: str = "best") -> Path:
    """The checkpoint file to use from `out_dir`: `which` is "best" (best.pt, else ckpt.pt) or "latest" (ckpt.pt).

    `out_dir` may also be a checkpoint file itself. Raises UserError when there is none.
    """
    if which not in ("best", "latest"):
        raise UserError(f"which checkpoint must be 'best' or 'latest', got {which!r}")
    location = Path(out_dir)
    if location.is_file():
        return location
    names = (BEST_NAME, LATEST_NAME) if which == "best" else (LATEST_NAME,)
    for name in names:
        if (location / name).is_file():
            return location / name
    raise UserError(f"no checkpoint in {location} (looked for {', '.join(names)}); train a model first")


def copy_checkpoint(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Make `destination` a copy of the checkpoint `source`, atomically.

    A hard link when the filesystem allows it (no second write of a large file); a later save of either name
    replaces that name, not the shared contents, so the other keeps its checkpoint.
    """
    source, destination = Path(source), Path(destination)
    temporary = destination.with_name(f".{destination.name}.link")
    temporary.unlink(missing_ok=True)
    try:
        os.link(source, temporary)
    except OSError:  # no hard links here (some network or FAT filesystems): copy instead
        with atomic_open(destination, "wb") as handle, open(source, "rb") as original:
            while chunk := original.read(1 << 24):
                handle.write(chunk)
        return
    os.replace(temporary, destination)


def remove_stale_temporaries(out_dir: str | os.PathLike) -> list[Path]:
    """Delete temporary files that a save interrupted by kill -9 or a power cut left in `out_dir`; returns them."""
    stale = []
    for name in (LATEST_NAME, BEST_NAME):
        stale += [p for p in Path(out_dir).glob(f".{name}.*") if p.suffix in (".tmp", ".link") and p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def capture_rng_state() -> dict[str, Any]:
    """The Python, numpy, torch (CPU) and CUDA generator states as tensors and plain values."""
    version, python_state, gauss_next = random.getstate()
    _, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    return {
        "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64), "gauss": gauss_next},
        "numpy": {
            "keys": torch.from_numpy(numpy_keys.astype(np.int64)),
            "pos": int(numpy_pos),
            "has_gauss": int(numpy_has_gauss),
            "gauss": float(numpy_gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore generator states captured by capture_rng_state (CUDA states only for devices present)."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, numpy["pos"], numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(state["torch"].cpu())
    if torch.cuda.is_available():
        for device, cuda_state in enumerate(state.get("cuda", [])[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), device)


def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with torch.compile/DDP name prefixes removed."""
    cleaned = {}
    for key, value in state_dict.items():
        for prefix in _WRAPPER_PREFIXES:
            while key.startswith(prefix):
                key = key[len(prefix) :]
        cleaned[key] = value
    return cleaned


def checked_weights(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """`state_dict` as `model` takes it (compiled and DDP prefixes gone); UserError naming `source` when its names or
    shapes do not match the model's (which may be made without weights: only their shapes are read)."""
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise UserError(f"checkpoint {source}: 'model' is not a dict of tensors; the file is damaged")
    state_dict = clean_state_dict(state_dict)
    expected = model.state_dict()
    # nanoGPT without flash attention saved its causal mask as a buffer named attn.bias; it is not a weight.
    state_dict = {k: v for k, v in state_dict.items() if k in expected or not k.endswith(".attn.bias")}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UserError(f"checkpoint {source} does not match its model_args ({detail}); the file is inconsistent")
    for key, tensor in expected.items():
        if tuple(state_dict[key].shape) != tuple(tensor.shape):
            raise UserError(
                f"checkpoint {source}: {key} has shape {tuple(state_dict[key].shape)} but model_args give "
                f"{tuple(tensor.shape)}; the file is inconsistent"
            )
        if tensor.is_floating_point() and not state_dict[key].is_floating_point():  # an int copy reads as ~zeros
            raise UserError(
                f"checkpoint {source}: {key} is stored as {state_dict[key].dtype}, not floats; the file is damaged"
            )
    return state_dict


def model_args_of(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's model_args, completed for nanoGPT checkpoints (which used exact GELU and no options)."""
    if not isinstance(checkpoint["model_args"], dict):
        raise UserError("model_args is not a dict")
    model_args = dict(checkpoint["model_args"])
    if "activation" not in model_args:  # written by nanoGPT: nn.GELU() is the exact (erf) GELU
        model_args["activation"] = "gelu"
    return model_args


def check_same_tokenizer(checkpoint: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    """UserError when a checkpoint was trained on a tokenizer other than the data's."""
    saved = checkpoint.get("tokenizer")
    if saved is not None and saved != tokenizer_record(meta):
        raise UserError(f"{path} was trained with another tokenizer than this data's; use the data it was trained on")


def check_base_tokenizer(base: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    """UserError unless the data was tokenized as the base checkpoint's training data was. Chat data may add its
    template's special tokens to a base without them (the rows are added to the model then)."""
    saved = base.get("tokenizer")
    if saved is None:
        return  # an old checkpoint that records no tokenizer: nothing to compare
    ours = dict(meta["tokenizer"])
    if "chat" not in saved:
        ours.pop("chat", None)
    theirs = {key: value for key, value in saved.items() if key not in ("vocab_size", "eot_token")}
    if theirs != ours or saved.get("eot_token") != meta.get("eot_token"):
        if "chat" in meta["tokenizer"]:  # chat.py reads the tokenizer out of the base itself
            hint = f"prepare the data with the base's tokenizer, e.g. prepare_data/chat.py --tokenizer={path.parent}"
        else:
            hint = f"prepare the text again with the base's tokenizer ({_tokenizer_choice(saved)})"
        raise UserError(f"{path} was trained with another tokenizer than this data's; {hint}")


def _tokenizer_choice(record: dict[str, Any]) -> str:
    """How to prepare plain text with the tokenizer of a checkpoint's record (prepare_data/corpus.py's words)."""
    if record.get("kind") == "tiktoken":
        return f"prepare_data/corpus.py --tokenizer={record.get('encoding')}"
    if record.get("kind") == "char":
        return "--tokenizer=char on text of the same characters"
    return "the --tokenizer directory prepare_data/train_tokenizer.py wrote for it"


def is_checkpoint_source(init_from: str) -> bool:
    """Whether --init_from names one of our checkpoints: a file (not a GGUF one), or a directory holding best.pt or
    ckpt.pt (a Hugging Face GPT-2 directory holds config.json instead)."""
    location = Path(init_from)
    if location.is_file():
        return location.suffix.lower() != GGUF_SUFFIX
    return any((location / name).is_file() for name in (BEST_NAME, LATEST_NAME))


def tokenizer_record(meta: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint stores about its tokenizer: meta.json's tokenizer object plus vocab_size and eot_token.

    tokenizer.tokenizer_from_meta accepts the result as it is.
    """
    return {**meta["tokenizer"], "vocab_size": meta["vocab_size"], "eot_token": meta.get("eot_token")}


# ----------------------------------------------------------------------------- training state across processes


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    # Names in the optimizer's own order: position i is the integer id i of optimizer.state_dict().
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _rekey_optimizer_state(state: dict[str, Any], old_to_new: dict) -> dict[str, Any]:
    groups = [{**group, "params": [old_to_new[p] for p in group["params"]]} for group in state["param_groups"]]
    return {"state": {old_to_new[k]: v for k, v in state["state"].items()}, "param_groups": groups}


def gather_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full model and optimizer state dicts, in the single-process (nanoGPT) layout.

    Takes the unwrapped model (not the DDP/compile wrapper). Under FSDP every process must call this (the shards
    are gathered) and only rank 0 gets the dicts (on CPU); the others get empty ones. So checkpoints written by
    FSDP, DDP and single-process runs are interchangeable.
    """
    if not is_fsdp(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if optimizer_state:  # keyed by parameter name here; saved keyed by integer id like optimizer.state_dict()
        ids = {name: index for index, name in enumerate(_parameter_names(model, optimizer))}
        optimizer_state = _rekey_optimizer_state(optimizer_state, ids)
    return model_state, optimizer_state


def check_optimizer_state(
    optimizer: torch.optim.Optimizer, state: Any, source: str, trained_with: str | None = None, asked: str | None = None
) -> None:
    """UserError unless `state` (single-process layout) fits `optimizer`: same groups, and every per-parameter
    tensor shaped like its parameter. torch itself would only fail at the first step, with a shape error.
    trained_with: the checkpoint's --optimizer, which the message names where it is not the `asked` one."""
    try:
        saved_groups = [list(group["params"]) for group in state["param_groups"]]
        per_parameter = state["state"]
        fits = [len(saved) for saved in saved_groups] == [len(group["params"]) for group in optimizer.param_groups]
    except (KeyError, TypeError) as exc:
        raise UserError(f"checkpoint {source}: the optimizer state is damaged ({type(exc).__name__}: {exc})") from exc
    if not fits:
        named = trained_with is not None and trained_with != asked
        hint = f"; it was trained with --optimizer={trained_with}: resume with that" if named else ""
        raise UserError(f"checkpoint {source}: the optimizer state belongs to another model or optimizer{hint}")
    for saved, group in zip(saved_groups, optimizer.param_groups):
        for saved_id, parameter in zip(saved, group["params"]):
            for name, value in per_parameter.get(saved_id, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != parameter.shape:
                    raise UserError(
                        f"checkpoint {source}: optimizer state {name} has shape {tuple(value.shape)} for a parameter "
                        f"of shape {tuple(parameter.shape)}; it belongs to another model, the file is inconsistent"
                    )


def restore_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a saved optimizer state (single-process layout) into `optimizer`, also when `model` is FSDP-sharded.
    The moments and step counts come back; the hyper-parameters (betas, weight decay, Muon's rate and momentum...)
    stay those `optimizer` was built with, the run's settings, as the checkpoint's config records them."""
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = dict(enumerate(_parameter_names(model, optimizer)))
        options = StateDictOptions(full_state_dict=True)  # every process holds the full state: each keeps its shard
        set_optimizer_state_dict(model, optimizer, _rekey_optimizer_state(state, names), options=options)
    else:
        optimizer.load_state_dict(state)
    for group, built in zip(optimizer.param_groups, settings):
        group.update(built)


def training_checkpoint(
    *,
    weights: dict[str, Any],
    optimizer_state: dict[str, Any],
    model_args: dict[str, Any],
    iter_num: int,
    best_val_loss: float,
    config: dict[str, Any],
    scaler_state: dict[str, Any],
    sampler_state: dict[str, Any],
    meta: dict[str, Any],
) -> dict[str, Any]:
    """A training checkpoint in this module's format, the one restore_training_state and the loaders read back.

    `weights` are its weights entries: "model" (and "trained_model", the optimizer's weights, under an EMA), or
    for a LoRA run the adapters as "model" and the "lora" record that finds their base. The random generators'
    states are captured now; `meta` is the data's meta.json, whose tokenizer the checkpoint records.
    """
    return {
        **weights,
        "optimizer": optimizer_state,
        "model_args": model_args,
        "iter_num": iter_num,
        "best_val_loss": best_val_loss,
        "config": config,
        "scaler": scaler_state,
        "rng": capture_rng_state(),
        "sampler": sampler_state,
        "tokenizer": tokenizer_record(meta),
    }


def save_training_checkpoint(out_dir: str | os.PathLike, checkpoint: dict[str, Any], best: bool) -> None:
    """Save `checkpoint` as out_dir/ckpt.pt; a new best (`best`) as best.pt, then linked as ckpt.pt.

    best.pt is written first: killed in between, the run resumes from the older ckpt.pt and redoes the same
    steps, so best.pt never lags behind ckpt.pt's record.
    """
    latest, best_path = Path(out_dir) / LATEST_NAME, Path(out_dir) / BEST_NAME
    save_checkpoint(best_path if best else latest, checkpoint)
    if best:
        copy_checkpoint(best_path, latest)


def restore_training_state(
    checkpoint: dict,
    source: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    sampler: BatchSampler,
    optimizer_name: str | None = None,
) -> tuple[int, float]:
    """Continue from `checkpoint`: optimizer, loss scaler, data position and RNG states; returns (iter_num,
    best_val_loss). A damaged or foreign training state is a UserError naming the file, never a crash mid-run."""
    config = checkpoint.get("config")
    trained_with = config.get("optimizer") if isinstance(config, dict) else None
    check_optimizer_state(optimizer, checkpoint["optimizer"], source, trained_with, optimizer_name)
    try:
        restore_optimizer_state(model, optimizer, checkpoint["optimizer"])
        if checkpoint.get("scaler"):
            scaler.load_state_dict(checkpoint["scaler"])
        if "sampler" in checkpoint:
            sampler.load_state_dict(checkpoint["sampler"])
        if "rng" in checkpoint:
            restore_rng_state(checkpoint["rng"])
        return checkpoint_step(checkpoint), float(checkpoint["best_val_loss"])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as exc:
        raise damaged_training_state(source, exc) from exc


def checkpoint_step(checkpoint: dict) -> int:
    """The step a training checkpoint was saved at; ValueError (or KeyError) for anything else."""
    iter_num = checkpoint["iter_num"]
    if isinstance(iter_num, bool) or not isinstance(iter_num, int) or iter_num < 0:
        raise ValueError(f"iter_num is {iter_num!r}, not a step")
    return iter_num


def damaged_training_state(source: str, exc: Exception) -> UserError:
    return UserError(
        f"checkpoint {source} has a damaged training state ({type(exc).__name__}: {exc}); resume from another "
        "checkpoint or start over"
    )
