"""Train a GPT, from a laptop CPU to many GPUs, or evaluate one (--eval_only).

    python train.py [config/FILE.py ...] [--key=value ...]
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

Reads top to bottom in the order it runs: the settings; the set-up (data, model, optimizer, all in one Run); the
step; evaluation and checkpoints; the loop; main. One process trains on one device; under `torchrun` every process
trains a replica (DistributedDataParallel) or a shard (FSDP2) and rank 0 alone logs and saves. Checkpoints
(out_dir/ckpt.pt, the best in out_dir/best.pt) hold everything needed to continue exactly where a run stopped
(--init_from=resume), even after kill -9.

Data placement: step s consumes global micro-batches s*G ... s*G+G-1 (G = gradient_accumulation_steps) and
rank r of N takes the r-th contiguous group of G/N of them (see loader.py). Dropout is seeded per global
micro-batch. So a run's data and dropout do not depend on how many processes share the work.

What a step minimises is the objective's (gptkit/train/objectives.py): its data, micro-batches, loss, logged
figures and evaluation. --objective=lm (the default) is the next-token loss on text, or on chat data
(prepare_data/chat.py) whose conversations are packed into rows with the assistant's tokens as targets;
--objective=dpo trains on preference pairs (prepare_data/preferences.py) and --objective=grpo on rewarded samples
of its own. The loop is the same for all three and asks nothing about which one runs.

The model is made once at set-up, LoRA adapters included (gptkit/train/models.py: only its checkpoints' weights
entries differ). The numbers the loop changes live in one LoopState that each step of the loop takes explicitly.
Processes: gptkit/core/distributed.py; what a run prints and logs: gptkit/train/runlog.py; the checkpoint's format,
written and read: gptkit/weights/checkpoint.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from gptkit.core import distributed, signals
from gptkit.core.devices import Runtime, autocast, peak_flops_for_device, resolve_dtype, tune_for_training
from gptkit.core.distributed import Processes
from gptkit.core.errors import UserError, run_cli
from gptkit.core.fileio import atomic_write_json
from gptkit.core.settings import parse_settings, setting, settings_to_dict
from gptkit.core.signals import StopRequest
from gptkit.eval import hellaswag
from gptkit.infer.groups import sample_groups
from gptkit.model import GPT, config_to_dict
from gptkit.train import curves, ema, forecast, loop, models, objectives, optim, rundir, runlog
from gptkit.train.loop import LoopState
from gptkit.train.objectives import Objective, ObjectiveSettings
from gptkit.train.rundir import INIT_CHOICES_HELP, resolve_init_from
from gptkit.train.runlog import RunLog
from gptkit.weights import checkpoint as ckpt
from gptkit.weights.lora import BASE_WEIGHTS, TARGETS, LoraConfig

# ----------------------------------------------------------------------------- settings


@dataclasses.dataclass(kw_only=True)
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
    hellaswag_path: str = hellaswag.path_setting(used_by="eval_tasks: ")
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
        "float32", "LoRA: how the frozen base is held, in less memory than float32 by the others", choices=BASE_WEIGHTS
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
    min_lr: float | None = setting(
        None, "learning rate at the end of the decay (None: learning_rate / 10)", rule="non_negative"
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
            min_lr=self.learning_rate / 10 if self.min_lr is None else self.min_lr,
            warmup_iters=self.warmup_iters,
            lr_decay_iters=self.lr_decay_iters,
            decay_lr=self.decay_lr,
        )

    def validate(self) -> None:
        """Raise UserError for values that cannot work, before anything is loaded: the rules declared above are
        checked by parse_settings, the objective's by the objective, the model settings by GPTConfig itself
        (models.model_config); these are the rest."""
        if not self.out_dir:
            raise UserError("out_dir must not be empty; give a directory for the checkpoints, e.g. --out_dir=out")
        if self.decay_lr and self.min_lr is not None and self.min_lr > self.learning_rate:
            raise UserError(
                f"--min_lr ({self.min_lr}) is above --learning_rate ({self.learning_rate}): the rate would rise as it "
                "decays; give a smaller --min_lr"
            )
        objectives.build(self).check_settings()
        if self.lora_rank:
            self.lora_config()  # its own checks
            if self.init_from == "scratch":
                raise UserError("LoRA adapts a trained model: give --init_from=CHECKPOINT (or gpt2), or --lora_rank=0")
            if self.ema_decay or self.parallel == "fsdp":
                raise UserError("LoRA runs take neither --ema_decay nor --parallel=fsdp; use DDP and no EMA")
        models.model_config(self)


# ----------------------------------------------------------------------------- set-up: data, model, optimizer


@dataclasses.dataclass(kw_only=True)
class Run:
    """What a run sets up once and every step of the loop uses; the numbers that change are in LoopState."""

    cfg: TrainSettings
    procs: Processes
    device: torch.device
    meta: dict  # the data's meta.json (GRPO: the starting model's tokenizer record), recorded by checkpoints
    objective: Objective  # what a step minimises: its data, batches, loss, figures and evaluation
    model: GPT  # the unwrapped model: saved, counted
    lora: dict | None  # a LoRA run's checkpoint record (settings, base); its checkpoints hold the adapters only
    wrapped: torch.nn.Module  # the one to call (DDP, FSDP, torch.compile)
    precision: Any  # the autocast context of forward passes (a no-op in float32)
    optimizer: torch.optim.Optimizer
    schedule: loop.Schedule
    average: ema.WeightAverage  # ema_decay's average of the weights (a no-op when off)
    scaler: torch.amp.GradScaler
    tasks: hellaswag.TrainingTasks  # eval_tasks, scored at evaluations
    log: RunLog
    peak_flops: float | None
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
    """Data → model (and the objective's reference) → optimizer (restored from out_dir/ckpt.pt for
    --init_from=resume) → the run's log. A training run's rank 0 owns out_dir from its first write to its end:
    `held` keeps the lock."""
    dtype = resolve_dtype(cfg.dtype, device)
    precision = autocast(device, dtype)
    objective = objectives.build(cfg, sample_groups)
    data = objective.open_data()
    torch.manual_seed(cfg.seed)  # the same initialisation in every process: FSDP shards are cut from it
    model, resumed, lora = models.create_model(cfg, data.meta)
    notes = objective.unused_settings_note(), models.unused_shape_note(cfg, model.config)
    for note in (*notes, models.changed_settings_note(cfg, resumed)):
        if note and procs.master:
            print(note, flush=True)
    reference = models.frozen_reference(cfg, data.meta, model, resumed, device) if objective.needs_reference else None
    objective.start(
        model=model, reference=reference, resumed=resumed, device=device, procs=procs, precision=precision, lora=lora
    )
    held.callback(objective.close)
    tune_for_training(device, cfg.cpu_threads)  # after initialising: a seed gives the weights it always gave
    wrapped = distributed.parallelize(model, procs, device, cfg.parallel, cfg.compile)
    optimizer = optim.build_optimizer(cfg, model, device)
    average = ema.for_training(model, cfg.ema_decay, cfg.ema_start, resumed)
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda" and dtype == torch.float16)
    iter_num, best_val_loss, evaluated = 0, math.inf, True
    if resumed is not None:
        iter_num, best_val_loss, evaluated = restore(cfg, resumed, model, optimizer, scaler, objective)
        del resumed  # free the CPU copy of the weights
    wandb = {"project": cfg.wandb_project, "name": cfg.wandb_run_name, "config": settings_to_dict(cfg)}
    log, replaced = rundir.open_run_log(
        cfg.out_dir,
        held,
        master=procs.master,
        writes=not cfg.eval_only,
        fresh=cfg.init_from != "resume",
        wandb=wandb if cfg.wandb_log else None,
    )
    run = Run(
        cfg=cfg,
        procs=procs,
        device=device,
        meta=data.meta,
        objective=objective,
        model=model,
        lora=lora,
        wrapped=wrapped,
        precision=precision,
        optimizer=optimizer,
        schedule=cfg.schedule(),
        average=average,
        scaler=scaler,
        tasks=hellaswag.TrainingTasks(
            tasks=cfg.eval_tasks,
            interval=cfg.eval_tasks_interval,
            limit=cfg.eval_tasks_limit,
            hellaswag_path=cfg.hellaswag_path,
            tokenizer_meta=data.meta["tokenizer"],
            batch_size=cfg.batch_size,
            procs=procs,
        ),
        log=log,
        peak_flops=cfg.peak_flops or peak_flops_for_device(device, dtype),
    )
    say_start(run, str(data.directory), str(dtype).removeprefix("torch."), replaced, iter_num, best_val_loss)
    return run, LoopState.begin(iter_num, best_val_loss, device, start_evaluated=evaluated)


def restore(
    cfg: TrainSettings,
    resumed: dict,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    objective: Objective,
) -> tuple[int, float, bool]:
    """The optimizer's, scaler's and data order's state put back from the checkpoint; its step, best val loss, and
    whether that step was evaluated (a checkpoint saved by a stop was not). --eval_only trains nothing: the step
    alone, whatever optimizer the run had."""
    latest = str(Path(cfg.out_dir) / ckpt.LATEST_NAME)
    if cfg.eval_only:
        try:
            return ckpt.checkpoint_step(resumed), math.inf, True
        except (KeyError, ValueError) as exc:
            raise ckpt.damaged_training_state(latest, exc) from exc
    parts = (model, optimizer, scaler, objective.sampler)
    iter_num, best_val_loss = ckpt.restore_training_state(resumed, latest, *parts, optimizer_name=cfg.optimizer)
    return iter_num, best_val_loss, resumed.get("evaluated", True) is not False


def say_start(run: Run, data_dir: str, dtype: str, replaced: list[str], iter_num: int, best_val_loss: float) -> None:
    """The lines before the first evaluation: the model and data, and what the run replaced, shortened or resumed."""
    cfg, log = run.cfg, run.log
    log.tokens_per_iter = run.tokens_per_iter
    parameters = run.model.get_num_params()
    step_size = run.objective.step_size(cfg.gradient_accumulation_steps * cfg.batch_size, run.model.config.block_size)
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
    """One optimizer step over this process's micro-batches (gradients synced on the last); its index and lr."""
    cfg, model, wrapped, objective = run.cfg, run.model, run.wrapped, run.objective
    lr = loop.learning_rate_at(state.iter_num, run.schedule)
    loop.set_learning_rate(run.optimizer, lr)
    # The step's global micro-batches, and this process's contiguous share of them (the top of this file).
    first = objective.sampler.position
    step_batches = range(first, first + cfg.gradient_accumulation_steps)
    my_batches = step_batches[run.procs.rank * run.accumulation :][: run.accumulation]
    objective.prepare_step(step_batches, my_batches)  # GRPO: the step's rollouts, sampled by the model as it is now
    for micro, index in enumerate(my_batches):
        x, y = objective.batch(micro)
        # Dropout follows the data: seeded by the global micro-batch, whichever process draws it.
        torch.manual_seed(loop.seed_for(cfg.seed, loop.DROPOUT_STREAM, index))
        with distributed.gradient_sync(wrapped, model, sync=micro == run.accumulation - 1):
            loss, logged = objective.micro_loss(wrapped, micro, x, y)
            run.scaler.scale(loss).backward()
        state.loss_sum += logged
    if cfg.grad_clip > 0:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    objective.sampler.position += len(step_batches)
    step, state.iter_num = state.iter_num, state.iter_num + 1  # lines name the step by its index, as nanoGPT does
    run.average.update(state.iter_num)
    state.first_bad_iter = loop.note_non_finite(state.first_bad_iter, state.loss_sum, step)
    return step, lr


