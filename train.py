"""Train a GPT, from a laptop CPU to many GPUs, or evaluate one (--eval_only).

    python train.py [config/FILE.py ...] [--key=value ...]
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

Reads top to bottom in the order it runs: the settings; the set-up (data, model, optimizer, all in one Run); the
step; evaluation and checkpoints; the loop; main.
One process trains on one device; under `torchrun` every process trains a replica (DistributedDataParallel)
or a shard (FSDP2) and rank 0 alone logs and saves. Checkpoints (out_dir/ckpt.pt, the best in out_dir/best.pt)
hold everything needed to continue exactly where a run stopped (--init_from=resume), even after kill -9.

Data placement: step s consumes global micro-batches s*G ... s*G+G-1 (G = gradient_accumulation_steps) and
rank r of N takes the r-th contiguous group of G/N of them (see loader.py). Dropout is seeded per global
micro-batch. So a run's data and dropout do not depend on how many processes share the work.

Chat data (prepare_data/chat.py) is trained on the same way, from conversations packed into rows: only assistant
tokens are targets, and a step's loss is their summed loss divided by their number over the whole step, all
micro-batches and processes, so the gradient is the one big batch's (gptkit/train/batches.py: what text and chat
data differ in). LoRA adapters are added at set-up; only their checkpoints' weights entries differ.
--objective=dpo trains on preference pairs (prepare_data/preferences.py) and --objective=grpo on rewarded samples of
its own: the same loop, with the objective's batches and loss (gptkit/train/objectives.py).

The set-up is built once (Run); the numbers the loop changes live in one LoopState that each step of the loop
takes explicitly. Processes: gptkit/core/distributed.py; what a run prints and logs: gptkit/train/runlog.py; the
checkpoint's format, written and read: gptkit/weights/checkpoint.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from pathlib import Path
from typing import Any

# OpenMP threads that spin while they wait take the time slice of the thread they wait for whenever other processes
# hold the cores, and sleeping ones cost an idle machine next to nothing (docs/benchmarks.md, "On a busy CPU").
# libgomp reads this once, when torch loads it: hence before the import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from gptkit.core import distributed, signals
from gptkit.core.devices import Runtime, autocast, peak_flops_for_device, resolve_dtype, tune_for_training
from gptkit.core.distributed import Processes
from gptkit.core.errors import UserError, run_cli
from gptkit.core.fileio import atomic_write_json
from gptkit.core.settings import parse_settings, setting, settings_to_dict
from gptkit.core.signals import StopRequest
from gptkit.data import loader
from gptkit.data.conversations import is_chat_data
from gptkit.data.meta import META_FILENAME, read_meta
from gptkit.data.preferences import PairBatches, PairEpoch, open_pairs
from gptkit.data.prompts import load_prompts
from gptkit.data.rewards import reward_named
from gptkit.data.tokenizer import padded_vocab_size, tokenizer_from_meta
from gptkit.eval import hellaswag
from gptkit.infer.groups import sample_groups
from gptkit.model import GPT, GPTConfig, config_to_dict
from gptkit.train import batches, curves, ema, forecast, grpo, loop, objectives, runlog
from gptkit.train.loop import LoopState
from gptkit.train.objectives import Dpo, Grpo, GrpoPlan, ObjectiveSettings
from gptkit.train.optim import configure_optimizers
from gptkit.train.reference import Reference
from gptkit.train.rundir import INIT_CHOICES_HELP, RunDirLock, remove_earlier_run, resolve_init_from
from gptkit.train.runlog import RunLog
from gptkit.weights import checkpoint as ckpt
from gptkit.weights.build import (
    base_reference,
    check_hf_base_tokenizer,
    load_model,
    model_from_checkpoint,
    model_of_checkpoint,
    model_with_adapters,
)
from gptkit.weights.lora import (
    BASE_WEIGHTS,
    TARGETS,
    LoraConfig,
    adapter_state,
    add_lora,
    lora_record,
)

# ----------------------------------------------------------------------------- settings


@dataclasses.dataclass
class TrainSettings(ObjectiveSettings, Runtime):
    # output, evaluation and checkpoints
    out_dir: str = setting("out", "directory for checkpoints (ckpt.pt latest, best.pt best val loss) and log.jsonl")
    eval_interval: int = setting(
        2000, "evaluate and save a checkpoint every this many steps (and at the end)", rule="positive"
    )
    log_interval: int = setting(1, "print one training line every this many steps", rule="positive")
    eval_iters: int = setting(
        200, "batches per split in each evaluation (a fixed set, the same every time)", rule="positive"
    )
    eval_only: bool = setting(False, "evaluate the model given by init_from, print the losses and exit")
    eval_full_split: bool = setting(
        False, "also the exact val loss over the whole val split (non-overlapping windows), at the end or eval_only"
    )
    always_save_checkpoint: bool = setting(True, "save ckpt.pt at every evaluation, not only when val improves")
    eval_tasks: str = setting("", "also evaluate these tasks (comma-separated: hellaswag), see eval.py")
    eval_tasks_interval: int | None = setting(None, "eval_tasks only at steps divisible by this", rule="positive")
    eval_tasks_limit: int | None = setting(None, "eval_tasks: the first N items of each task", rule="positive")
    hellaswag_path: str = setting("", "eval_tasks: HellaSwag JSONL file or URL (empty: the canonical val set, cached)")
    curves: bool = setting(True, "draw out_dir/curves.png of log.jsonl at the end and at evaluations 30 s apart")
    init_from: str = setting("scratch", INIT_CHOICES_HELP)
    overwrite: bool = setting(False, "start afresh even where out_dir holds an earlier run's checkpoint, replacing it")
    # logging to Weights & Biases
    wandb_log: bool = setting(False, "log config and metrics to wandb (WANDB_MODE=offline works without network)")
    wandb_project: str = setting("gpt", "wandb project name")
    wandb_run_name: str | None = setting(None, "wandb run name (None: wandb picks one)")
    # data
    dataset: str = setting("fineweb_edu", "prepared data directory under data/ (ignored when data_dir is set)")
    data_dir: str | None = setting(None, "any prepared data directory (holds meta.json and token files)")
    gradient_accumulation_steps: int = setting(
        40, "micro-batches per step over all processes (split across them)", rule="positive"
    )
    batch_size: int = setting(12, "sequences per micro-batch per process", rule="positive")
    block_size: int = setting(1024, "context length in tokens (crops a longer pretrained/resumed model)")
    # model (used for scratch; resume and gpt2 take the architecture from the checkpoint)
    n_layer: int = setting(12, "transformer blocks")
    n_head: int = setting(12, "attention heads per block")
    n_embd: int = setting(768, "embedding width (divisible by n_head)")
    dropout: float = setting(0.0, "dropout probability (0 for pretraining, 0.1+ for fine-tuning)")
    bias: bool = setting(False, "biases in Linear and LayerNorm layers")
    pos_encoding: str = setting("learned", "learned | sinusoidal | rope")
    rope_base: float = setting(10000.0, "rotary positions' base (pos_encoding=rope)", rule="positive_number")
    activation: str = setting("gelu_tanh", "MLP activation: gelu_tanh | gelu | relu2 | swiglu (gated, Llama's)")
    mlp_hidden: int | None = setting(None, "the MLP's inner width (None: 4 * n_embd)", rule="positive")
    norm: str = setting("layernorm", "layernorm (GPT-2) | rmsnorm (Llama family)")
    n_kv_head: int | None = setting(None, "key/value heads, each shared by n_head/n_kv_head heads (None: n_head)")
    attention: str = setting("sdpa", "sdpa (fused kernels) | math (explicit softmax)")
    qk_norm: bool = setting(False, "RMS-normalise queries and keys")
    qk_norm_weight: bool = setting(False, "QK-norm with a learned scale per head channel (Qwen3)")
    tie_embeddings: bool = setting(True, "share the token embedding with the output head")
    pad_vocab: bool = setting(False, "round vocab_size up to a multiple of 64 (faster matmuls on GPUs)")
    # low-rank adapters: the base frozen, small matrices beside its Linear layers trained (needs init_from a model)
    lora_rank: int = setting(0, "LoRA: the adapters' rank (0 = off: every weight trains)", rule="non_negative")
    lora_alpha: float = setting(16.0, "LoRA: the update is scaled by lora_alpha / lora_rank", rule="positive_number")
    lora_dropout: float = setting(0.0, "LoRA: dropout on the adapters' input", rule="fraction")
    lora_targets: str = setting(
        "attention", "LoRA: which Linear layers of each block get adapters", choices=tuple(TARGETS)
    )
    lora_base_weights: str = setting(
        "float32", "LoRA: how the frozen base is held (bfloat16 or int8: less memory)", choices=BASE_WEIGHTS
    )
    # optimizer and learning-rate schedule
    optimizer: str = setting(
        "adamw", "adamw | muon (Muon for the blocks' weight matrices, AdamW for the rest)", choices=("adamw", "muon")
    )
    muon_lr: float = setting(
        0.02, "optimizer=muon: Muon's peak learning rate (follows the same schedule)", rule="positive_number"
    )
    muon_momentum: float = setting(0.95, "optimizer=muon: Muon's momentum", rule="fraction")
    learning_rate: float = setting(6e-4, "peak learning rate", rule="positive_number")
    max_iters: int = setting(600000, "total optimizer steps", rule="non_negative")
    weight_decay: float = setting(0.1, "AdamW weight decay", rule="non_negative")
    beta1: float = setting(0.9, "AdamW beta1", rule="fraction")
    beta2: float = setting(0.95, "AdamW beta2", rule="fraction")
    grad_clip: float = setting(1.0, "clip the gradient norm to this (0 = off)", rule="non_negative")
    decay_lr: bool = setting(True, "linear warmup then cosine decay to min_lr (False: constant learning_rate)")
    warmup_iters: int | None = setting(
        None,
        "warmup steps: lr = learning_rate*(it+1)/(warmup_iters+1) (None, or not below max_iters: a tenth of "
        "max_iters, at most 2000)",
        rule="non_negative",
    )
    lr_decay_iters: int | None = setting(
        None,
        "step where the cosine reaches min_lr (None: max_iters; larger: the run ends part way)",
        rule="non_negative",
    )
    min_lr: float = setting(
        6e-5, "learning rate at the end of the decay (usually learning_rate/10)", rule="non_negative"
    )
    ema_decay: float = setting(
        0.0,
        "evaluate and save an exponential moving average of the weights, with this "
        "decay per step, as the model (0 = off; e.g. 0.95)",
        rule="fraction",
    )
    ema_start: int = setting(0, "ema_decay: average the weights from this step on", rule="non_negative")
    # system
    compile: bool | None = setting(None, "torch.compile the model (None: on for CUDA, off otherwise)")
    cpu_threads: int | None = setting(
        None, "torch CPU threads (None: torch's default; fewer on a busy machine)", rule="positive"
    )
    backend: str = setting(
        "auto",
        "torch.distributed backend under torchrun: auto (nccl on CUDA, gloo) | nccl | gloo",
        choices=("auto", "nccl", "gloo"),
    )
    parallel: str = setting(
        "ddp", "under torchrun: ddp (a replica per process) | fsdp (parameters sharded)", choices=("ddp", "fsdp")
    )
    peak_flops: float | None = setting(
        None,
        "the device's peak FLOP/s for the MFU figure (None: known for A100/H100/H200 GPUs, else MFU is n/a)",
        rule="positive_number",
    )

    def lora_config(self) -> LoraConfig:
        """The adapters these settings ask for (LoraConfig checks the values)."""
        return LoraConfig(
            rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout, targets=self.lora_targets
        )

    def schedule(self) -> loop.Schedule:
        """The learning-rate schedule, its unset lengths (and a warmup too long for the run) fitted to max_iters."""
        return loop.Schedule.fitted(
            max_iters=self.max_iters,
            learning_rate=self.learning_rate,
            min_lr=self.min_lr,
            warmup_iters=self.warmup_iters,
            lr_decay_iters=self.lr_decay_iters,
            decay_lr=self.decay_lr,
        )

    def validate(self) -> None:
        """Raise UserError for values that cannot work, before anything is loaded: the rules declared above are
        checked by parse_settings, the model settings by GPTConfig itself (model_config); these are the rest."""
        if not self.out_dir:
            raise UserError("out_dir must not be empty; give a directory for the checkpoints, e.g. --out_dir=out")
        self.validate_objective()
        if self.objective != "lm":
            if self.init_from == "scratch":
                raise UserError(f"--objective={self.objective} improves a trained model: give --init_from=CHECKPOINT")
            if self.parallel == "fsdp" or self.ema_decay:
                raise UserError(f"--objective={self.objective} takes neither --parallel=fsdp nor --ema_decay")
            if self.objective == "grpo" and self.eval_only:
                raise UserError("--objective=grpo has no loss to evaluate; measure pass@k with eval.py --prompts=FILE")
        if self.lora_rank:
            self.lora_config()  # its own checks
            if self.init_from == "scratch":
                raise UserError("LoRA adapts a trained model: give --init_from=CHECKPOINT (or gpt2), or --lora_rank=0")
            if self.ema_decay or self.parallel == "fsdp":
                raise UserError("LoRA runs take neither --ema_decay nor --parallel=fsdp; use DDP and no EMA")
        model_config(self)


def model_config(cfg: TrainSettings, vocab_size: int = GPTConfig.vocab_size) -> GPTConfig:
    """The model the settings describe: every GPTConfig field that is also a setting (n_layer, dropout,
    pos_encoding, ...) comes from them. GPTConfig checks the values, the one place model settings are checked; its
    ValueError is the user's mistake here."""
    options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig) if hasattr(cfg, f.name)}
    try:
        return GPTConfig(**options, vocab_size=vocab_size)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


