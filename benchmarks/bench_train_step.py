"""Where a training step's time goes on a GPU, kernel by kernel: what to look at when MFU is below target.

    python benchmarks/bench_train_step.py                              # GPT-2 124M, block 1024, bf16, compiled
    python benchmarks/bench_train_step.py --device=cpu --smoke=True    # a tiny model: checks the script itself

The step is train.py's on one GPU: forward under bf16 autocast, cross-entropy, backward, fused AdamW, gradients
set to None; the model torch.compiled, attention through SDPA (flash), random tokens of GPT-2's vocabulary (their
content does not change the work). After warm-up steps, `steps` steps are timed without the profiler (the step's
wall time, tokens/s and MFU against the datasheet peak) and then `steps` more under torch.profiler, which gives each
kernel's device time. The table groups the kernels into matrix products, attention, the optimizer, triton's fused
kernels (layer norms, GELU, the residual adds, the loss) and the rest, each as milliseconds a step and as a share
of the step's wall time; "device idle" is the wall time no kernel ran (the host behind the device). The top kernels
follow by name. On the CPU (smoke) the rows are operators' own CPU times instead of kernels.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from gptkit.core.devices import autocast, peak_flops_for_device, resolve_device
from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data.tokenizer import GPT2_VOCAB_SIZE, padded_vocab_size
from gptkit.model import GPT, GPTConfig
from gptkit.train.optim import configure_optimizers
from measure import GPT2_124M, SMOKE_MODEL, print_table, run_benchmark, synchronize

# Kernel name patterns, first match wins: cuBLAS/cuBLASLt/CUTLASS products, flash/efficient attention, the
# optimizer's multi-tensor kernels, then whatever inductor generated (triton_*); on the CPU, aten's operators.
GROUPS = (
    ("matrix products", re.compile(r"gemm|nvjet|cutlass|xmma|matmul|aten::mm|aten::addmm|aten::bmm", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("fused by inductor (norms, GELU, adds, loss)", re.compile(r"^triton_|cpp_fused", re.I)),
)
OTHER = "other kernels (copies, casts, reductions)"


@dataclass(kw_only=True)
class TrainStepBench:
    device: str = setting("cuda", "device to profile (cpu only makes sense with --smoke=True)")
    smoke: bool = setting(False, "a tiny model and batch: checks the script itself on any device (CI)")
    batch_size: int = setting(64, "sequences per step (one micro-batch)", rule="positive")
    dtype: str = setting("bfloat16", "autocast dtype: bfloat16 or float32", choices=("bfloat16", "float32"))
    compile: bool = setting(True, "torch.compile the model, as train.py does by default")
    warmup: int = setting(8, "steps before any timing (compilation, autotuning, the allocator)", rule="positive")
    steps: int = setting(5, "steps timed, then as many profiled", rule="positive")
    top: int = setting(12, "kernels listed by name after the groups", rule="positive")
    json_out: str = setting("bench_results/train_step.json", "where to write the JSON results ('' = nowhere)")


def kernel_group(name: str) -> str:
    """Which group of the table a kernel (or, on the CPU, an operator) belongs to."""
    return next((group for group, pattern in GROUPS if pattern.search(name)), OTHER)


def step_rows(kernels: dict[str, tuple[int, float]], steps: int, step_ms: float) -> list[dict]:
    """The table: {name: (calls, self ms in all profiled steps)} → the groups, device idle, then the top kernels.
    Shares are of the step's wall time (step_ms, measured without the profiler)."""
    per_step = {name: (calls / steps, ms / steps) for name, (calls, ms) in kernels.items()}
    groups: dict[str, list[float]] = {}
    for name, (calls, ms) in per_step.items():
        entry = groups.setdefault(kernel_group(name), [0.0, 0.0])
        entry[0] += calls
        entry[1] += ms
    busy = sum(ms for _, ms in per_step.values())
    rows = [
        {"part": group, "calls": round(calls), "ms": round(ms, 3), "share": round(ms / step_ms, 3)}
        for group, (calls, ms) in sorted(groups.items(), key=lambda item: -item[1][1])
    ]
    idle = max(step_ms - busy, 0.0)
    rows.append({"part": "device idle (no kernel running)", "ms": round(idle, 3), "share": round(idle / step_ms, 3)})
    ranked = sorted(per_step.items(), key=lambda item: -item[1][1])
    return rows + [
        {
            "part": f"  {name[:90]}",
            "group": kernel_group(name),
            "calls": round(calls, 1),
            "ms": round(ms, 3),
            "share": round(ms / step_ms, 3),
        }
        for name, (calls, ms) in ranked
    ]