def log_progress(run: Run, state: LoopState, step: int, lr: float) -> None:
    """The training line of `step`: the loss averaged since the last line, learning rate, speed and MFU, and the
    objective's own figures."""
    loop.check_finite(state.first_bad_iter, run.device, run.procs, run.latest_path)
    cfg = run.cfg
    steps = state.iter_num - state.last_log_iter
    loss_total = distributed.reduce_numbers([state.loss_sum.item()], run.device, run.procs)[0]
    loss_mean = loss_total / (steps * cfg.gradient_accumulation_steps)
    seconds = state.watch.lap() / (state.iter_num - state.watch.start_iter)
    mfu = run.model.estimate_mfu(cfg.batch_size * run.accumulation, seconds, run.peak_flops)
    entry = {"iter": step, "train/loss": loss_mean, "lr": lr, "mfu": mfu, "tokens_per_s": run.tokens_per_iter / seconds}
    entry.update(run.objective.log_entries())
    run.log.say(runlog.progress_line(entry, seconds))
    run.log.record(entry)
    state.loss_sum.zero_()
    state.last_log_iter = state.iter_num
    state.watch.restart(state.iter_num)


# ----------------------------------------------------------------------------- evaluation and checkpoints


def evaluate(run: Run, iter_num: int, stop: StopRequest | None = None) -> dict[str, Any] | None:
    """The objective's evaluation (lm: the mean loss on each split's fixed batches and val bits per byte; DPO:
    margin and accuracy too; GRPO: held-out pass@1, and no loss), of the EMA's weights when there is one, as a
    log.jsonl entry; None when `stop` was requested meanwhile (a single process stops within a batch)."""
    with run.average.applied():
        figures = run.objective.evaluate(run.wrapped, stop)
    return None if figures is None else {"iter": iter_num, **figures}


