"""Evaluate a model on tasks beyond the loss: HellaSwag as build-nanogpt scores it, and any lm-evaluation-harness task.

python eval.py --out_dir=out-shakespeare-char --tasks=hellaswag --limit=500
python eval.py --init_from=gpt2 --tasks=hellaswag --json_out=hellaswag.json
python eval.py --out_dir=out --tasks= --harness_tasks=lambada_openai,arc_easy
python eval.py --out_dir=out --tasks= --harness_tasks=my_task --harness_include=my_tasks/   # local task YAMLs
python eval.py --out_dir=out-rl --tasks= --prompts=held_out.jsonl --reward=number --samples=8 --temperature=1 --pass_k=1,8

The last line on stdout is the summary of every task; --json_out writes {"hellaswag": {"acc", "acc_norm", "n"}, ...}
(harness tasks as "lm_eval/<task>": {metric: value}; a prompt file as "generative": {"pass@k", "reward", "n"}).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptkit.core.devices import Runtime, autocast
from gptkit.core.errors import UserError, run_cli
from gptkit.core.fileio import check_writable_parent
from gptkit.core.settings import parse_settings, setting
from gptkit.data.tokenizer import Tokenizer
from gptkit.eval import hellaswag
from gptkit.infer.decoding import Decoding
from gptkit.infer.next_token import sampling_problem
from gptkit.model import GPT
from gptkit.weights import load
from gptkit.weights.source_settings import ModelSource, for_inference, keeps_int4_in_file

SUMMARY_FIGURES = ("acc", "acc_norm", "perplexity", "word_perplexity", "exact_match")  # shown in the summary line


@dataclass(kw_only=True)
class EvaluateSettings(ModelSource, Decoding, Runtime):
    tasks: str = setting(
        "hellaswag", f"comma-separated tasks of our own scorer ({', '.join(hellaswag.TASKS)}); empty for none"
    )
    limit: int | None = setting(None, "evaluate only the first N items of each task (None: all)", rule="positive")
    hellaswag_path: str = hellaswag.path_setting()
    harness_tasks: str = setting("", "comma-separated lm-evaluation-harness tasks (needs: pip install lm-eval)")
    harness_include: str = setting("", "a directory of extra lm-eval task YAML files (local task definitions)")
    json_out: str = setting("", "write the results to this JSON file (a new one: see --overwrite)")
    overwrite: bool = setting(False, "replace the --json_out file of an earlier evaluation")
    batch_size: int = setting(16, "items (harness: requests) per forward pass", rule="positive")
    # generative tasks with verifiable answers (gptkit.eval.generative)
    prompts: str = setting("", "a JSONL file of prompts ('prompt' and the fields the reward reads) to complete")
    reward: str = setting(
        "number", "prompts: how a completion is scored: exact | number | regex:PATTERN | module:function"
    )
    samples: int = setting(1, "prompts: completions per prompt (n of pass@k)", rule="positive")
    pass_k: str = setting("1", "prompts: comma-separated k of pass@k (each at most --samples)")
    max_new_tokens: int = setting(64, "prompts: the longest completion, in tokens", rule="positive")
    temperature: float = setting(0.0, "prompts: sampling temperature (0 = greedy)", rule="non_negative")

    def pass_ks(self) -> list[int]:
        """The k of pass@k, checked against --samples."""
        try:
            ks = [int(k) for k in self.pass_k.split(",") if k.strip()]
        except ValueError:
            raise UserError(f"--pass_k must list whole numbers, got {self.pass_k!r}") from None
        if not ks or any(not 1 <= k <= self.samples for k in ks):
            raise UserError(f"--pass_k={self.pass_k}: each k must be between 1 and --samples ({self.samples})")
        return ks

    def validate(self) -> None:
        super().validate()
        if not hellaswag.parse_tasks(self.tasks) and not self.harness_tasks.strip() and not self.prompts:
            raise UserError("nothing to evaluate: give --tasks=hellaswag, --harness_tasks=... and/or --prompts=FILE")
        if self.prompts:
            self.pass_ks()
            problem = sampling_problem(self.temperature, None, None)
            if problem is not None:
                raise UserError(f"--{problem}")
            if self.samples > 1 and self.temperature == 0:
                raise UserError(
                    "--samples above 1 with --temperature=0 repeats one greedy completion; sample with a temperature"
                )
        if self.harness_include and not self.harness_tasks:
            raise UserError("--harness_include needs --harness_tasks naming the tasks to run")
        if self.json_out and Path(self.json_out).is_dir():
            raise UserError(f"--json_out={self.json_out} is a directory; name a file")
        if self.json_out:
            check_writable_parent(Path(self.json_out), "--json_out")
        for name, given in (("prompts", self.prompts), ("hellaswag_path", self.hellaswag_path)):
            if self.json_out and given and Path(self.json_out).resolve() == Path(given).resolve():
                raise UserError(f"--json_out={self.json_out} is the --{name} file; name another file for the results")
        if self.json_out and Path(self.json_out).exists() and not self.overwrite:  # checked before the evaluation
            raise UserError(
                f"--json_out={self.json_out} exists (an earlier evaluation's); pass --overwrite=True to replace it, or "
                "name another file"
            )


def run_own_tasks(
    model: GPT, tokenizer: Tokenizer, cfg: EvaluateSettings, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """Our scorer's tasks, with a progress bar on stderr (drawn on a terminal only)."""
    from tqdm import tqdm

    results = {}
    for task, items in hellaswag.load_task_items(
        hellaswag.parse_tasks(cfg.tasks), cfg.hellaswag_path, cfg.limit
    ).items():
        with tqdm(total=len(items), desc=task, unit="item", file=sys.stderr, disable=None, leave=False) as bar:
            precision = autocast(device, dtype)
            results.update(
                hellaswag.evaluate_tasks(
                    model, tokenizer, {task: items}, device, cfg.batch_size, precision=precision, on_batch=bar.update
                )
            )
        if results[task]["n"] == 0:
            raise UserError(
                f"the tokenizer could encode none of the {len(items)} {task} items (a character vocabulary without "
                "their characters?); use a model with a byte-level tokenizer"
            )
    return results


