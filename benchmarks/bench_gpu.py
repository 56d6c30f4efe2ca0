"""Every GPU figure in one command: the CUDA tests, then GPT-2 124M training throughput and MFU, then the Shakespeare
char recipe's wall time and whole-split val loss, then sampling speed against Hugging Face `generate`.

    python benchmarks/bench_gpu.py --json_out=docs/results/gpu-h100.json     # on a CUDA GPU
    python benchmarks/bench_gpu.py --device=cpu --smoke=True                 # tiny sizes: checks the benchmark

Training runs through train.py itself (bf16 autocast, torch.compile, flash attention, fused AdamW, batches
prefetched and copied while the previous step computes) on random tokens of GPT-2's vocabulary. MFU is given
against the datasheet peak and against a bf16 matmul peak measured in the same run. Results and commands live in
docs/benchmarks.md §GPU.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench import SampleBench, bench_sample, run_train
from gptkit.core.devices import peak_flops_for_device, resolve_device
from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting, setting_list
from gptkit.data.meta import write_meta
from gptkit.data.tokenizer import GPT2_VOCAB_SIZE, padded_vocab_size
from gptkit.model import GPT, GPTConfig
from measure import GPT2_124M, SMOKE_MODEL, machine_description, print_table, synchronize, write_results

REPO = Path(__file__).resolve().parent.parent


@dataclass(kw_only=True)
class GpuBench:
    device: str = setting("cuda", "device to measure (cpu only makes sense with --smoke=True)")
    smoke: bool = setting(False, "tiny model and few steps: checks the benchmark itself on any device (CI)")
    tests: bool = setting(True, "run tests/test_cuda.py first and record its outcome")
    batch_size: int = setting(16, "sequences per micro-batch for the throughput run", rule="positive")
    accumulation: int = setting(4, "micro-batches per optimizer step for the throughput run", rule="positive")
    train_iters: int = setting(40, "optimizer steps of the throughput run", rule="positive")
    warmup_iters: int = setting(10, "first steps left out of the throughput figure (compilation, allocator)")
    compile: bool = setting(True, "torch.compile the throughput run's model")
    matmul_size: int = setting(8192, "n of the n x n x n bf16 matmul whose speed is the measured peak", rule="positive")
    char_config: str = setting("config/train_shakespeare_char.py", "time-to-quality recipe ('' = skip it)")
    char_extra: list[str] = setting_list([], "extra --key=value flags for the recipe's train.py (repeat the flag)")
    prepare_char: bool = setting(True, "prepare tiny Shakespeare first (prepare_data/shakespeare_char.py)")
    sample: bool = setting(True, "run the sampling comparison (False: training figures only)")
    sample_batches: list[int] = setting_list([1, 8], "batch sizes of the sampling comparison (repeat the flag)")
    sample_tokens: int = setting(256, "tokens generated per sequence in the sampling comparison", rule="positive")
    work_dir: str = setting("bench_results/gpu", "where the benchmark's data and runs go")
    json_out: str = setting("bench_results/gpu.json", "where to write the JSON results ('' = nowhere)")

    def validate(self) -> None:
        if self.warmup_iters >= self.train_iters:
            raise UserError(f"--warmup_iters ({self.warmup_iters}) must be below --train_iters ({self.train_iters})")


def cuda_tests() -> dict:
    """Run tests/test_cuda.py; its exit code and counts (skipped everywhere torch sees no CUDA GPU)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests" / "test_cuda.py")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped|error)", result.stdout)}
    last_line = (result.stdout.strip().splitlines() or [""])[-1]
    print(f"CUDA tests: {last_line}")
    return {"section": "cuda_tests", "exit_code": result.returncode, "summary": last_line.strip("= "), **counts}


def matmul_peak(device: torch.device, size: int, repeats: int = 20) -> float:
    """Measured bf16 matmul FLOP/s: the best of `repeats` timed n x n x n products after a warm-up."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for attempt in range(repeats + 3):  # the first three warm up kernels and clocks
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        if attempt >= 3:
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def random_token_data(directory: Path, tokens: int) -> Path:
    """A data directory of uniformly random GPT-2 token ids: enough for throughput, where content is irrelevant."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split, count in (("train", tokens), ("val", max(tokens // 10, 4096))):
        rng.integers(0, GPT2_VOCAB_SIZE, size=count, dtype=np.uint16).tofile(directory / f"{split}.bin")
        splits[split] = {"files": [f"{split}.bin"], "tokens": count, "text_bytes": 0, "documents": 1}
    write_meta(
        directory,
        {
            "format": "gpt-tokens",
            "version": 1,
            "tokenizer": {"kind": "tiktoken", "encoding": "gpt2"},
            "vocab_size": GPT2_VOCAB_SIZE,
            "dtype": "uint16",
            "eot_token": None,
            "splits": splits,
            "source": {"benchmark": "random tokens"},
        },
    )
    return directory


