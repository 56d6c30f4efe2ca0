"""Train a GPT, from a laptop CPU to many GPUs, or evaluate one (--eval_only).

    python train.py [config/FILE.py ...] [--key=value ...]
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

Reads top to bottom: settings → devices and processes → data → model → optimizer → the loop → checkpoints.
One process trains on one device; under `torchrun` every process trains a replica (DistributedDataParallel)
or a shard (FSDP2) and rank 0 alone logs and saves. Checkpoints (out_dir/ckpt.pt, the best in out_dir/best.pt)
hold everything needed to continue exactly where a run stopped (--init_from=resume), even after kill -9.

Data placement: step s consumes global micro-batches s*G ... s*G+G-1 (G = gradient_accumulation_steps) and
rank r of N takes the r-th contiguous group of G/N of them (see data.py). Dropout is seeded per global
micro-batch. So a run's data and dropout do not depend on how many processes share the work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit import data
from gptkit.checkpoint import (
    BEST_NAME,
    LATEST_NAME,
    RESUME_KEYS,
    StopRequest,
    capture_rng_state,
    check_optimizer_state,
    copy_checkpoint,
    gather_training_state,
    is_fsdp,
    load_checkpoint,
    remove_stale_temporaries,
    restore_optimizer_state,
    restore_rng_state,
    save_checkpoint,
    tokenizer_record,
)
from gptkit.devices import DTYPES, autocast, peak_flops_for_device, resolve_device, resolve_dtype
from gptkit.errors import UserError, run_cli
from gptkit.fileio import atomic_write_json
from gptkit.settings import parse_settings, setting, settings_to_dict
from gptkit.tokenizer import read_meta
from model import GPT, GPTConfig, config_to_dict

DROPOUT_STREAM = 1000  # seeds dropout per micro-batch, apart from the data sampler's streams (data.PURPOSE_*)


@dataclasses.dataclass
class TrainSettings:
    # output, evaluation and checkpoints
    out_dir: str = setting("out", "directory for checkpoints (ckpt.pt latest, best.pt best val loss) and log.jsonl")
    eval_interval: int = setting(2000, "evaluate and save a checkpoint every this many steps (and at the end)")
    log_interval: int = setting(1, "print one training line every this many steps")
    eval_iters: int = setting(200, "batches per split in each evaluation (a fixed set, the same every time)")
    eval_only: bool = setting(False, "evaluate the model given by init_from, print the losses and exit")
    eval_full_split: bool = setting(
        False, "also the exact val loss over the whole val split (non-overlapping windows), at the end or eval_only"
    )
    always_save_checkpoint: bool = setting(True, "save ckpt.pt at every evaluation, not only when val improves")
    init_from: str = setting("scratch", "scratch | resume (out_dir/ckpt.pt) | gpt2* | a Hugging Face GPT-2 dir")
    seed: int = setting(1337, "seed for initialisation, data order and dropout")
    # logging to Weights & Biases
    wandb_log: bool = setting(False, "log config and metrics to wandb (WANDB_MODE=offline works without network)")
    wandb_project: str = setting("gpt", "wandb project name")
    wandb_run_name: str | None = setting(None, "wandb run name (None: wandb picks one)")
    # data
    dataset: str = setting("fineweb_edu", "prepared data directory under data/ (ignored when data_dir is set)")
    data_dir: str | None = setting(None, "any prepared data directory (holds meta.json and token files)")
    gradient_accumulation_steps: int = setting(40, "micro-batches per step over all processes (split across them)")
    batch_size: int = setting(12, "sequences per micro-batch per process")
    block_size: int = setting(1024, "context length in tokens (crops a longer pretrained/resumed model)")
    # model (used for scratch; resume and gpt2 take the architecture from the checkpoint)
    n_layer: int = setting(12, "transformer blocks")
    n_head: int = setting(12, "attention heads per block")
    n_embd: int = setting(768, "embedding width (divisible by n_head)")
    dropout: float = setting(0.0, "dropout probability (0 for pretraining, 0.1+ for fine-tuning)")
    bias: bool = setting(False, "biases in Linear and LayerNorm layers")
    pos_encoding: str = setting("learned", "learned | sinusoidal | rope")
    activation: str = setting("gelu_tanh", "MLP activation: gelu_tanh | gelu | relu2")
    attention: str = setting("sdpa", "sdpa (fused kernels) | math (explicit softmax)")
    qk_norm: bool = setting(False, "RMS-normalise queries and keys")
    tie_embeddings: bool = setting(True, "share the token embedding with the output head")
    pad_vocab: bool = setting(False, "round vocab_size up to a multiple of 64 (faster matmuls on GPUs)")
    # optimizer and learning-rate schedule
    optimizer: str = setting("adamw", "adamw | muon (Muon for the blocks' weight matrices, AdamW for the rest)")
    muon_lr: float = setting(0.02, "optimizer=muon: Muon's peak learning rate (follows the same schedule)")
    muon_momentum: float = setting(0.95, "optimizer=muon: Muon's momentum")
    learning_rate: float = setting(6e-4, "peak learning rate")
    max_iters: int = setting(600000, "total optimizer steps")
    weight_decay: float = setting(0.1, "AdamW weight decay")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "clip the gradient norm to this (0 = off)")
    decay_lr: bool = setting(True, "linear warmup then cosine decay to min_lr (False: constant learning_rate)")
    warmup_iters: int = setting(2000, "warmup steps: lr = learning_rate*(it+1)/(warmup_iters+1)")
    lr_decay_iters: int = setting(600000, "step where the cosine reaches min_lr (usually max_iters)")
    min_lr: float = setting(6e-5, "learning rate at the end of the decay (usually learning_rate/10)")
    # system
    device: str = setting("auto", "auto (cuda → mps → cpu) | cpu | cuda | cuda:N | mps")
    dtype: str = setting("auto", "auto (CUDA: bfloat16 or float16; else float32) | float32 | bfloat16 | float16")
    compile: bool | None = setting(None, "torch.compile the model (None: on for CUDA, off otherwise)")
    cpu_threads: int | None = setting(None, "torch CPU threads (None: torch's default; fewer on a busy machine)")
    backend: str = setting("auto", "torch.distributed backend under torchrun: auto (nccl on CUDA, gloo) | nccl | gloo")
    parallel: str = setting("ddp", "under torchrun: ddp (a replica per process) | fsdp (parameters sharded)")
    peak_flops: float | None = setting(
        None, "the device's peak FLOP/s for the MFU figure (None: known for A100/H100/H200 GPUs, else MFU is n/a)"
    )

    def validate(self) -> None:
        """Raise UserError for values that cannot work, before anything is loaded."""
        if self.peak_flops is not None and not (self.peak_flops > 0 and math.isfinite(self.peak_flops)):
            raise UserError(f"peak_flops must be a positive number of FLOP/s (e.g. 1.4e11), got {self.peak_flops}")
        positive = ("batch_size", "block_size", "gradient_accumulation_steps", "eval_interval", "log_interval")
        for name in (*positive, "eval_iters", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("max_iters", "warmup_iters", "lr_decay_iters"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.learning_rate > 0 or not math.isfinite(self.learning_rate):
            raise UserError(f"learning_rate must be a positive number, got {self.learning_rate}")
        for name in ("min_lr", "weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.dropout < 1:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.cpu_threads is not None and self.cpu_threads <= 0:
            raise UserError(f"cpu_threads must be a positive integer or None, got {self.cpu_threads}")
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not self.muon_lr > 0 or not math.isfinite(self.muon_lr):
            raise UserError(f"muon_lr must be a positive number, got {self.muon_lr}")
        if not 0 <= self.muon_momentum < 1:
            raise UserError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if not self.out_dir:
            raise UserError("out_dir must not be empty; give a directory for the checkpoints, e.g. --out_dir=out")
        choices = {
            "dtype": ("auto", *DTYPES),
            "backend": ("auto", "nccl", "gloo"),
            "parallel": ("ddp", "fsdp"),
            "optimizer": ("adamw", "muon"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")


# ----------------------------------------------------------------------------- devices and processes


@dataclasses.dataclass
class Processes:
    """Where this process stands in a (possibly single-process) run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, local_rank: int) -> torch.device:
    """The torch device for `requested` (see devices.resolve_device); under torchrun CUDA means cuda:local_rank."""
    device = resolve_device(requested)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def start_processes(cfg: TrainSettings) -> tuple[Processes, torch.device]:
    """Join the torchrun process group when launched by torchrun; returns this process's place and device."""
    if "RANK" not in os.environ:
        return Processes(), pick_device(cfg.device, 0)
    procs = Processes(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    device = pick_device(cfg.device, procs.local_rank)
    if cfg.gradient_accumulation_steps % procs.world_size:
        raise UserError(
            f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible by the number "
            f"of processes ({procs.world_size})"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    torch.distributed.init_process_group(backend=backend)
    return procs, device


def reduce_numbers(values: list[float], device: torch.device, procs: Processes, op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers over all processes; the numbers themselves in a single process."""
    if not procs.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64 if device.type != "mps" else torch.float32, device=device)
    reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
    torch.distributed.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


# ----------------------------------------------------------------------------- model


def create_model(cfg: TrainSettings, meta: dict) -> tuple[GPT, dict | None]:
    """The model to train (on CPU) and, for resume, the checkpoint it came from."""
    checkpoint = None
    if cfg.init_from == "scratch":
        vocab_size = meta["vocab_size"]
        if cfg.pad_vocab:
            vocab_size = -(-vocab_size // 64) * 64
        # Every GPTConfig field that is also a setting (n_layer, dropout, pos_encoding, ...) comes from the settings.
        options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig) if hasattr(cfg, f.name)}
        config = GPTConfig(**{**options, "vocab_size": vocab_size})
        model = GPT(config)
    elif cfg.init_from == "resume":
        path = Path(cfg.out_dir) / LATEST_NAME
        checkpoint = load_checkpoint(path, required_keys=RESUME_KEYS)
        check_same_tokenizer(checkpoint, meta, path)
        model = GPT.from_checkpoint(checkpoint, str(path), overrides={"dropout": cfg.dropout})
    else:
        model = GPT.from_pretrained(cfg.init_from, override_args={"dropout": cfg.dropout})
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)  # e.g. GPT-2's 1024 positions fine-tuned on shorter windows
    if meta["vocab_size"] > model.config.vocab_size:
        raise UserError(
            f"the data's vocab_size ({meta['vocab_size']}) is larger than the model's ({model.config.vocab_size}); "
            f"init_from={cfg.init_from} cannot read this data's tokens, use data from the model's tokenizer"
        )
    return model, checkpoint


def check_same_tokenizer(checkpoint: dict, meta: dict, path: Path) -> None:
    """UserError when a checkpoint was trained on a tokenizer other than the data's."""
    saved = checkpoint.get("tokenizer")
    if saved is not None and saved != tokenizer_record(meta):
        raise UserError(f"{path} was trained with another tokenizer than this data's; use the data it was trained on")


def restore_training_state(
    checkpoint: dict,
    source: str,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    sampler: data.BatchSampler,
) -> tuple[int, float]:
    """Continue from `checkpoint`: optimizer, loss scaler, data position and RNG states; returns (iter_num,
    best_val_loss). A damaged or foreign training state is a UserError naming the file, never a crash mid-run."""
    check_optimizer_state(optimizer, checkpoint["optimizer"], source)
    try:
        restore_optimizer_state(model, optimizer, checkpoint["optimizer"])
        if checkpoint.get("scaler"):
            scaler.load_state_dict(checkpoint["scaler"])
        if "sampler" in checkpoint:
            sampler.load_state_dict(checkpoint["sampler"])
        if "rng" in checkpoint:
            restore_rng_state(checkpoint["rng"])
        return int(checkpoint["iter_num"]), float(checkpoint["best_val_loss"])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as exc:
        raise UserError(
            f"checkpoint {source} has a damaged training state ({type(exc).__name__}: {exc}); "
            "resume from another checkpoint or start over"
        ) from exc


def parallelize(model: GPT, cfg: TrainSettings, procs: Processes, device: torch.device) -> torch.nn.Module:
    """Move the model to the device and wrap it: FSDP2 shards or a DDP replica under torchrun, torch.compile.

    Returns the module to call for forward passes; `model` itself stays the unwrapped one (for saving).
    """
    model.to(device)
    if procs.distributed and cfg.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:  # each block gathers its parameters only while it runs
            fully_shard(block)
        fully_shard(model)
    wrapped: torch.nn.Module = model
    if cfg.compile if cfg.compile is not None else device.type == "cuda":
        wrapped = torch.compile(wrapped)
    if procs.distributed and cfg.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(wrapped, device_ids=[device.index] if device.type == "cuda" else None)
    return wrapped


def gradient_sync(wrapped: torch.nn.Module, model: GPT, sync: bool) -> Any:
    """A context for one micro-step: gradients are exchanged between processes only when `sync` (the last one)."""
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and not sync:
        return wrapped.no_sync()
    if is_fsdp(model):
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- optimizer


def build_optimizer(cfg: TrainSettings, model: GPT, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer: the one place to add new ones. Each param group may carry "lr_scale" (default 1), its
    factor on the scheduled learning rate (Muon's group runs at muon_lr/learning_rate of it)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "muon":
        if is_fsdp(model):
            raise UserError("optimizer=muon needs whole weight matrices; use it with --parallel=ddp, not fsdp")
        muon = {"muon_lr": cfg.muon_lr, "muon_momentum": cfg.muon_momentum}
        return model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas, device.type, **muon)
    return model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas, device.type)


def learning_rate_at(step: int, cfg: TrainSettings) -> float:
    """Linear warmup from learning_rate/(warmup_iters+1) (never 0), then cosine decay to min_lr at lr_decay_iters."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


# ----------------------------------------------------------------------------- evaluation and reporting


@torch.no_grad()
def mean_loss(wrapped: torch.nn.Module, batches: Any, precision: Any, device: torch.device, procs: Processes) -> float:
    """Per-token mean loss over an indexable sequence of (x, y) batches, split round-robin over processes.

    Every process runs the same number of forward passes (FSDP needs that); the padding ones count for nothing.
    """
    wrapped.eval()
    total, count = 0.0, 0
    for round_start in range(0, len(batches), procs.world_size):
        index = round_start + procs.rank
        x, y = data.to_device(*batches[min(index, len(batches) - 1)], device)
        with precision:
            _, loss = wrapped(x, y)
        if index < len(batches):
            total += loss.item() * y.numel()
            count += y.numel()
    wrapped.train()
    total, count = reduce_numbers([total, count], device, procs)
    return total / count


def format_bpb(bpb: float | None) -> str:
    return f" | val bpb {bpb:.4f}" if bpb is not None else ""


class RunLog:
    """What rank 0 reports: lines on stdout, the same numbers in out_dir/log.jsonl and (optionally) wandb.

    log.jsonl gets one JSON object per log or eval line; after a resume, entries for steps redone after the
    checkpoint appear again (the later one is the one that counts).
    """

    def __init__(self, cfg: TrainSettings, procs: Processes, out_dir: Path) -> None:
        self.master = procs.master
        self.file = None
        self.wandb_run = None
        if not self.master or cfg.eval_only:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.wandb_log:
            self.wandb_run = start_wandb(cfg, os.environ.get("WANDB_DIR", str(out_dir)))
        self.file = open(out_dir / "log.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run

    def say(self, text: str) -> None:
        if self.master:
            print(text, flush=True)

    def record(self, entry: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in entry.items() if k != "iter" and v is not None}, step=entry["iter"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def start_wandb(cfg: TrainSettings, directory: str) -> Any:
    """A wandb run for this training run (wandb is imported only here: it is slow to import)."""
    try:
        import wandb
    except ImportError:
        raise UserError("--wandb_log=True needs the wandb package: pip install wandb") from None
    try:
        return wandb.init(
            project=cfg.wandb_project, name=cfg.wandb_run_name, config=settings_to_dict(cfg), dir=directory
        )
    except Exception as exc:  # wandb raises its own error types for login and network problems
        raise UserError(
            f"wandb could not start ({type(exc).__name__}: {exc}); run `wandb login` or set WANDB_MODE=offline"
        ) from exc


def seed_for(seed: int, purpose: int, index: int) -> int:
    """A well-mixed 63-bit seed for (seed, purpose, index)."""
    return int(np.random.SeedSequence((seed, purpose, index)).generate_state(1, np.uint64)[0] >> 1)


# ----------------------------------------------------------------------------- the run


def main(argv: list[str]) -> int:
    """Train (or evaluate) as the settings in argv say; returns the exit code."""
    cfg = parse_settings(TrainSettings, argv, prog="train.py", description=__doc__.splitlines()[0], config_files=True)
    procs, device = start_processes(cfg)
    finished = False
    try:
        with StopRequest(force_on_repeat=not procs.distributed) as stop:
            code = run(cfg, procs, device, stop)
        finished = True
        return code
    finally:
        if procs.distributed:
            if finished:
                torch.distributed.barrier()  # tear down together, after rank 0 has written its last files
            # The DDP/FSDP-wrapped modules sit in reference cycles that keep the process group alive; collect them
            # now so gloo's threads stop here, not during interpreter exit, where they abort the process
            # ("terminate called without an active exception").
            gc.collect()
            torch.distributed.destroy_process_group()


def run(cfg: TrainSettings, procs: Processes, device: torch.device, stop: StopRequest) -> int:
    """The whole run in this process; returns the exit code."""
    # --- data
    data_dir = data.data_dir_for(cfg.dataset, cfg.data_dir)
    meta = read_meta(data_dir)
    streams = {split: data.open_split(data_dir, split, meta) for split in ("train", "val")}

    # --- model (the same initialisation in every process: FSDP shards are cut from it)
    torch.manual_seed(cfg.seed)
    model, checkpoint = create_model(cfg, meta)
    block_size = model.config.block_size
    for stream in streams.values():
        data.check_stream_fits(stream, block_size, str(data_dir))
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    if device.type == "cpu":
        # Optimizer states and gradients of small models reach subnormal floats; x86 CPUs compute those up to
        # 100x slower (Muon's step measured 10x slower here). Flushing them to zero changes nothing visible.
        torch.set_flush_denormal(True)
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
    precision = autocast(device, dtype)  # mixed precision for forward passes (a no-op in float32)
    wrapped = parallelize(model, cfg, procs, device)

    # --- optimizer, loss scaling and the training data sampler; all restored on resume
    optimizer = build_optimizer(cfg, model, device)
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda" and dtype == torch.float16)
    sampler = data.BatchSampler(streams["train"], cfg.batch_size, block_size, cfg.seed, data.PURPOSE_TRAIN)
    iter_num, best_val_loss = 0, math.inf
    if checkpoint is not None:
        source = str(Path(cfg.out_dir) / LATEST_NAME)
        iter_num, best_val_loss = restore_training_state(checkpoint, source, model, optimizer, scaler, sampler)
        del checkpoint  # free the CPU copy of the weights
    start_iter = iter_num
    eval_sets = {
        split: data.FixedBatches(
            data.BatchSampler(streams[split], cfg.batch_size, block_size, cfg.seed, purpose), cfg.eval_iters
        )
        for split, purpose in (("train", data.PURPOSE_EVAL_TRAIN), ("val", data.PURPOSE_EVAL_VAL))
    }

    out_dir = Path(cfg.out_dir)
    latest_path, best_path = out_dir / LATEST_NAME, out_dir / BEST_NAME
    log = RunLog(cfg, procs, out_dir)
    if procs.master and not cfg.eval_only:
        remove_stale_temporaries(out_dir)  # a run killed while saving leaves its temporary file behind
    accumulation = cfg.gradient_accumulation_steps // procs.world_size  # micro-steps in this process
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * block_size
    peak_flops = cfg.peak_flops or peak_flops_for_device(device, dtype)
    log.say(
        f"{model.get_num_params() / 1e6:.2f}M parameters | {device} {str(dtype).removeprefix('torch.')} | "
        f"{procs.world_size} process(es) | {tokens_per_iter:,} tokens per step | data {data_dir}"
    )

    def evaluate() -> dict[str, Any]:
        losses = {split: mean_loss(wrapped, batches, precision, device, procs) for split, batches in eval_sets.items()}
        val_bpb = data.bits_per_byte(losses["val"], meta["splits"]["val"])
        return {"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "val/bpb": val_bpb}

    def save(best: bool) -> str:
        model_state, optimizer_state = gather_training_state(model, optimizer)  # every process takes part
        if procs.master:
            # A new best is written as best.pt first and then linked as ckpt.pt: killed in between, the run resumes
            # from the older ckpt.pt and redoes the same steps, so best.pt can never lag behind ckpt.pt's record.
            save_checkpoint(
                best_path if best else latest_path,
                {
                    "model": model_state,
                    "optimizer": optimizer_state,
                    "model_args": config_to_dict(model.config),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                    "config": settings_to_dict(cfg),
                    "scaler": scaler.state_dict(),
                    "rng": capture_rng_state(),
                    "sampler": sampler.state_dict(),
                    "tokenizer": tokenizer_record(meta),
                },
            )
            if best:
                copy_checkpoint(best_path, latest_path)
        return f" | saved {latest_path}" + (f" and {best_path}" if best else "")

    # Non-finite losses are noted on the device (no sync) and checked where the loop syncs anyway.
    first_bad_iter = torch.full((), -1, dtype=torch.int64, device=device)

    def check_finite() -> None:
        bad = int(reduce_numbers([first_bad_iter.item()], device, procs, op="max")[0])
        if bad >= 0:
            kept = f"; the last good checkpoint {latest_path} is kept" if latest_path.exists() else ""
            raise UserError(
                f"the loss became NaN or infinite at iter {bad}; stopped without saving{kept}. "
                "Lower --learning_rate or --grad_clip, or use --dtype=float32"
            )

    def evaluate_full_split() -> float:
        windows = data.SplitWindows(streams["val"], block_size, cfg.batch_size)
        loss = mean_loss(wrapped, windows, precision, device, procs)
        bpb = data.bits_per_byte(loss, meta["splits"]["val"])
        log.say(f"eval (whole val split, {len(streams['val']):,} tokens): val loss {loss:.4f}{format_bpb(bpb)}")
        return loss

    # --- evaluation only
    if cfg.eval_only:
        result = evaluate()
        log.say(
            f"eval ({cfg.eval_iters} batches per split): train loss {result['train/loss']:.4f} | "
            f"val loss {result['val/loss']:.4f}{format_bpb(result['val/bpb'])}"
        )
        if cfg.eval_full_split:
            evaluate_full_split()
        return 0

    # --- the loop: evaluate and save on schedule, then one optimizer step
    wrapped.train()
    loss_sum = torch.zeros((), device=device)
    last_log_iter = iter_num  # the loss is averaged over the steps since the last log line
    timer_start, timer_iter = time.perf_counter(), iter_num  # speed is measured over training time only
    train_seconds, result = 0.0, None
    while True:
        at_end = iter_num >= cfg.max_iters
        resumed_here = iter_num == start_iter and cfg.init_from == "resume"  # evaluated before that save
        if (iter_num % cfg.eval_interval == 0 or at_end) and not resumed_here:
            train_seconds += time.perf_counter() - timer_start
            check_finite()
            result = evaluate()
            improved = result["val/loss"] < best_val_loss
            best_val_loss = min(best_val_loss, result["val/loss"])
            saved = save(improved) if iter_num > 0 and (improved or cfg.always_save_checkpoint or at_end) else ""
            log.say(
                f"step {iter_num}: train loss {result['train/loss']:.4f} | val loss "
                f"{result['val/loss']:.4f}{format_bpb(result['val/bpb'])}{saved}"
            )
            log.record(result)
            timer_start, timer_iter = time.perf_counter(), iter_num  # evaluation time is not training time
        if at_end:
            break

        # One step: this process's `accumulation` micro-batches of the global step, gradients synced on the last.
        lr = learning_rate_at(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        first = sampler.position + procs.rank * accumulation
        for micro in range(accumulation):
            x, y = data.to_device(*sampler.batch(first + micro), device)
            torch.manual_seed(seed_for(cfg.seed, DROPOUT_STREAM, first + micro))  # dropout follows the data
            with gradient_sync(wrapped, model, sync=micro == accumulation - 1):
                with precision:
                    _, loss = wrapped(x, y)
                scaler.scale(loss / accumulation).backward()
            loss_sum += loss.detach().float()
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        sampler.position += cfg.gradient_accumulation_steps
        step, iter_num = iter_num, iter_num + 1  # lines name the step by its index, as nanoGPT does
        first_bad_iter = torch.where((first_bad_iter < 0) & ~torch.isfinite(loss_sum), step, first_bad_iter)

        if step % cfg.log_interval == 0:
            check_finite()
            steps = iter_num - last_log_iter
            loss_mean = reduce_numbers([loss_sum.item()], device, procs)[0] / (steps * cfg.gradient_accumulation_steps)
            elapsed = time.perf_counter() - timer_start
            train_seconds += elapsed
            seconds = elapsed / (iter_num - timer_iter)
            mfu = model.estimate_mfu(cfg.batch_size * accumulation, seconds, peak_flops)
            log.say(
                f"iter {step}: loss {loss_mean:.4f} | lr {lr:.2e} | {seconds * 1000:.1f} ms/iter | "
                f"{tokens_per_iter / seconds:,.0f} tok/s | mfu {f'{mfu:.1%}' if mfu is not None else 'n/a'}"
            )
            log.record(
                {"iter": step, "train/loss": loss_mean, "lr": lr, "mfu": mfu, "tokens_per_s": tokens_per_iter / seconds}
            )
            loss_sum.zero_()
            last_log_iter = iter_num
            timer_start, timer_iter = time.perf_counter(), iter_num
        # A single process stops after any step; processes stop together at log steps (agreeing costs a sync).
        if (not procs.distributed or step % cfg.log_interval == 0) and stop_requested(stop, device, procs):
            check_finite()
            saved = save(best=False)
            log.say(
                f"stopped by {stop.signal_name or 'a signal to another process'} after {iter_num} steps"
                f"{saved}; continue with --init_from=resume"
            )
            log.close()
            return 0

    trained_tokens = (iter_num - start_iter) * tokens_per_iter
    summary = {
        "iters": iter_num,
        "best_val_loss": best_val_loss,
        "val_loss": result["val/loss"] if result else None,
        "val_bpb": result["val/bpb"] if result else None,
        "train_seconds": round(train_seconds, 2),
        "tokens_per_s": round(trained_tokens / train_seconds, 1) if train_seconds else None,
    }
    if cfg.eval_full_split:
        summary["val_loss_full"] = evaluate_full_split()
    if procs.master:
        atomic_write_json(out_dir / "summary.json", summary)  # for scripts and benchmarks
    log.close()
    log.say(f"done: {iter_num} iters, best val loss {best_val_loss:.4f}, checkpoints in {out_dir}")
    return 0


def stop_requested(stop: StopRequest, device: torch.device, procs: Processes) -> bool:
    """Whether any process got SIGINT/SIGTERM (all processes agree, so they stop at the same step)."""
    return reduce_numbers([1.0 if stop.signal_name else 0.0], device, procs, op="max")[0] > 0


if __name__ == "__main__":
    run_cli(main)
