"""What every benchmark script shares: where it ran (the machine), how it times (the memory read speed, runs taken
round-robin, each set against the read speed around it) and how it reports (a table, a JSON file)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gptkit.core.fileio import atomic_write_json
from gptkit.infer import native

# The model shapes of the GPU benchmarks: GPT-2 124M, and a tiny one that checks a script on any device.
GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
SMOKE_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}
# The model shapes of the CPU sampling benchmarks (random weights), by name.
MODEL_SHAPES = {
    "gpt2-124m": dict(vocab_size=50257),  # GPTConfig's defaults are GPT-2 124M
    # SmolLM2-135M's shape (Llama: 30 layers, 576 wide, 9 heads, 3 kv heads, SwiGLU 1536, tied, vocab 49152)
    "smollm2-135m": dict(
        block_size=2048,
        vocab_size=49152,
        n_layer=30,
        n_head=9,
        n_kv_head=3,
        n_embd=576,
        mlp_hidden=1536,
        activation="swiglu",
        norm="rmsnorm",
        pos_encoding="rope",
        rope_base=100000.0,
        bias=False,
        tie_embeddings=True,
    ),
    # SmolLM2-1.7B's shape (Llama: 24 layers, 2048 wide, 32 heads, 32 kv heads, SwiGLU 8192, tied, vocab 49152)
    "smollm2-1.7b": dict(
        block_size=8192,
        vocab_size=49152,
        n_layer=24,
        n_head=32,
        n_kv_head=32,
        n_embd=2048,
        mlp_hidden=8192,
        activation="swiglu",
        norm="rmsnorm",
        norm_eps=1e-5,
        pos_encoding="rope",
        rope_base=130000.0,
        bias=False,
        tie_embeddings=True,
    ),
    # make demo's recipe's architecture (config/train_shakespeare_char_cpu.py: Qwen3's block, RMSNorm, SwiGLU 2.75x
    # wide, rotary positions, QK-norm without a weight, no biases, tied) at GPT-2 124M's size
    "demo-124m": dict(
        vocab_size=50257,
        pos_encoding="rope",
        norm="rmsnorm",
        activation="swiglu",
        mlp_hidden=2112,
        qk_norm=True,
        bias=False,
    ),
    # a 2-layer, 64-wide model with GPT-2's vocabulary: every path in seconds, to check the script itself
    "tiny": dict(vocab_size=50257, **SMOKE_MODEL),
}


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def machine_description() -> dict:
    """Where a figure was measured: CPU/GPU, core count, torch version, date."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()
    return {
        "device": device,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


# Where a run kept its files on the measuring machine: not what was measured, so a result file leaves them out.
PLACES = ("json_out", "work_dir", "tmp_dir", "nanogpt_dir")


def recorded_settings(settings: object) -> dict:
    """The settings a result file records: every one but the places files were kept."""
    return {key: value for key, value in vars(settings).items() if key not in PLACES}


def write_results(path: str, kind: str, settings: object, rows: list[dict]) -> None:
    if path:
        record = {"benchmark": kind, "settings": recorded_settings(settings), "machine": machine_description()}
        atomic_write_json(path, {**record, "results": rows})
        print(f"wrote {path}")


def run_benchmark(cfg: Any, function: Callable[[Any], list[dict]], kind: str) -> int:
    """A benchmark script's work once its settings are parsed: the machine, the table, the JSON (cfg.json_out)."""
    print(json.dumps(machine_description()))
    write_results(cfg.json_out, kind, cfg, function(cfg))
    return 0


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a timer read after it has seen that work end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, megabytes: int, repeats: int = 5) -> float:
    """Bytes/s the device reads: the best of `repeats` sums over a float32 buffer far larger than the caches.

    On the CPU, where the native step is built, the sum is its stream_sum over a buffer on 2 MB pages: every thread
    (one a core) streams a share with the vector loads and prefetches the step reads its packed weights with (also on
    2 MB pages), so a step's "of the bound" compares it with what the same cores can read. Without the build it is
    PyTorch's sum over its own allocation, which read slower than that on a 2-core VM (docs/benchmarks.md).
    """
    if device.type == "cpu" and native.is_built():
        buffer, add_up = native.huge_page_zeros(megabytes * 2**20 // 4, torch.float32), native.extension().stream_sum
    else:
        buffer, add_up = torch.ones(megabytes * 2**20 // 4, device=device), lambda values: values.sum().item()
    buffer.fill_(1.0)  # touched: every page is in memory before the first timed read
    best = float("inf")
    for attempt in range(repeats + 1):  # the first one warms up
        synchronize(device)
        start = time.perf_counter()
        add_up(buffer)
        synchronize(device)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


TimedRuns = dict[str, list[tuple[float, float | None]]]  # path: [(seconds, read speed around the run or None)]


def time_paths(
    runs: dict[str, tuple[Callable[[int], None], int, int]], read_speed: Callable[[], float] | None = None
) -> TimedRuns:
    """Each path's timed runs, for runs {path: (fn, new_tokens, repeats)}: (seconds of fn(new_tokens), the read speed
    around that run, or None without read_speed). Each fn first runs on a few tokens (allocator, kernels, imports, the
    CPU fast path). Repeats go round-robin over the paths, so load from other work slows every path alike.

    The read speed is measured before a round's first run and after every run, and a run gets the mean of the measures
    just before and just after it: on a shared machine the read speed can jump between two levels within minutes
    (docs/benchmarks.md), so a run set against the median of a whole benchmark's speeds may meet another moment's.
    """
    for fn, _, _ in runs.values():
        fn(8)
    timed: TimedRuns = {path: [] for path in runs}
    for round_ in range(max(repeats for _, _, repeats in runs.values())):
        before = read_speed() if read_speed is not None else None
        for path, (fn, new_tokens, repeats) in runs.items():
            if round_ < repeats:
                start = time.perf_counter()
                fn(new_tokens)
                seconds = time.perf_counter() - start
                after = read_speed() if read_speed is not None else None
                timed[path].append((seconds, (before + after) / 2 if before and after else None))
                before = after
    return timed
