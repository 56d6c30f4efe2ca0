"""What a training step minimises: --objective=lm (next-token loss, the default), dpo or grpo, with their settings.

train.py's loop is the same for all three: micro-batches, gradient accumulation and sync, clipping, the optimizer,
evaluations, checkpoints and resume. Everything that differs is the objective's, behind one interface (Objective),
and `build` makes it from the settings, the one place that reads --objective. An objective gives the loop:

- its data: what it reads and how (open_data), its sampler (batch i of the run, the position saved in checkpoints)
  and its fixed evaluation batches (eval_sets);
- a step's micro-batches (prepare_step, then batch) and the loss of each (micro_loss);
- the figures it adds to training lines (log_entries) and its evaluation (evaluate, and lm's whole_split);
- whether it needs the frozen starting model (needs_reference), the entries it adds to checkpoints
  (checkpoint_entries), what a step processes (step_size) and the CPU recipe that suits it (kind).

The three:

- lm (Lm): random windows of a token stream, or chat conversations packed into rows whose targets are the
  assistant's tokens (gptkit.train.batches says how the two differ); logged: the loss, and val bits per byte.
- dpo (Dpo, gptkit.train.dpo): batches of preference pairs (gptkit.data.preferences); logged loss, reward margin
  and chosen-over-rejected accuracy, on train and (at evaluations) val.
- grpo (Grpo, gptkit.train.grpo): each step first samples its rollouts (G completions per prompt, in one batch),
  then the micro-batches are those rollouts; logged mean reward and completion length, and at evaluations the
  greedy pass@1 on the held-out prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptkit.core.distributed import Processes, reduce_numbers
from gptkit.core.errors import UserError
from gptkit.core.settings import setting
from gptkit.core.signals import StopRequest
from gptkit.data import loader
from gptkit.data.conversations import is_chat_data
from gptkit.data.meta import META_FILENAME, read_meta
from gptkit.data.preferences import PairBatches, PairEpoch, is_preference_data, open_pairs
from gptkit.data.prompts import Prompt, load_prompts
from gptkit.data.rewards import BUILT_IN, Reward, reward_named
from gptkit.data.tokenizer import tokenizer_from_meta
from gptkit.model import GPT
from gptkit.train import batches, dpo, grpo, loop
from gptkit.train.reference import Reference, token_logprobs
from gptkit.weights import checkpoint as ckpt
from gptkit.weights.sources import base_reference, open_weights_meta

OBJECTIVES = ("lm", "dpo", "grpo")
NO_LOSS = {"train/loss": None, "val/loss": None, "val/bpb": None}  # an evaluation's standard figures, not measured


@dataclass(kw_only=True)
class ObjectiveSettings:
    """--objective and the settings of each objective (train.py's settings extend this class)."""

    objective: str = setting(
        "lm",
        "lm: next-token loss (pretraining, chat fine-tuning) | dpo: preference pairs (prepare_data/preferences.py) | "
        "grpo: reinforcement learning on a reward of sampled completions",
        choices=OBJECTIVES,
    )
    dpo_beta: float = setting(0.1, "dpo: how far the model may move from the reference (beta)", rule="positive_number")
    grpo_prompts: str = setting("", "grpo: JSONL file of training prompts ('prompt' and what the reward reads)")
    grpo_eval_prompts: str = setting("", "grpo: JSONL file of held-out prompts, greedy pass@1 at every evaluation")
    grpo_group_size: int = setting(8, "grpo: completions sampled per prompt (G, at least 2)", rule="positive")
    grpo_reward: str = setting(
        "number", f"grpo: the reward: {' | '.join(BUILT_IN)} | module:function (your own, imported)"
    )
    grpo_max_new_tokens: int = setting(64, "grpo: the longest completion, in tokens", rule="positive")
    grpo_temperature: float = setting(1.0, "grpo: sampling temperature of the rollouts", rule="positive_number")
    grpo_kl_beta: float = setting(
        0.0, "grpo: weight of the KL penalty to the reference (0 = none)", rule="non_negative"
    )


def build(settings: ObjectiveSettings, sample_groups: Callable[..., list[list[int]]] | None = None) -> Objective:
    """The objective --objective names, not yet started. `sample_groups` is the batched engine's sampler
    (gptkit.infer.groups.sample_groups, handed in by train.py: this layer does not import gptkit.infer), which GRPO
    samples its rollouts with."""
    if settings.objective == "dpo":
        return Dpo(settings)
    if settings.objective == "grpo":
        return Grpo(settings, sample_groups)
    return Lm(settings)


def step_size(settings: ObjectiveSettings, rows: int, block_size: int) -> str:
    """What one optimizer step processes, in the objective's own unit; `rows` is batch_size times the micro-batches."""
    return build(settings).step_size(rows, block_size)


@dataclass(frozen=True, kw_only=True)
class TrainingData:
    """What an objective reads: its directory (named in the run's first line), its meta.json (for GRPO the starting
    model's tokenizer record) and its opened train and val splits (none for GRPO)."""

    directory: Path
    meta: dict
    splits: dict[str, Any]


def token_data_dir(cfg: ObjectiveSettings) -> Path:
    """The prepared data directory of --data_dir, else of --dataset under data/."""
    return loader.data_dir_for(cfg.dataset, cfg.data_dir)


# ----------------------------------------------------------------------------- the interface


class Objective:
    """The interface train.py's loop calls. Built from the settings alone (`settings`: train.py's, which include
    every training setting), it opens its data, then starts on the model (start), then trains.

    By default a step's micro-batches are the sampler's batches, read ahead on a background thread while a step
    computes (Lm and Dpo); Grpo samples its own instead.
    """

    kind = ""  # its CPU recipe, a key of gptkit.train.forecast.CPU_RECIPES
    # The settings it never reads (a name, or a prefix ending in "_"): other objectives', GRPO's token data.
    unused_settings: tuple[str, ...] = ("dpo_", "grpo_")
    needs_reference = False  # whether start() takes the frozen starting model (gptkit.train.models)

    def __init__(self, settings: ObjectiveSettings) -> None:
        self.cfg = settings
        self.sampler: Any = None  # batch i of the run, its position saved in checkpoints (start sets it)
        self.eval_sets: dict[str, Sequence] = {}  # per split, the fixed batches evaluated every time
        self.data: TrainingData | None = None  # open_data's
        self.prefetcher: loader.BatchPrefetcher | None = None
        self.mine, self.following = range(0), 0

    def check_settings(self) -> None:
        """UserError for settings this objective cannot work with, before anything is loaded."""

    def unused_settings_note(self) -> str | None:
        """A note naming the settings changed from their defaults that this objective does not read (None: none).
        Why: --data_dir given to a GRPO run, or --dpo_beta to a next-token one, would otherwise do nothing, silently."""
        unused = [
            f"--{field.name}={getattr(self.cfg, field.name)!r}"
            for field in dataclasses.fields(self.cfg)
            if any(
                field.name == name or (name.endswith("_") and field.name.startswith(name))
                for name in self.unused_settings
            )
            if getattr(self.cfg, field.name) != field.default
        ]
        return f"note: --objective={self.cfg.objective} does not use {', '.join(unused)}" if unused else None

    def step_size(self, rows: int, block_size: int) -> str:
        """What one optimizer step processes, in the objective's own unit; `rows`: batch_size x micro-batches."""
        raise NotImplementedError

    def open_data(self) -> TrainingData:
        """Open what the objective reads (before the model is made: the data's tokenizer decides its vocabulary)."""
        raise NotImplementedError

    def start(
        self,
        *,
        model: GPT,
        reference: Reference | None,
        resumed: dict | None,
        device: torch.device,
        procs: Processes,
        precision: contextlib.AbstractContextManager,
        lora: dict | None = None,
    ) -> None:
        """Ready to train `model` (unwrapped): the sampler and evaluation batches. `reference` is the frozen starting
        model (when needs_reference), `resumed` the checkpoint a resumed run continues, `precision` the autocast
        context the objective's forward passes run in, `lora` a LoRA run's record (lora.lora_record: its base)."""
        self.device, self.procs, self.precision = device, procs, precision
        self.accumulation = self.cfg.gradient_accumulation_steps // procs.world_size  # micro-batches per process
        self.block_size = model.config.block_size

    def prepare_step(self, step: range, mine: range) -> None:
        """Before a step: `step` is its global micro-batches, `mine` this process's share of them."""
        self.mine, self.following = mine, mine.start + len(step)

    def batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's micro-batch number `micro` of the step, (x, y) on the device. The next one it will ask
        for (the following micro-batch, or the first of its share of the next step) is read meanwhile."""
        upcoming = self.mine[micro + 1] if micro + 1 < len(self.mine) else self.following
        return self.prefetcher.get(self.mine[micro], upcoming)

    def micro_loss(
        self, wrapped: torch.nn.Module, micro: int, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, addition to the logged loss sum) of micro-batch `micro`; the logged sums of a
        step's micro-batches add up to their number times the step's loss."""
        raise NotImplementedError

    def log_entries(self) -> dict[str, float]:
        """The objective's own figures for a training line, since the last one (a collective call)."""
        return {}

    def evaluate(self, wrapped: torch.nn.Module, stop: StopRequest | None = None) -> dict[str, Any] | None:
        """An evaluation's figures: train/loss, val/loss and val/bpb (None where not measured) and the objective's
        own; None when `stop` was requested meanwhile (a single process stops within an evaluation)."""
        raise NotImplementedError

    def whole_split(self, wrapped: torch.nn.Module) -> tuple[float, int, float | None]:
        """(loss, tokens, bits per byte) of the whole val split, every target once: --eval_full_split, which only
        the next-token objective takes."""
        raise NotImplementedError

    def checkpoint_entries(self) -> dict[str, Any]:
        """What the objective adds to a checkpoint, besides its sampler's position."""
        return {}

    def close(self) -> None:
        """Stop reading ahead."""
        if self.prefetcher is not None:
            self.prefetcher.close()


# ----------------------------------------------------------------------------- lm


class Lm(Objective):
    """The next-token loss on text (random windows) or chat data (packed conversations, the assistant's tokens
    trained): a text micro-batch's loss is its mean; a chat step's is the summed loss of its trained targets over
    their number in the whole step (gptkit.train.batches)."""

    def step_size(self, rows: int, block_size: int) -> str:
        return f"{rows * block_size:,} tokens per step"

    @property
    def kind(self) -> str:
        return "chat" if is_chat_data(self.data.meta) else "lm"

    def open_data(self) -> TrainingData:
        directory = token_data_dir(self.cfg)
        meta = read_meta(directory)
        if is_preference_data(meta):  # as chat data, both replies of every pair would train
            raise UserError(
                f"{directory} holds preference pairs, which the next-token loss would train the rejected replies on "
                "too; give --objective=dpo, or chat data (prepare_data/chat.py)"
            )
        self.data = TrainingData(directory=directory, meta=meta, splits=batches.open_splits(directory, meta))
        return self.data

    def start(self, **run: Any) -> None:
        super().start(**run)
        cfg, splits = self.cfg, self.data.splits
        batches.check_splits_fit(splits, self.block_size, self.data.directory)
        self.sampler = batches.make_sampler(
            splits["train"], cfg.batch_size, self.block_size, cfg.seed, loader.PURPOSE_TRAIN
        )
        # The same eval_iters batches of each split at every evaluation.
        purposes = {"train": loader.PURPOSE_EVAL_TRAIN, "val": loader.PURPOSE_EVAL_VAL}
        self.eval_sets = {
            split: loader.FixedBatches(
                batches.make_sampler(splits[split], cfg.batch_size, self.block_size, cfg.seed, purpose),
                cfg.eval_iters,
            )
            for split, purpose in purposes.items()
        }
        self.prefetcher = loader.BatchPrefetcher(self.sampler, self.device)

    def prepare_step(self, step: range, mine: range) -> None:
        super().prepare_step(step, mine)
        self.step_targets = batches.step_target_count(self.sampler, step.start, len(step))  # chat data

    def micro_loss(self, wrapped, micro, x, y):
        return batches.micro_batch_loss(
            wrapped,
            x,
            y,
            self.precision,
            step_targets=self.step_targets,
            micro_batches=self.cfg.gradient_accumulation_steps,
            world_size=self.procs.world_size,
        )

    def evaluate(self, wrapped, stop=None):
        """The mean loss on each split's evaluation batches, and val bits per byte (text only)."""
        losses = {}
        for split, fixed in self.eval_sets.items():
            losses[split] = loop.mean_loss(wrapped, fixed, self.precision, self.device, self.procs, stop)
            if losses[split] is None:
                return None
        val_bpb = batches.bits_per_byte(losses["val"], self.data.splits["val"], self.data.meta["splits"]["val"])
        return {"train/loss": losses["train"], "val/loss": losses["val"], "val/bpb": val_bpb}

    def whole_split(self, wrapped):
        """Text: non-overlapping windows; chat data: every conversation once."""
        val = self.data.splits["val"]
        windows, tokens = batches.whole_split(val, self.block_size, self.cfg.batch_size)
        loss = loop.mean_loss(wrapped, windows, self.precision, self.device, self.procs)
        return loss, tokens, batches.bits_per_byte(loss, val, self.data.meta["splits"]["val"])


# ----------------------------------------------------------------------------- post-training: dpo and grpo


class PostTraining(Objective):
    """DPO and GRPO improve a trained model, and compare with it as it started: checkpoints record where it came
    from, so a resumed run finds the same reference again."""

    def check_settings(self) -> None:
        cfg = self.cfg
        if cfg.init_from == "scratch":
            raise UserError(f"--objective={self.kind} improves a trained model: give --init_from=CHECKPOINT")
        if cfg.parallel == "fsdp" or cfg.ema_decay:
            raise UserError(f"--objective={self.kind} takes neither --parallel=fsdp nor --ema_decay")
        if cfg.eval_full_split:
            raise UserError(
                f"--objective={self.kind} has no whole-split loss; --eval_full_split is for next-token runs"
            )

    def start(self, *, reference: Reference | None, resumed: dict | None, lora: dict | None = None, **run: Any) -> None:
        super().start(reference=reference, resumed=resumed, lora=lora, **run)
        self.reference = reference
        # Where the starting model is, with its weights' digest: a resume compares with it as it was (models.
        # frozen_reference checks the digest), not with a model since trained further at the same path. A LoRA
        # run's base is that model, its digest taken already (hashing gigabytes twice at the start is no use).
        if resumed:
            self.reference_record = resumed.get("reference")
        else:
            self.reference_record = lora["base"] if lora else base_reference(self.cfg.init_from)

    def checkpoint_entries(self) -> dict[str, Any]:
        return {"reference": self.reference_record}


class Dpo(PostTraining):
    """The DPO objective over pair batches (x, y: chosen rows, then rejected rows)."""

    kind = "dpo"
    needs_reference = True
    unused_settings = ("grpo_",)

    def step_size(self, rows: int, block_size: int) -> str:
        return f"{rows:,} preference pairs per step (two rows of up to {block_size:,} tokens each)"

    def open_data(self) -> TrainingData:
        directory = token_data_dir(self.cfg)
        if not (Path(directory) / META_FILENAME).is_file():  # read_meta's hint names the pretraining scripts
            raise UserError(
                f"--objective=dpo trains on preference pairs and {directory} holds none (no meta.json): give "
                "--data_dir=DIR written by prepare_data/preferences.py"
            )
        meta = read_meta(directory)
        splits = {split: open_pairs(directory, split, meta) for split in ("train", "val")}
        self.data = TrainingData(directory=directory, meta=meta, splits=splits)
        return self.data

    def start(self, **run: Any) -> None:
        super().start(**run)
        cfg, splits = self.cfg, self.data.splits
        self.sampler = PairBatches(splits["train"], cfg.batch_size, self.block_size, cfg.seed, loader.PURPOSE_TRAIN)
        # Every pair once, up to eval_iters batches of each split.
        self.eval_sets = {
            split: PairEpoch(splits[split], cfg.batch_size, self.block_size, cfg.eval_iters) for split in splits
        }
        self.prefetcher = loader.BatchPrefetcher(self.sampler, self.device)
        self.sums = [0.0] * 6

    def micro_loss(self, wrapped, micro, x, y):
        """The mean loss over the micro-batch's pairs, over this process's micro-batches (DDP averages the
        processes); logged: the micro-batch's mean."""
        with self.precision:
            scores = dpo.pair_batch_scores(wrapped, self.reference, x, y, self.cfg.dpo_beta)
            self.sums = [a + b for a, b in zip(self.sums, dpo.totals(scores))]
            loss = scores.losses.mean()
            return loss / self.accumulation, loss.detach().float()

    def log_entries(self) -> dict[str, float]:
        sums, self.sums = reduce_numbers(self.sums, self.device, self.procs), [0.0] * 6
        entries = dpo.means(sums, "train")
        del entries["train/loss"]  # the line's loss already
        return entries

    def evaluate(self, wrapped, stop=None):
        """Loss, margin, accuracy and rewards on each split's pairs (a DPO val/loss: best.pt is the best of it)."""
        entry = dict(NO_LOSS)
        for split, pairs in self.eval_sets.items():
            entry.update(
                dpo.evaluate_pairs(
                    wrapped, self.reference, pairs, self.cfg.dpo_beta, self.precision, self.device, self.procs, split
                )
            )
        return entry


@dataclass(frozen=True, kw_only=True)
class GrpoPlan:
    """GRPO's fixed parts: the prompts, how rollouts are sampled (the engine, handed in by train.py) and scored."""

    prompts: list[Prompt]
    eval_prompts: list[Prompt]
    sample: grpo.SampleGroups  # rollouts: temperature sampling
    sample_greedy: grpo.SampleGroups  # held-out pass@1
    reward: Reward
    tokenizer: Any
    group_size: int
    kl_beta: float
    seed: int


class Grpo(PostTraining):
    """The GRPO objective: a step's rollouts are sampled first (prepare_step), then its micro-batches are trained.
    Its data are prompts, in the starting model's tokenizer; its sampler says which prompts each micro-batch takes."""

    kind = "grpo"
    unused_settings = ("dpo_", "data_dir", "dataset")

    def __init__(self, settings: ObjectiveSettings, sample_groups: Callable[..., list[list[int]]] | None) -> None:
        super().__init__(settings)
        self.sample_groups = sample_groups
        self.step: list[grpo.Rollouts] = []
        self.step_tokens = 1
        self.sums = [0.0] * 5  # reward sum, passing, completions, completion tokens, kl sum

    @property
    def needs_reference(self) -> bool:
        return self.cfg.grpo_kl_beta > 0

    def check_settings(self) -> None:
        cfg = self.cfg
        if cfg.grpo_group_size < 2:
            raise UserError(
                f"--grpo_group_size={cfg.grpo_group_size}: a group of 1 has no advantage (each completion is "
                "compared with its group); use 2 or more"
            )
        if not cfg.grpo_prompts:
            raise UserError("--objective=grpo needs --grpo_prompts=FILE (JSONL with 'prompt' and e.g. 'answer')")
        super().check_settings()
        if cfg.eval_only:
            raise UserError("--objective=grpo has no loss to evaluate; measure pass@k with eval.py --prompts=FILE")

    def step_size(self, rows: int, block_size: int) -> str:
        return (
            f"{rows:,} prompts x {self.cfg.grpo_group_size} completions per step "
            f"(up to {self.cfg.grpo_max_new_tokens:,} new tokens each)"
        )

    def open_data(self) -> TrainingData:
        self.data = TrainingData(directory=Path(self.cfg.grpo_prompts), meta=starting_model_meta(self.cfg), splits={})
        return self.data

    def start(self, *, model: GPT, **run: Any) -> None:
        """The prompts and the engines that sample from `model` (one eager engine per micro-batch, over the
        unwrapped model; the loop's compiled or DDP wrapper is for the loss)."""
        super().start(model=model, **run)
        cfg, meta = self.cfg, self.data.meta
        tokenizer = tokenizer_from_meta(ckpt.tokenizer_record(meta))
        stops = tuple(tokenizer.chat.reply_stops) if getattr(tokenizer, "chat", None) else (meta["eot_token"],)
        settings = {"max_new_tokens": cfg.grpo_max_new_tokens, "stop_tokens": stops}
        self.plan = GrpoPlan(
            prompts=load_prompts(cfg.grpo_prompts, tokenizer, context=model.config.block_size),
            eval_prompts=(
                load_prompts(cfg.grpo_eval_prompts, tokenizer, context=model.config.block_size)
                if cfg.grpo_eval_prompts
                else []
            ),
            sample=functools.partial(self.sample_groups, model, temperature=cfg.grpo_temperature, **settings),
            sample_greedy=functools.partial(self.sample_groups, model, temperature=0.0, **settings),
            reward=reward_named(cfg.grpo_reward),
            tokenizer=tokenizer,
            group_size=cfg.grpo_group_size,
            kl_beta=cfg.grpo_kl_beta,
            seed=cfg.seed,
        )
        self.plan.reward.check_answers([*self.plan.prompts, *self.plan.eval_prompts], setting="--grpo_reward")
        self.sampler = grpo.PromptOrder(len(self.plan.prompts), cfg.batch_size, cfg.seed)

    def prepare_step(self, step: range, mine: range) -> None:
        """Sample and score the rollouts of this process's micro-batches (their global indices seed them), with the
        model as it is now, and count the step's completion tokens over every process (a collective call)."""
        plan = self.plan
        with self.precision:
            self.step = []
            for index in mine:
                prompts = [plan.prompts[i] for i in self.sampler.indices(index)]
                seed = plan.seed * 1_000_003 + index
                rollouts = grpo.rollouts(prompts, plan.sample, plan.group_size, seed, plan.reward, plan.tokenizer)
                self.step.append(rollouts)
            tokens = sum(r.completion_tokens for r in self.step)
            self.step_tokens = max(1, int(reduce_numbers([float(tokens)], self.device, self.procs)[0]))
        for r in self.step:
            self.sums[0] += sum(r.rewards)
            self.sums[1] += sum(value > 0 for value in r.rewards)
            self.sums[2] += len(r.rewards)
            self.sums[3] += r.completion_tokens

    def batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        rollout = self.step[micro]
        return rollout.x.to(self.device), rollout.y.to(self.device)

    def micro_loss(self, wrapped, micro, x, y):
        """Summed over the completion tokens, divided by the step's count over every process (times the
        processes, whose gradients are averaged)."""
        world_size = self.procs.world_size
        with self.precision:
            advantages = self.step[micro].advantages.to(x.device)
            scored = y >= 0
            logprobs = token_logprobs(wrapped, x, y).float()
            reference = None
            if self.reference is not None and self.plan.kl_beta > 0:
                reference = self.reference.token_logprobs(x, y)
            losses, kl = grpo.token_losses(logprobs, advantages, scored, reference, self.plan.kl_beta)
            self.sums[4] += float(kl.sum())
            total = losses.sum()
            logged = total.detach() * (self.accumulation * world_size / self.step_tokens)
            return total * (world_size / self.step_tokens), logged

    def log_entries(self) -> dict[str, float]:
        rewards, passing, completions, tokens, kl = reduce_numbers(self.sums, self.device, self.procs)
        self.sums = [0.0] * 5
        completions = max(completions, 1.0)
        entries = {
            "train/reward": rewards / completions,
            "train/pass": passing / completions,
            "train/completion_tokens": tokens / completions,
        }
        if self.reference is not None and self.plan.kl_beta > 0:
            entries["train/kl"] = kl / max(tokens, 1.0)
        return entries

    def evaluate(self, wrapped, stop=None):
        """Greedy pass@1 and mean reward on the held-out prompts (each process computes it whole: no collective);
        no loss."""
        if not self.plan.eval_prompts:
            return dict(NO_LOSS)
        plan = self.plan
        with self.precision:
            result = grpo.pass_rate(plan.eval_prompts, plan.sample_greedy, plan.reward, plan.tokenizer, plan.seed)
        return {**NO_LOSS, "val/pass@1": result["pass@1"], "val/reward": result["reward"]}


def starting_model_meta(cfg: ObjectiveSettings) -> dict:
    """GRPO's stand-in for a data directory's meta.json: the tokenizer the starting (or resumed) checkpoint records,
    or open weights' own (a GGUF file's, a Hugging Face directory's)."""
    if cfg.init_from != "resume" and not ckpt.is_checkpoint_source(cfg.init_from):
        return open_weights_meta(cfg.init_from)
    path = Path(cfg.out_dir) / ckpt.LATEST_NAME if cfg.init_from == "resume" else ckpt.resolve_checkpoint(cfg.init_from)
    record = ckpt.load_checkpoint(path, required_keys=()).get("tokenizer")
    if not isinstance(record, dict):
        raise UserError(f"{path} records no tokenizer, which --objective=grpo needs to render its prompts")
    tokenizer = {key: value for key, value in record.items() if key not in ("vocab_size", "eot_token")}
    return {"tokenizer": tokenizer, "vocab_size": record["vocab_size"], "eot_token": record.get("eot_token")}