def run_harness_tasks(
    model: GPT, tokenizer: Tokenizer, cfg: EvaluateSettings, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """The lm-evaluation-harness tasks, as {"lm_eval/<task>": {metric: value, "n": items}}."""
    try:
        from gptkit.eval import harness
    except ImportError as exc:
        raise UserError(f"--harness_tasks: {exc}") from None
    tasks = [name.strip() for name in cfg.harness_tasks.split(",") if name.strip()]
    lm = harness.GPTKitLM(model, tokenizer, device, dtype, batch_size=cfg.batch_size, decode=cfg.decode)
    try:
        output = harness.simple_evaluate(
            lm, tasks, cfg.harness_include or None, cfg.limit, random_seed=cfg.seed, log_samples=False
        )
    except (KeyError, ValueError, OSError) as exc:  # an unknown task, or one whose data it cannot load (offline too)
        raise UserError(f"lm-eval could not run {', '.join(tasks)}: {str(exc).strip() or type(exc).__name__}") from None
    results = {}
    for task, metrics in (output or {}).get("results", {}).items():
        figures = {key.split(",")[0]: value for key, value in metrics.items() if isinstance(value, (int, float))}
        samples = output.get("n-samples", {}).get(task, {})
        results[f"lm_eval/{task}"] = {**figures, "n": samples.get("effective", samples.get("original"))}
    return results


def run_generative(
    model: GPT, tokenizer: Tokenizer, cfg: EvaluateSettings, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """The prompt file's pass@k, every completion made by one batched engine."""
    from gptkit.data.prompts import load_prompts
    from gptkit.data.rewards import reward_named
    from gptkit.eval.generative import evaluate_generative

    reward = reward_named(cfg.reward)
    prompts = load_prompts(cfg.prompts, tokenizer, context=model.config.block_size)[: cfg.limit]
    reward.check_answers(prompts)
    with autocast(device, dtype):
        result = evaluate_generative(
            model,
            tokenizer,
            prompts,
            reward,
            samples=cfg.samples,
            ks=cfg.pass_ks(),
            seed=cfg.seed,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            slots=cfg.batch_size * cfg.samples,
            decode=cfg.decode,
        )
    return {"generative": result}


def summary(results: dict[str, Any]) -> str:
    """The last line on stdout: each task's main figures."""
    parts = []
    for task, figures in results.items():
        shown = [
            f"{key} {value:.4f}"
            for key, value in figures.items()
            if (key in SUMMARY_FIGURES or key.startswith("pass@")) and value is not None
        ]
        parts.append(f"{task} {' '.join(shown)} (n={figures.get('n')})")
    return "summary: " + " | ".join(parts)


def main(argv: list[str]) -> int:
    cfg = parse_settings(EvaluateSettings, argv, prog="eval.py", description=__doc__.splitlines()[0])
    torch.manual_seed(cfg.seed)
    device, dtype = cfg.resolve()
    keep_int4 = keeps_int4_in_file(cfg, device, cfg.decode)
    loaded = load(cfg.source(), checkpoint=cfg.checkpoint, data_dir=cfg.data_dir, merge=False, keep_int4=keep_int4)
    model, tokenizer = for_inference(loaded.model, cfg, device, dtype), loaded.tokenizer
    results = run_own_tasks(model, tokenizer, cfg, device, dtype)
    for task, result in results.items():
        print(hellaswag.summary_line({task: result}), flush=True)
    if cfg.harness_tasks.strip():
        results.update(run_harness_tasks(model, tokenizer, cfg, device, dtype))
    if cfg.prompts:
        results.update(run_generative(model, tokenizer, cfg, device, dtype))
    if cfg.json_out:
        hellaswag.write_json(cfg.json_out, results)
    print(summary(results), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