# ----------------------------------------------------------------------------- set-up: data, model, optimizer


def create_model(cfg: TrainSettings, meta: dict) -> tuple[GPT, dict | None, dict | None]:
    """The model to train (on CPU), for resume the checkpoint it came from, and for LoRA its checkpoint record."""
    checkpoint = None
    if cfg.init_from == "scratch":
        model = GPT(model_config(cfg, data_vocab_size(cfg, meta)))
    elif cfg.init_from == "resume":
        path = Path(cfg.out_dir) / ckpt.LATEST_NAME
        checkpoint = ckpt.load_checkpoint(path, required_keys=ckpt.RESUME_KEYS)
        ckpt.check_same_tokenizer(checkpoint, meta, path)
        if "lora" in checkpoint:  # the base again, and the adapters as they were
            return model_with_adapters(checkpoint, str(path), {"dropout": cfg.dropout}), checkpoint, checkpoint["lora"]
        weights = checkpoint if cfg.eval_only else ema.trained_weights(checkpoint)  # not the EMA's
        model = model_from_checkpoint(weights, str(path), overrides={"dropout": cfg.dropout})
    elif ckpt.is_checkpoint_source(cfg.init_from):
        path = ckpt.resolve_checkpoint(cfg.init_from, "best")
        base = ckpt.load_checkpoint(path)
        ckpt.check_base_tokenizer(base, meta, path)
        model = model_of_checkpoint(base, str(path), overrides={"dropout": cfg.dropout})  # weights, no optimizer
    else:
        model = load_model(cfg.init_from, overrides={"dropout": cfg.dropout})
        check_hf_base_tokenizer(meta, cfg.init_from)
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)  # e.g. GPT-2's 1024 positions fine-tuned on shorter windows
    if meta["vocab_size"] > model.config.vocab_size and (cfg.init_from == "resume" or not is_chat_data(meta)):
        raise UserError(
            f"the data's vocab_size ({meta['vocab_size']}) is larger than the model's ({model.config.vocab_size}); "
            f"init_from={cfg.init_from} cannot read this data's tokens, use data from the model's tokenizer"
        )
    base_rows = model.config.vocab_size
    if meta["vocab_size"] > base_rows:
        model.grow_vocabulary(data_vocab_size(cfg, meta))  # the chat template's special tokens
    return model, checkpoint, add_adapters(cfg, model, base_rows) if cfg.lora_rank else None