def profiled_kernels(events: list, device: torch.device) -> dict[str, tuple[int, float]]:
    """{name: (calls, self ms)}: the device's kernels on a GPU; on the CPU, the operators' own CPU times."""
    kernels = {}
    for event in events:
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            microseconds = event.self_device_time_total
        else:
            microseconds = event.self_cpu_time_total
        if microseconds > 0:
            kernels[event.key] = (event.count, microseconds / 1e3)
    if not kernels:
        raise UserError("the profiler recorded no kernel time; is the device busy with another process?")
    return kernels


class TrainStep:
    """train.py's step on random tokens: the model, its optimizer and one fixed batch on the device."""

    def __init__(self, cfg: TrainStepBench, device: torch.device) -> None:
        torch.manual_seed(0)
        shape = SMOKE_MODEL if cfg.smoke else GPT2_124M
        vocab = padded_vocab_size(GPT2_VOCAB_SIZE)  # train.py's pad_vocab
        self.model = GPT(GPTConfig(**shape, vocab_size=vocab, bias=True, dropout=0.0)).to(device)
        self.optimizer = configure_optimizers(self.model, 0.1, 6e-4, (0.9, 0.95), device.type)  # fused on CUDA
        self.wrapped = torch.compile(self.model) if cfg.compile else self.model
        batch_size = 2 if cfg.smoke else cfg.batch_size
        self.x, self.y = torch.randint(0, GPT2_VOCAB_SIZE, (2, batch_size, shape["block_size"]), device=device)
        self.tokens = batch_size * shape["block_size"]
        self.device, self.dtype = device, getattr(torch, cfg.dtype)

    def __call__(self) -> None:
        with autocast(self.device, self.dtype):
            _, loss = self.wrapped(self.x, self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def bench_train_step(cfg: TrainStepBench) -> list[dict]:
    device = resolve_device(cfg.device)
    if device.type != "cuda" and not cfg.smoke:
        raise UserError(f"--device={cfg.device} is not a CUDA GPU; use --smoke=True to check the script elsewhere")
    step = TrainStep(cfg, device)
    for _ in range(cfg.warmup):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(cfg.steps):
        step()
    synchronize(device)
    step_ms = (time.perf_counter() - start) / cfg.steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(cfg.steps):
            step()
        synchronize(device)
    rows = step_rows(profiled_kernels(profiler.key_averages(), device), cfg.steps, step_ms)
    tokens_per_s = step.tokens / (step_ms / 1e3)
    peak = peak_flops_for_device(device, step.dtype)
    mfu = tokens_per_s * step.model.flops_per_token() / peak if peak else None
    print(
        f"step {step_ms:.2f} ms, {tokens_per_s:,.0f} tokens/s, MFU {mfu:.3f} of the datasheet peak"
        if mfu
        else f"step {step_ms:.2f} ms, {tokens_per_s:,.0f} tokens/s (no datasheet peak for this device)"
    )
    summary = {
        "part": "whole step (not profiled)",
        "ms": round(step_ms, 3),
        "share": 1.0,
        "tokens_per_s": round(tokens_per_s),
        "mfu_datasheet": round(mfu, 4) if mfu else None,
    }
    shown = [row for row in rows if not row["part"].startswith("  ")]
    print_table([summary, *shown, *rows[len(shown) : len(shown) + cfg.top]], ["part", "calls", "ms", "share"])
    return [summary, *rows]


def main(argv: list[str]) -> int:
    cfg = parse_settings(TrainStepBench, argv, prog="bench_train_step.py", description=__doc__ or "")
    return run_benchmark(cfg, bench_train_step, "train_step")


if __name__ == "__main__":
    run_cli(main)