def evaluate_full_split(run: Run) -> float:
    """The exact val loss over the whole val split (non-overlapping windows); prints it and returns it."""
    with run.average.applied():
        loss, tokens, bpb = run.objective.whole_split(run.wrapped)
    run.log.say(runlog.full_split_line(tokens, loss, bpb))
    return loss


def save(run: Run, state: LoopState, best: bool, evaluated: bool = True) -> str:
    """Save ckpt.pt (and best.pt when `best`); every process takes part. Returns the note for the log line.
    evaluated: whether this step's evaluation (when one is due) was done; a run resumed from a checkpoint saved
    without it does it first, as the run would have gone on."""
    model_state, optimizer_state = ckpt.gather_training_state(run.model, run.optimizer)
    if run.procs.master:
        checkpoint = ckpt.training_checkpoint(
            weights=models.checkpoint_weights(run.model, run.lora, run.average, model_state),
            optimizer_state=optimizer_state,
            model_args=config_to_dict(run.model.config),
            iter_num=state.iter_num,
            best_val_loss=state.best_val_loss,
            config=settings_to_dict(run.cfg),
            scaler_state=run.scaler.state_dict(),
            sampler_state=run.objective.sampler.state_dict(),
            meta=run.meta,
        )
        checkpoint.update(run.objective.checkpoint_entries())  # DPO and GRPO: where a resume finds the reference
        checkpoint["evaluated"] = evaluated
        ckpt.save_training_checkpoint(run.cfg.out_dir, checkpoint, best)
    return runlog.saved_note(run.latest_path, Path(run.cfg.out_dir) / ckpt.BEST_NAME if best else None)