def add_adapters(cfg: TrainSettings, model: GPT, base_rows: int) -> dict:
    """LoRA: freeze the model and add the adapters (the token rows from `base_rows` on, a chat template's, train
    too); returns the record that a LoRA checkpoint keeps to find its base again."""
    add_lora(model, cfg.lora_config(), cfg.lora_base_weights, first_new_row=base_rows)
    return lora_record(cfg.lora_config(), cfg.lora_base_weights, base_reference(cfg.init_from), base_rows)


def data_vocab_size(cfg: TrainSettings, meta: dict) -> int:
    """The model's vocabulary for this data: its vocab_size, rounded up to a multiple of 64 under pad_vocab."""
    return padded_vocab_size(meta["vocab_size"]) if cfg.pad_vocab else meta["vocab_size"]


def build_optimizer(cfg: TrainSettings, model: GPT, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer: the one place to add new ones. Each param group may carry "lr_scale" (default 1), its
    factor on the scheduled learning rate (Muon's group runs at muon_lr/learning_rate of it)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "muon":
        if distributed.is_fsdp(model):
            raise UserError("optimizer=muon needs whole weight matrices; use it with --parallel=ddp, not fsdp")
        muon = {"muon_lr": cfg.muon_lr, "muon_momentum": cfg.muon_momentum}
        return configure_optimizers(model, cfg.weight_decay, cfg.learning_rate, betas, device.type, **muon)
    return configure_optimizers(model, cfg.weight_decay, cfg.learning_rate, betas, device.type)


# ----------------------------------------------------------------------------- set-up: the run


@dataclasses.dataclass(kw_only=True)
class Run:
    """What a run sets up once and every step of the loop uses; the numbers that change are in LoopState."""

    cfg: TrainSettings
    procs: Processes
    device: torch.device
    meta: dict
    streams: dict[str, Any]  # per split: a loader.TokenStream, or a ConversationSplit for chat data
    model: GPT  # the unwrapped model: saved, counted
    lora: dict | None  # a LoRA run's checkpoint record (settings, base); its checkpoints hold the adapters only
    wrapped: torch.nn.Module  # the one to call (DDP, FSDP, torch.compile)
    precision: Any  # the autocast context of forward passes (a no-op in float32)
    optimizer: torch.optim.Optimizer
    schedule: loop.Schedule
    average: ema.WeightAverage  # ema_decay's average of the weights (a no-op when off)
    scaler: torch.amp.GradScaler
    sampler: batches.Sampler  # training batches (text windows or packed conversations); saved in checkpoints
    prefetcher: loader.BatchPrefetcher  # the sampler's batches, the next one read while a step computes
    eval_sets: dict[str, loader.FixedBatches]  # the same evaluation batches every time
    tasks: hellaswag.TrainingTasks  # eval_tasks, scored at evaluations
    log: RunLog
    peak_flops: float | None
    objective: Dpo | Grpo | None = None  # dpo and grpo; None: the next-token loss
    reference_source: str | None = None  # dpo and grpo: the starting model (init_from of the first run)
    config_files: tuple[str, ...] = ()  # the recipes the settings were read from

    @property
    def accumulation(self) -> int:
        return self.cfg.gradient_accumulation_steps // self.procs.world_size  # micro-steps in this process

    @property
    def tokens_per_iter(self) -> int:
        return self.cfg.gradient_accumulation_steps * self.cfg.batch_size * self.model.config.block_size

    @property
    def compiled(self) -> bool:
        return self.cfg.compile if self.cfg.compile is not None else self.device.type == "cuda"

    @property
    def latest_path(self) -> Path:
        return Path(self.cfg.out_dir) / ckpt.LATEST_NAME


def set_up(
    cfg: TrainSettings, procs: Processes, device: torch.device, held: contextlib.ExitStack
) -> tuple[Run, LoopState]:
    """Data → model → optimizer (restored from out_dir/ckpt.pt for --init_from=resume) → the run's log.
    A training run's rank 0 owns out_dir from its first write to its end: `held` keeps the lock."""
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.objective == "grpo":  # prompts instead of token data; the tokenizer is the starting model's
        data_dir, meta, streams = Path(cfg.grpo_prompts), starting_model_meta(cfg), {}
    else:
        data_dir = loader.data_dir_for(cfg.dataset, cfg.data_dir)
        dpo = cfg.objective == "dpo"
        if dpo and not (Path(data_dir) / META_FILENAME).is_file():  # read_meta's hint names the pretraining scripts
            raise UserError(
                f"--objective=dpo trains on preference pairs and {data_dir} holds none (no meta.json): give "
                "--data_dir=DIR written by prepare_data/preferences.py"
            )
        meta = read_meta(data_dir)
        streams = (
            {s: open_pairs(data_dir, s, meta) for s in ("train", "val")} if dpo else batches.open_splits(data_dir, meta)
        )
    torch.manual_seed(cfg.seed)  # the same initialisation in every process: FSDP shards are cut from it
    model, checkpoint, lora = create_model(cfg, meta)
    batches.check_splits_fit(streams, model.config.block_size, data_dir)
    reference_source = None
    if cfg.objective != "lm":
        reference_source = checkpoint.get("reference", cfg.init_from) if checkpoint else cfg.init_from
    reference = make_reference(cfg, meta, model, reference_source, device)
    tune_for_training(device, cfg.cpu_threads)  # after initialising: a seed gives the weights it always gave
    wrapped = distributed.parallelize(model, procs, device, cfg.parallel, cfg.compile)
    optimizer = build_optimizer(cfg, model, device)
    average = ema.for_training(model, cfg.ema_decay, cfg.ema_start, checkpoint)
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda" and dtype == torch.float16)
    sampler = make_training_sampler(cfg, streams, meta, model.config.block_size)
    iter_num, best_val_loss = 0, math.inf
    if checkpoint is not None:
        source = str(Path(cfg.out_dir) / ckpt.LATEST_NAME)
        iter_num, best_val_loss = ckpt.restore_training_state(checkpoint, source, model, optimizer, scaler, sampler)
        del checkpoint  # free the CPU copy of the weights
    prefetcher = loader.BatchPrefetcher(sampler, device)
    held.callback(prefetcher.close)
    log, replaced = open_log(cfg, procs, held)
    run = Run(
        cfg=cfg,
        procs=procs,
        device=device,
        meta=meta,
        streams=streams,
        model=model,
        lora=lora,
        wrapped=wrapped,
        precision=autocast(device, dtype),
        optimizer=optimizer,
        schedule=cfg.schedule(),
        average=average,
        scaler=scaler,
        sampler=sampler,
        prefetcher=prefetcher,
        eval_sets=evaluation_sets(cfg, streams, model.config.block_size),
        tasks=hellaswag.TrainingTasks(
            cfg.eval_tasks,
            cfg.eval_tasks_interval,
            cfg.eval_tasks_limit,
            cfg.hellaswag_path,
            meta["tokenizer"],
            cfg.batch_size,
            procs,
        ),
        log=log,
        peak_flops=cfg.peak_flops or peak_flops_for_device(device, dtype),
        objective=make_objective(cfg, meta, model, reference, sampler),
        reference_source=reference_source,
    )
    say_start(run, str(data_dir), str(dtype).removeprefix("torch."), replaced, iter_num, best_val_loss)
    return run, LoopState.begin(iter_num, best_val_loss, device)


def evaluation_sets(cfg: TrainSettings, streams: dict[str, Any], block_size: int) -> dict[str, loader.FixedBatches]:
    """The fixed evaluation batches of each split: the same eval_iters batches at every evaluation. DPO: every
    pair once, up to eval_iters batches; GRPO: none (it scores held-out prompts instead)."""
    if cfg.objective == "dpo":
        return {split: PairEpoch(streams[split], cfg.batch_size, block_size, cfg.eval_iters) for split in streams}
    if cfg.objective == "grpo":
        return {}
    purposes = {"train": loader.PURPOSE_EVAL_TRAIN, "val": loader.PURPOSE_EVAL_VAL}
    return {
        split: loader.FixedBatches(
            batches.make_sampler(streams[split], cfg.batch_size, block_size, cfg.seed, purpose), cfg.eval_iters
        )
        for split, purpose in purposes.items()
    }


def make_training_sampler(cfg: TrainSettings, streams: dict[str, Any], meta: dict, block_size: int) -> Any:
    """What the steps read, by global micro-batch index, its position saved in checkpoints: text windows or packed
    conversations (batches.make_sampler), preference pairs (DPO) or the prompts of each micro-batch (GRPO)."""
    if cfg.objective == "grpo":
        prompts = load_prompts(cfg.grpo_prompts, tokenizer_from_meta(ckpt.tokenizer_record(meta)))
        return grpo.PromptOrder(len(prompts), cfg.batch_size, cfg.seed)
    if cfg.objective == "dpo":
        return PairBatches(streams["train"], cfg.batch_size, block_size, cfg.seed, loader.PURPOSE_TRAIN)
    return batches.make_sampler(streams["train"], cfg.batch_size, block_size, cfg.seed, loader.PURPOSE_TRAIN)


def starting_model_meta(cfg: TrainSettings) -> dict:
    """GRPO's stand-in for a data directory's meta.json: the tokenizer the starting (or resumed) checkpoint records."""
    if cfg.init_from != "resume" and not ckpt.is_checkpoint_source(cfg.init_from):
        raise UserError("--objective=grpo starts from a checkpoint of ours: give --init_from=OUT_DIR or a .pt file")
    path = Path(cfg.out_dir) / ckpt.LATEST_NAME if cfg.init_from == "resume" else ckpt.resolve_checkpoint(cfg.init_from)
    record = ckpt.load_checkpoint(path, required_keys=()).get("tokenizer")
    if not isinstance(record, dict):
        raise UserError(f"{path} records no tokenizer, which --objective=grpo needs to render its prompts")
    tokenizer = {key: value for key, value in record.items() if key not in ("vocab_size", "eot_token")}
    return {"tokenizer": tokenizer, "vocab_size": record["vocab_size"], "eot_token": record.get("eot_token")}


def make_reference(
    cfg: TrainSettings, meta: dict, model: GPT, source: str | None, device: torch.device
) -> Reference | None:
    """DPO's reference, and GRPO's when it has a KL term: the base with adapters off for LoRA, else a frozen copy
    of the starting model (loaded again from `source` when a run resumes, so it is the start, not the resume)."""
    if cfg.objective == "lm" or (cfg.objective == "grpo" and not cfg.grpo_kl_beta):
        return None
    if cfg.lora_rank or cfg.init_from != "resume":
        return Reference(model)
    start, _, _ = create_model(dataclasses.replace(cfg, init_from=source, lora_rank=0), meta)
    return Reference(start.to(device))


def make_objective(
    cfg: TrainSettings, meta: dict, model: GPT, reference: Reference | None, order: Any
) -> Dpo | Grpo | None:
    """The objective of --objective=dpo or grpo (None for lm). GRPO samples with the batched engine (one eager
    engine per micro-batch, over the unwrapped model; the loop's compiled or DDP wrapper is for the loss)."""
    if cfg.objective == "dpo":
        return Dpo(reference, cfg.dpo_beta)
    if cfg.objective != "grpo":
        return None
    tokenizer = tokenizer_from_meta(ckpt.tokenizer_record(meta))
    stops = tuple(tokenizer.chat.reply_stops) if getattr(tokenizer, "chat", None) else (meta["eot_token"],)
    settings = {"max_new_tokens": cfg.grpo_max_new_tokens, "stop_tokens": stops}
    plan = GrpoPlan(
        prompts=load_prompts(cfg.grpo_prompts, tokenizer),
        eval_prompts=load_prompts(cfg.grpo_eval_prompts, tokenizer) if cfg.grpo_eval_prompts else [],
        sample=functools.partial(sample_groups, model, temperature=cfg.grpo_temperature, **settings),
        sample_greedy=functools.partial(sample_groups, model, temperature=0.0, **settings),
        reward=reward_named(cfg.grpo_reward),
        tokenizer=tokenizer,
        group_size=cfg.grpo_group_size,
        kl_beta=cfg.grpo_kl_beta,
        seed=cfg.seed,
    )
    return Grpo(plan, order, reference)


def open_log(cfg: TrainSettings, procs: Processes, held: contextlib.ExitStack) -> tuple[RunLog, list[str]]:
    """The run's log, and the names of the files of an earlier run that a fresh start removed. A training run's
    rank 0 takes out_dir's lock first (`held` keeps it): before the first write, after every check."""
    replaced = []
    if procs.master and not cfg.eval_only:
        held.enter_context(RunDirLock(cfg.out_dir))
        if cfg.init_from != "resume":
            replaced = remove_earlier_run(cfg.out_dir)  # resolve_init_from allowed it (overwrite, or no checkpoint)
        ckpt.remove_stale_temporaries(Path(cfg.out_dir))  # a run killed while saving leaves its temporary file behind
    wandb = None
    if cfg.wandb_log:
        wandb = {"project": cfg.wandb_project, "name": cfg.wandb_run_name, "config": settings_to_dict(cfg)}
    return RunLog(procs.master, None if cfg.eval_only else Path(cfg.out_dir), wandb), replaced  # eval_only: no file


def say_start(run: Run, data_dir: str, dtype: str, replaced: list[str], iter_num: int, best_val_loss: float) -> None:
    """The lines before the first evaluation: the model and data, and what the run replaced, shortened or resumed."""
    cfg, log = run.cfg, run.log
    log.tokens_per_iter = run.tokens_per_iter
    parameters = run.model.get_num_params()
    rows = cfg.gradient_accumulation_steps * cfg.batch_size
    step_size = objectives.step_size(cfg, rows, run.model.config.block_size)
    log.say(runlog.header_line(parameters, str(run.device), dtype, run.procs.world_size, step_size, data_dir))
    if replaced:
        log.say(runlog.replaced_line(Path(cfg.out_dir), replaced))
    if run.schedule.shortened_from is not None:
        log.say(runlog.shortened_warmup_line(run.schedule.shortened_from, cfg.max_iters, run.schedule.warmup_iters))
    if cfg.init_from == "resume" and not cfg.eval_only:
        log.say(runlog.resumed_line(iter_num, run.latest_path, best_val_loss))
    if run.lora is not None:
        trained = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        log.say(f"LoRA rank {cfg.lora_rank} on {cfg.lora_targets}: {trained:,} trained parameters, the base frozen")


# ----------------------------------------------------------------------------- the step


def train_step(run: Run, state: LoopState) -> tuple[int, float]:
    """One optimizer step: this process's micro-batches of the global step, gradients synced on the last one.
    Returns the step's index and learning rate."""
    cfg, model, wrapped = run.cfg, run.model, run.wrapped
    lr = loop.learning_rate_at(state.iter_num, run.schedule)
    loop.set_learning_rate(run.optimizer, lr)
    micro_batches = cfg.gradient_accumulation_steps  # of the whole step, in all processes
    step_targets = batches.step_target_count(run.sampler, run.sampler.position, micro_batches)  # chat data
    first = run.sampler.position + run.procs.rank * run.accumulation
    if isinstance(run.objective, Grpo):  # the step's rollouts, sampled by the model as it is now
        with run.precision:
            run.objective.prepare_step(list(range(first, first + run.accumulation)), run.device, run.procs)
    for micro in range(run.accumulation):
        # This process's next batch: the following micro-batch, or the first of its group in the next step.
        upcoming = first + micro + 1 if micro < run.accumulation - 1 else first + micro_batches
        if isinstance(run.objective, Grpo):
            x, y = run.objective.batch(micro, run.device)
        else:
            x, y = run.prefetcher.get(first + micro, upcoming)
        # Dropout follows the data: seeded by the global micro-batch, whichever process draws it.
        torch.manual_seed(loop.seed_for(cfg.seed, loop.DROPOUT_STREAM, first + micro))
        with distributed.gradient_sync(wrapped, model, sync=micro == run.accumulation - 1):
            if run.objective is not None:
                with run.precision:
                    loss, logged = run.objective.micro_loss(wrapped, micro, x, y, run.procs, run.accumulation)
            else:
                loss, logged = batches.micro_batch_loss(
                    wrapped,
                    x,
                    y,
                    run.precision,
                    step_targets=step_targets,
                    micro_batches=micro_batches,
                    world_size=run.procs.world_size,
                )
            run.scaler.scale(loss).backward()
        state.loss_sum += logged
    if cfg.grad_clip > 0:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.sampler.position += micro_batches
    step, state.iter_num = state.iter_num, state.iter_num + 1  # lines name the step by its index, as nanoGPT does
    run.average.update(state.iter_num)
    state.first_bad_iter = loop.note_non_finite(state.first_bad_iter, state.loss_sum, step)
    return step, lr


def log_progress(run: Run, state: LoopState, step: int, lr: float) -> None:
    """The training line of `step`: the loss averaged since the last line, learning rate, speed and MFU."""
    loop.check_finite(state.first_bad_iter, run.device, run.procs, run.latest_path)
    cfg = run.cfg
    steps = state.iter_num - state.last_log_iter
    loss_total = distributed.reduce_numbers([state.loss_sum.item()], run.device, run.procs)[0]
    loss_mean = loss_total / (steps * cfg.gradient_accumulation_steps)
    seconds = state.watch.lap() / (state.iter_num - state.watch.start_iter)
    mfu = run.model.estimate_mfu(cfg.batch_size * run.accumulation, seconds, run.peak_flops)
    entry = {"iter": step, "train/loss": loss_mean, "lr": lr, "mfu": mfu, "tokens_per_s": run.tokens_per_iter / seconds}
    if run.objective is not None:
        entry.update(run.objective.log_entries(run.device, run.procs))
    run.log.say(runlog.progress_line(entry, seconds))
    run.log.record(entry)
    state.loss_sum.zero_()
    state.last_log_iter = state.iter_num
    state.watch.restart(state.iter_num)


# ----------------------------------------------------------------------------- evaluation and checkpoints


def evaluate(run: Run, iter_num: int, stop: StopRequest | None = None) -> dict[str, Any] | None:
    """The mean loss on each split's fixed evaluation batches and val bits per byte, as a log.jsonl entry; None
    when `stop` was requested meanwhile (a single process stops within a batch). An objective adds its own figures
    (DPO: margin and accuracy; GRPO: held-out pass@1, and no loss)."""
    entry = {"iter": iter_num, "train/loss": None, "val/loss": None, "val/bpb": None}
    if isinstance(run.objective, Dpo):
        for split, pairs in run.eval_sets.items():
            entry.update(run.objective.evaluate(run.wrapped, pairs, run.precision, run.device, run.procs, split))
        return entry
    if isinstance(run.objective, Grpo):
        with run.precision:
            return {**entry, **run.objective.evaluate(run.procs)}
    losses = {}
    with run.average.applied():
        for split, fixed in run.eval_sets.items():
            losses[split] = loop.mean_loss(run.wrapped, fixed, run.precision, run.device, run.procs, stop)
            if losses[split] is None:
                return None
    val_bpb = batches.bits_per_byte(losses["val"], run.streams["val"], run.meta["splits"]["val"])
    return {"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "val/bpb": val_bpb}


def evaluate_full_split(run: Run) -> float:
    """The exact val loss over the whole val split (non-overlapping windows); prints it and returns it."""
    val = run.streams["val"]
    windows, tokens = batches.whole_split(val, run.model.config.block_size, run.cfg.batch_size)
    with run.average.applied():
        loss = loop.mean_loss(run.wrapped, windows, run.precision, run.device, run.procs)
    bpb = batches.bits_per_byte(loss, val, run.meta["splits"]["val"])
    run.log.say(runlog.full_split_line(tokens, loss, bpb))
    return loss


def save(run: Run, state: LoopState, best: bool) -> str:
    """Save ckpt.pt (and best.pt when `best`); every process takes part. Returns the note for the log line."""
    model_state, optimizer_state = ckpt.gather_training_state(run.model, run.optimizer)
    if run.procs.master:
        checkpoint = ckpt.training_checkpoint(
            weights=checkpoint_weights(run, model_state),
            optimizer_state=optimizer_state,
            model_args=config_to_dict(run.model.config),
            iter_num=state.iter_num,
            best_val_loss=state.best_val_loss,
            config=settings_to_dict(run.cfg),
            scaler_state=run.scaler.state_dict(),
            sampler_state=run.sampler.state_dict(),
            meta=run.meta,
        )
        if run.reference_source is not None:  # DPO and GRPO: where a resumed run finds its reference again
            checkpoint["reference"] = run.reference_source
        ckpt.save_training_checkpoint(run.cfg.out_dir, checkpoint, best)
    return runlog.saved_note(run.latest_path, Path(run.cfg.out_dir) / ckpt.BEST_NAME if best else None)


def checkpoint_weights(run: Run, model_state: dict) -> dict:
    """The weights entries of a checkpoint: "model" (and "trained_model" under an EMA); for LoRA, the adapters
    and the record that finds their base again."""
    if run.lora is None:
        return run.average.checkpoint_entries(model_state)
    return {"model": adapter_state(run.model), "lora": run.lora}


def evaluate_and_save(run: Run, state: LoopState, at_end: bool, stop: StopRequest) -> None:
    """Evaluate; save when the val loss improved (as best.pt too), when always_save_checkpoint, or at the end.
    An evaluation cut short by a stop request is dropped: the loop then stops and saves."""
    state.watch.lap()  # evaluation time is not training time
    loop.check_finite(state.first_bad_iter, run.device, run.procs, run.latest_path)
    result = evaluate(run, state.iter_num, stop)
    if result is None:
        return
    improved = result["val/loss"] is not None and result["val/loss"] < state.best_val_loss
    state.best_val_loss = min(state.best_val_loss, result["val/loss"] or math.inf)
    saved = ""
    if state.iter_num > 0 and (improved or run.cfg.always_save_checkpoint or at_end):
        saved = save(run, state, best=improved)
    run.log.say(runlog.eval_line(result, saved))
    with run.average.applied():
        result.update(run.tasks.run(run.wrapped, state.iter_num, at_end, run.precision, run.log))
    run.log.record(result)
    enabled = run.cfg.curves and run.procs.master
    state.curves_drawn_at = curves.refresh_curves(run.cfg.out_dir, enabled, state.curves_drawn_at, at_end)
    state.last_eval = result
    state.watch.restart(state.iter_num)


# ----------------------------------------------------------------------------- the loop


def train(run: Run, state: LoopState, stop: StopRequest) -> int:
    """The loop: evaluate and save on schedule, then one optimizer step, until max_iters or a signal."""
    cfg, procs = run.cfg, run.procs
    run.wrapped.train()
    # A compiled model's first passes compile: only its second step tells its speed. GRPO has no batch to time
    # before its first step samples one.
    if not run.compiled and "val" in run.eval_sets:
        forward_s = loop.forward_seconds(run.wrapped, run.eval_sets["val"][0], run.precision, run.device)
        say_forecast(run, state, forward_s * forecast.BACKWARD_FACTOR * run.accumulation, "estimated")
    timed_step = state.start_iter + (1 if run.compiled else 0)
    state.watch.restart(state.iter_num)  # speed is measured over training time only
    while True:
        at_end = state.iter_num >= cfg.max_iters
        resumed_here = state.iter_num == state.start_iter and cfg.init_from == "resume"  # evaluated before saving
        if (state.iter_num % cfg.eval_interval == 0 or at_end) and not resumed_here:
            evaluate_and_save(run, state, at_end, stop)
        if stop.signum and not procs.distributed:  # e.g. during set-up or the evaluation: no step first
            return stop_and_save(run, state, stop, stop.signum)
        if at_end:
            return finish(run, state)
        started = time.perf_counter()
        step, lr = train_step(run, state)
        if step == timed_step:
            say_forecast(run, state, loop.synchronized_seconds(started, run.device), f"step {step}, measured")
        if step % cfg.log_interval == 0:
            log_progress(run, state, step, lr)
        # A single process stops after any step; processes stop together at log steps (agreeing costs a sync).
        if not procs.distributed or step % cfg.log_interval == 0:
            signum = int(distributed.reduce_numbers([stop.signum], run.device, procs, op="max")[0])
            if signum:
                return stop_and_save(run, state, stop, signum)


def say_forecast(run: Run, state: LoopState, step_s: float, measured: str) -> None:
    """When the rest of the run would take long (steps of `step_s` seconds, and evaluations), say how long."""
    cfg = run.cfg
    eval_batches = sum(len(fixed) for fixed in run.eval_sets.values()) / run.procs.world_size
    resumed = cfg.init_from == "resume" and state.iter_num == state.start_iter
    expected = forecast.Forecast(
        step_s=step_s,
        steps=max(0, cfg.max_iters - state.iter_num),
        eval_s=eval_batches * step_s / (forecast.BACKWARD_FACTOR * run.accumulation),
        evaluations=forecast.evaluations_left(state.iter_num, cfg.max_iters, cfg.eval_interval, resumed),
    )
    if expected.long:
        hint = ""
        if run.device.type == "cpu":
            kind = cfg.objective if cfg.objective != "lm" else "chat" if is_chat_data(run.meta) else "lm"
            hint = forecast.shorter_run_hint(kind, run.config_files, cfg.max_iters)
        run.log.say(forecast.forecast_line(expected, measured, hint))


def stop_and_save(run: Run, state: LoopState, stop: StopRequest, signum: int) -> int:
    """After signal `signum` (SIGINT/SIGTERM, in any process): save ckpt.pt (unless this run has trained no step
    yet), say how to continue, and return the signal's conventional exit code (130 after Ctrl-C, 143 after
    SIGTERM). Under torchrun every worker returns 0: torchrun reports a worker's other code as a job failure."""
    loop.check_finite(state.first_bad_iter, run.device, run.procs, run.latest_path)
    saved = save(run, state, best=False) if state.iter_num > state.start_iter else None
    run.log.say(runlog.stopped_line(stop.signal_name, state.iter_num, saved))
    run.log.close()
    return 0 if run.procs.distributed else signals.exit_code(signum)


def finish(run: Run, state: LoopState) -> int:
    """The end of a run: out_dir/summary.json (for scripts and benchmarks), the whole-split loss if asked."""
    trained_tokens = (state.iter_num - state.start_iter) * run.tokens_per_iter
    seconds, result = state.watch.total, state.last_eval
    summary = {
        "iters": state.iter_num,
        "best_val_loss": state.best_val_loss if math.isfinite(state.best_val_loss) else None,  # GRPO has no loss
        "val_loss": result["val/loss"] if result else None,
        "val_bpb": result["val/bpb"] if result else None,
        **{key.replace("/", "_"): value for key, value in (result or {}).items() if key not in runlog.STANDARD_FIGURES},
        "train_seconds": round(seconds, 2),
        "tokens_per_s": round(trained_tokens / seconds, 1) if seconds else None,
    }
    if run.cfg.eval_full_split:
        summary["val_loss_full"] = evaluate_full_split(run)
    if run.procs.master:
        atomic_write_json(Path(run.cfg.out_dir) / runlog.SUMMARY_NAME, summary)
    run.log.close()
    best_saved = (Path(run.cfg.out_dir) / ckpt.BEST_NAME).exists()
    run.log.say(runlog.done_line(state.iter_num, state.best_val_loss, Path(run.cfg.out_dir), best_saved))
    return 0


def evaluate_only(run: Run, state: LoopState) -> int:
    """--eval_only: the estimate on the evaluation batches, and the whole val split if asked; writes nothing."""
    result = evaluate(run, state.iter_num)
    run.log.say(runlog.estimate_line(run.cfg.eval_iters, result))
    if run.cfg.eval_full_split:
        evaluate_full_split(run)
    return 0


# ----------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    """Train (or evaluate) as the settings in argv say; returns the exit code."""
    cfg = parse_settings(TrainSettings, argv, prog="train.py", description=__doc__.splitlines()[0], config_files=True)
    # eval_only writes nothing, so it replaces nothing.
    cfg.init_from = resolve_init_from(cfg.init_from, cfg.out_dir, overwrite=cfg.overwrite or cfg.eval_only)
    procs, device = distributed.start_processes(cfg.device, cfg.backend, cfg.gradient_accumulation_steps)
    finished = False
    try:
        with contextlib.ExitStack() as held, StopRequest(force_on_repeat=not procs.distributed) as stop:
            config_files = tuple(arg for arg in argv if not arg.startswith("--"))
            code = run_until_done_or_stopped(cfg, procs, device, held, stop, config_files)
        finished = True
        return code
    finally:
        distributed.teardown(procs, finished)  # under torchrun: every process leaves the group together


def run_until_done_or_stopped(
    cfg: TrainSettings,
    procs: Processes,
    device: torch.device,
    held: contextlib.ExitStack,
    stop: StopRequest,
    config_files: tuple[str, ...],
) -> int:
    """Set up, then train (or evaluate); returns the exit code. A stop asked for is a clean stop, whatever it
    cut short: a terminal's Ctrl-C also reaches the compilers torch.compile runs, and their failure is then one
    line, not a traceback."""
    try:
        run, state = set_up(cfg, procs, device, held)
        run.config_files = config_files
        return evaluate_only(run, state) if cfg.eval_only else train(run, state, stop)
    except Exception as exc:
        if not stop.signum or isinstance(exc, UserError):
            raise
        print(runlog.cut_short_line(stop.signal_name, type(exc).__name__), flush=True)
        return signals.exit_code(stop.signum)


if __name__ == "__main__":
    run_cli(main)