def training_throughput(cfg: GpuBench, device: torch.device, shape: dict, measured_peak: float) -> dict:
    """train.py on random tokens: median tokens/s after the warm-up steps, and MFU against both peaks."""
    tokens = cfg.batch_size * shape["block_size"] * cfg.accumulation * (cfg.train_iters + 2)
    data_dir = random_token_data(Path(cfg.work_dir) / "random_tokens", tokens)
    settings = {
        **shape,
        "data_dir": data_dir,
        "device": device,
        "dtype": "bfloat16",
        "compile": cfg.compile,
        "attention": "sdpa",
        "bias": True,
        "pad_vocab": True,
        "dropout": 0.0,
        "batch_size": cfg.batch_size,
        "gradient_accumulation_steps": cfg.accumulation,
        "max_iters": cfg.train_iters,
        "eval_interval": 10**9,
        "eval_iters": 1,
        "log_interval": 1,
        "always_save_checkpoint": False,
        "eval_full_split": False,
        "learning_rate": 6e-4,
        "warmup_iters": 0,
        "curves": False,
    }
    out_dir = Path(cfg.work_dir) / "throughput_run"
    seconds, _ = run_train([f"--{key}={value}" for key, value in settings.items()], str(out_dir))
    log = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    speeds = [entry["tokens_per_s"] for entry in log if "tokens_per_s" in entry and entry["iter"] >= cfg.warmup_iters]
    tokens_per_s = statistics.median(speeds)
    vocab = padded_vocab_size(GPT2_VOCAB_SIZE)  # train.py's pad_vocab, as the run above trained
    flops_per_token = GPT(GPTConfig(**shape, vocab_size=vocab, bias=True)).flops_per_token()
    datasheet = peak_flops_for_device(device, torch.bfloat16)
    achieved = tokens_per_s * flops_per_token
    return {
        "section": "train",
        "model": "x".join(str(shape[k]) for k in ("n_layer", "n_embd", "block_size")),
        "batch_size": cfg.batch_size,
        "accumulation": cfg.accumulation,
        "compile": cfg.compile,
        "tokens_per_s": round(tokens_per_s),
        "achieved_tflops": round(achieved / 1e12, 2),
        "mfu_datasheet": round(achieved / datasheet, 4) if datasheet else None,
        "mfu_measured_peak": round(achieved / measured_peak, 4),
        "wall_s": round(seconds, 1),
    }


def time_to_quality(cfg: GpuBench, device: torch.device) -> dict:
    """The char recipe, whole command: wall time and whole-val-split loss (nanoGPT: ~3 min on an A100, 1.4697)."""
    if cfg.prepare_char:
        result = subprocess.run(
            [sys.executable, str(REPO / "prepare_data" / "shakespeare_char.py")],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise UserError(f"prepare_data/shakespeare_char.py failed: {result.stderr.strip()[-300:]}")
    args = [cfg.char_config, f"--device={device}", "--eval_full_split=True", *cfg.char_extra]
    seconds, summary = run_train(args, str(Path(cfg.work_dir) / "char_run"))
    return {
        "section": "shakespeare_char",
        "config": cfg.char_config,
        "extra": " ".join(cfg.char_extra),
        "wall_s": round(seconds, 1),
        "val_loss_full": summary["val_loss_full"],
    }


def sampling(cfg: GpuBench, shape: dict) -> list[dict]:
    """Tokens/s of our generate (float32 and bfloat16) against Hugging Face generate, same weights, same device."""
    sizes = {"repeats": 1, "bandwidth_mb": 64} if cfg.smoke else {"repeats": 3}  # smoke: a 64 MB read speed, not 1 GB
    settings = SampleBench(
        **sizes,
        batch_sizes=cfg.sample_batches,
        new_tokens=cfg.sample_tokens,
        paths=["auto", "eager_bf16", "hf"],
        device=cfg.device,
        json_out="",
    )
    rows = bench_sample(settings, GPTConfig(**shape, vocab_size=GPT2_VOCAB_SIZE, bias=True, dropout=0.0))
    return [{"section": "sample", **row} for row in rows]


def bench_gpu(cfg: GpuBench) -> list[dict]:
    device = resolve_device(cfg.device)
    if device.type != "cuda" and not cfg.smoke:
        raise UserError(f"--device={cfg.device} is not a CUDA GPU; use --smoke=True to check the benchmark elsewhere")
    shape = SMOKE_MODEL if cfg.smoke else GPT2_124M
    rows = [cuda_tests()] if cfg.tests else []
    peak = matmul_peak(device, 256 if cfg.smoke else cfg.matmul_size)
    datasheet = peak_flops_for_device(device, torch.bfloat16)
    rows.append(
        {
            "section": "matmul_peak",
            "dtype": "bfloat16",
            "tflops": round(peak / 1e12, 3),
            "datasheet_tflops": datasheet / 1e12 if datasheet else None,
        }
    )
    rows.append(training_throughput(cfg, device, shape, peak))
    print_table(
        rows[-2:], ["section", "tflops", "datasheet_tflops", "tokens_per_s", "mfu_datasheet", "mfu_measured_peak"]
    )
    if cfg.char_config:
        rows.append(time_to_quality(cfg, device))
        print_table(rows[-1:], ["section", "config", "wall_s", "val_loss_full"])
    if cfg.sample:
        rows += sampling(cfg, shape)
    return rows


def main(argv: list[str]) -> int:
    cfg = parse_settings(GpuBench, argv, prog="bench_gpu.py", description=__doc__ or "")
    print(json.dumps(machine_description()))
    rows = bench_gpu(cfg)
    write_results(cfg.json_out, "gpu", cfg, rows)
    failed = next((row for row in rows if row["section"] == "cuda_tests" and row["exit_code"] not in (0, 5)), None)
    if failed:
        raise UserError(f"the CUDA tests failed ({failed['summary']}); the figures above are in {cfg.json_out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