def evaluate_and_save(run: Run, state: LoopState, at_end: bool, stop: StopRequest) -> str | None:
    """Evaluate; save when the val loss improved (as best.pt too), when always_save_checkpoint, or at the end.
    Returns the saved note ("" when nothing was saved), or None for an evaluation cut short by a stop request,
    which is dropped: the loop then stops and saves."""
    state.watch.lap()  # evaluation time is not training time
    loop.check_finite(state.first_bad_iter, run.device, run.procs, run.latest_path)
    result = evaluate(run, state.iter_num, stop)
    if result is None:
        return None
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
    return saved


# ----------------------------------------------------------------------------- the loop


def train(run: Run, state: LoopState, stop: StopRequest) -> int:
    """The loop: evaluate and save on schedule, then one optimizer step, until max_iters or a signal."""
    cfg, procs = run.cfg, run.procs
    run.wrapped.train()
    # A compiled model's first step compiles, so its second tells the speed (GRPO has no batch to time before it).
    if not run.compiled and "val" in run.objective.eval_sets:
        forward_s = loop.forward_seconds(run.wrapped, run.objective.eval_sets["val"][0], run.precision, run.device)
        say_forecast(run, state, forward_s * forecast.BACKWARD_FACTOR * run.accumulation, "estimated")
    timed_step = state.start_iter + (1 if run.compiled else 0)
    state.watch.restart(state.iter_num)  # speed is measured over training time only
    while True:
        at_end = state.iter_num >= cfg.max_iters
        # a resumed run's first step was evaluated before it was saved, unless a stop saved it
        resumed_here = state.iter_num == state.start_iter and cfg.init_from == "resume" and state.start_evaluated
        if resumed_here and at_end:  # a finished run started again (--init_from=auto): its results stand
            return nothing_left(run, state)
        evaluation = None
        if (state.iter_num % cfg.eval_interval == 0 or at_end) and not resumed_here:
            evaluation = evaluate_and_save(run, state, at_end, stop)
        if stop.signum and not procs.distributed:  # e.g. during the evaluation: no step first
            return stop_and_save(run, state, stop, stop.signum, evaluation)
        if at_end:
            return finish(run, state)
        started = time.perf_counter()
        step, lr = train_step(run, state)
        stop.at_once = False
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
    eval_batches = sum(len(fixed) for fixed in run.objective.eval_sets.values()) / run.procs.world_size
    resumed = cfg.init_from == "resume" and state.iter_num == state.start_iter
    expected = forecast.Forecast(
        step_s=step_s,
        steps=max(0, cfg.max_iters - state.iter_num),
        eval_s=eval_batches * step_s / (forecast.BACKWARD_FACTOR * run.accumulation),
        evaluations=forecast.evaluations_left(state.iter_num, cfg.max_iters, cfg.eval_interval, resumed),
    )
    if expected.long:
        hint = ""
        if run.device.type == "cpu":  # the objective's CPU recipe
            hint = forecast.shorter_run_hint(run.objective.kind, run.config_files, cfg.max_iters)
        run.log.say(forecast.forecast_line(expected, measured, hint))


def stop_and_save(run: Run, state: LoopState, stop: StopRequest, signum: int, evaluation: str | None = None) -> int:
    """After signal `signum` (SIGINT/SIGTERM, in any process): save ckpt.pt (unless this run has trained no step
    yet, or this step's evaluation has just saved it: `evaluation`, evaluate_and_save's note), say how to continue,
    and return the signal's conventional exit code (130 after Ctrl-C, 143 after SIGTERM). Under torchrun every
    worker returns 0: torchrun reports a worker's other code as a job failure."""
    loop.check_finite(state.first_bad_iter, run.device, run.procs, run.latest_path)
    saved = evaluation or None
    if saved is None and state.iter_num > state.start_iter:
        saved = save(run, state, best=False, evaluated=evaluation is not None)
    run.log.say(runlog.stopped_line(stop.signal_name, state.iter_num, saved))
    run.log.close()
    return 0 if run.procs.distributed else signals.exit_code(signum)


def nothing_left(run: Run, state: LoopState) -> int:
    """A run resumed at or past max_iters: nothing to train, and its summary.json and checkpoints stay as they are."""
    run.log.say(runlog.nothing_left_line(state.iter_num, run.cfg.max_iters, run.latest_path))
    run.log.close()
    return 0


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
            code, whole = run_until_done_or_stopped(cfg, procs, device, held, stop, config_files)
        finished = whole  # after the run's files are closed
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
) -> tuple[int, bool]:
    """Set up, then train (or evaluate); returns the exit code and whether the run's work ended whole (under
    torchrun: every process is still there to leave the group together). A stop asked for is a clean stop,
    whatever it cut short: a terminal's Ctrl-C also reaches the compilers torch.compile runs, and a process
    torchrun stops because another one died is in a collective that fails; each is then one line, not a
    traceback."""
    run = None
    # Until this run's first step there is nothing to save, and loading a model, timing a pass, a first evaluation or
    # step may take minutes (or compile): a signal stops at once.
    stop.at_once = not procs.distributed
    try:
        run, state = set_up(cfg, procs, device, held)
        run.config_files = config_files
        return (evaluate_only(run, state) if cfg.eval_only else train(run, state, stop)), True
    except KeyboardInterrupt:
        if not stop.at_once or not stop.signum:  # a second Ctrl-C
            raise
        if run is not None:
            run.log.say(runlog.stopped_line(stop.signal_name, state.iter_num, None))
            run.log.close()
        return signals.exit_code(stop.signum), True
    except Exception as exc:
        if not stop.signum or isinstance(exc, UserError):
            raise
        print(runlog.cut_short_line(stop.signal_name, type(exc).__name__), flush=True)
        return signals.exit_code(stop.signum), False


if __name__ == "__main__":
    run_cli(main)
