"""Where a compiled decoding step's time goes, kernel by kernel, against the memory's read speed in the same run.

    python benchmarks/bench_step.py [--dtype=float32|bfloat16|int8 --tokens=64 --json_out=bench_results/step.json]

The step is the one `sample.py --decode=compiled` runs (gptkit.infer.compiled, driven by the engine with top-k
sampling) on a GPT-2 124M-shaped model with random weights, one row. Inductor's kernel profiling puts a profiler
record in each C++ kernel it generates, and a matrix product's kernel is named after its shape (gemm_m{rows}n{out}
k{in}), so torch.profiler splits a token's time into:
- each product shape: calls and milliseconds per token, and the GB/s it streams its weights at, also as a fraction
  of the read speed (the best of 5 sums over `bandwidth_mb`, the mean of a measure before and after the tokens);
  with int8 weights inductor fuses the blocks' products into kernels whose names carry no shape: one row for them;
- the graph's other kernels (attention, layer norms, the residual adds that were not fused into a product);
- the graph's wrapper: its C++ code between kernels;
- entering the graph: dynamo's guards and the call into the compiled code;
- outside the graph: building the step's inputs, sampling and the engine's bookkeeping.
A batch-1 step's floor is its weight bytes over the read speed, so these rows say what keeps it from that floor.
The profiler's own cost makes profiled tokens slower: the same tokens' time without the profiler is printed too.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.infer import generate_stream
from gptkit.model import GPT, GPTConfig
from gptkit.weights.quantization import quantize_int8
from measure import print_table, read_bandwidth, run_benchmark

WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}  # int8: one bfloat16 scale per row besides, not counted
PRODUCT_KERNEL = re.compile(r"gemm_m(\d+)n(\d+)k(\d+)")  # inductor's name for the kernel of a (rows x in) @ (in x out)
INT8_KERNEL = "_weight_int8pack_mm"  # in the names of the kernels inductor fuses int8 products into (no shape)
INT8_BLOCKS_PART = "block products (int8 kernels)"  # their row: every block's weights, read once a token
WRAPPER_EVENT = "## Call CompiledFxGraph"  # the graph's C++ entry: kernels and the code between them
REGION_EVENT = "Torch-Compiled Region"  # dynamo's frame: guards, then the graph
GUARDS_EVENT = "TorchDynamo Cache Lookup"  # recorded outside the region's record


@dataclass(kw_only=True)
class StepBench:
    dtype: str = setting("float32", "weights of the step", choices=tuple(WEIGHT_BYTES))
    tokens: int = setting(64, "tokens decoded under the profiler (and again without it)", rule="positive")
    top_k: int = setting(200, "top-k of the sampling (sample.py's default)", rule="positive")
    n_layer: int = setting(12, "model shape: layers (GPT-2 124M: 12)", rule="positive")
    n_head: int = setting(12, "model shape: heads (12)", rule="positive")
    n_embd: int = setting(768, "model shape: width (768)", rule="positive")
    vocab_size: int = setting(50257, "model shape: vocabulary (50257)", rule="positive")
    bandwidth_mb: int = setting(
        1024, "megabytes read to measure the memory read speed (0 = skip it)", rule="non_negative"
    )
    json_out: str = setting("bench_results/step.json", "where to write the JSON results ('' = nowhere)")


def step_model(cfg: StepBench) -> tuple[GPT, int]:
    """A random model of the asked shape and weights, for inference, and the bytes of the weights a token reads."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size)
    model = GPT(config).eval()
    weight_bytes = model.get_num_params(non_embedding=True) * WEIGHT_BYTES[cfg.dtype]  # counted before int8 buffers
    return (quantize_int8(model) if cfg.dtype == "int8" else model.to(getattr(torch, cfg.dtype))), weight_bytes


def decode(model: GPT, tokens: int, top_k: int) -> float:
    """Seconds to decode `tokens` tokens after a one-token prompt (no prefill pass), as sample.py --decode=compiled does."""
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in generate_stream(
            model, torch.zeros(1, 1, dtype=torch.long), tokens, top_k=top_k, generator=generator, decode="compiled"
        ):
            pass
    return time.perf_counter() - start


def profiled_events(model: GPT, cfg: StepBench) -> tuple[dict[str, tuple[int, float, float]], float, float]:
    """{event: (calls, self ms, total ms)} of `cfg.tokens` profiled tokens, their seconds, and the same tokens'
    seconds without the profiler. The graph compiles here, with a profiler record in every kernel."""
    torch._dynamo.reset()  # a graph compiled earlier in this process would have no kernel records
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        decode(model, 2, cfg.top_k)  # compiles
    unprofiled = decode(model, cfg.tokens, cfg.top_k)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = decode(model, cfg.tokens, cfg.top_k)
    events = {
        event.key: (event.count, event.self_cpu_time_total / 1e3, event.cpu_time_total / 1e3)
        for event in prof.key_averages()
    }
    return events, profiled, unprofiled


def event_total(events: dict[str, tuple[int, float, float]], prefix: str) -> float:
    """Total ms of the events named `prefix`...; UserError when there are none (the names are torch's own)."""
    found = [total for key, (_, _, total) in events.items() if key.startswith(prefix)]
    if not found:
        raise UserError(
            f"torch.profiler recorded no {prefix!r} event; this benchmark reads the event names of "
            f"torch 2.13, and this is torch {torch.__version__}"
        )
    return sum(found)


def step_rows(
    events: dict[str, tuple[int, float, float]], profiled_s: float, cfg: StepBench, read_speed: float | None
) -> list[dict]:
    """One row per product shape, then the rest of the step, each per token; see the module's docstring."""
    per_token = 1 / cfg.tokens
    products: dict[str, list] = {}  # part: [weights (out x in) per call, calls, self ms]
    kernels_ms = other_kernels_ms = 0.0
    for key, (calls, self_ms, _) in events.items():
        if not key.startswith("graph_"):  # the generated kernels' records
            continue
        kernels_ms += self_ms
        shape = PRODUCT_KERNEL.search(key)
        if shape is not None:
            part, weights = f"product {shape[3]}x{shape[2]}", int(shape[2]) * int(shape[3])
        elif INT8_KERNEL in key:  # int8 block products fused with their neighbours: one row for all of them
            part, weights = INT8_BLOCKS_PART, 12 * cfg.n_embd**2 * cfg.n_layer  # per token
        else:
            other_kernels_ms += self_ms
            continue
        entry = products.setdefault(part, [weights, 0, 0.0])
        entry[1], entry[2] = entry[1] + calls, entry[2] + self_ms
    rows = []
    for part, (weights, calls, ms) in sorted(products.items()):
        times = 1 if part == INT8_BLOCKS_PART else calls * per_token  # a product row's weights are per call
        weight_bytes, ms_per_token = weights * WEIGHT_BYTES[cfg.dtype] * times, ms * per_token
        row = {
            "part": part,
            "calls": round(calls * per_token, 2),
            "ms": round(ms_per_token, 3),
            "gb_s": round(weight_bytes / ms_per_token / 1e6, 1),
        }
        if read_speed:
            row["of_read_speed"] = round(weight_bytes / ms_per_token / 1e6 / (read_speed / 1e9), 3)
        rows.append(row)
    wrapper_ms, region_ms = event_total(events, WRAPPER_EVENT), event_total(events, REGION_EVENT)
    guards_ms = event_total(events, GUARDS_EVENT)
    rest = {
        "other kernels (attention, norms)": other_kernels_ms,
        "graph wrapper (between kernels)": wrapper_ms - kernels_ms,
        "entering the graph (guards, call)": region_ms - wrapper_ms + guards_ms,
        "outside the graph (inputs, sampling, engine)": profiled_s * 1e3 - region_ms - guards_ms,
    }
    rows += [{"part": part, "ms": round(ms * per_token, 3)} for part, ms in rest.items()]
    total = profiled_s * 1e3 * per_token
    for row in rows:
        row["share"] = round(row["ms"] / total, 3)
    return rows


def bench_step(cfg: StepBench) -> list[dict]:
    """Where a compiled decoding step's time goes, kernel by kernel (see the module's docstring)."""
    model, weight_bytes = step_model(cfg)
    before = read_bandwidth(torch.device("cpu"), cfg.bandwidth_mb) if cfg.bandwidth_mb else None
    events, profiled_s, unprofiled_s = profiled_events(model, cfg)
    after = read_bandwidth(torch.device("cpu"), cfg.bandwidth_mb) if cfg.bandwidth_mb else None
    read_speed = statistics.mean([before, after]) if before and after else None
    rows = step_rows(events, profiled_s, cfg, read_speed)
    summary = {"part": "whole token (profiled)", "ms": round(profiled_s * 1e3 / cfg.tokens, 3), "share": 1.0}
    unprofiled = {"part": "whole token (not profiled)", "ms": round(unprofiled_s * 1e3 / cfg.tokens, 3)}
    if read_speed:
        print(
            f"memory read speed: {read_speed / 1e9:.3f} GB/s (mean of {before / 1e9:.1f} before the tokens and "
            f"{after / 1e9:.1f} after; each the best of 5 sums of {cfg.bandwidth_mb} MB)"
        )
        for row in (summary, unprofiled):  # tokens/s over the floor: weight bytes over the read speed
            row["of_bound"] = round(weight_bytes / read_speed / (row["ms"] / 1e3), 3)
    rows += [summary, unprofiled]
    print_table(rows, ["part", "calls", "ms", "share", "gb_s", "of_read_speed", "of_bound"])
    return rows


def main(argv: list[str]) -> int:
    cfg = parse_settings(StepBench, argv, prog="bench_step.py", description=bench_step.__doc__ or "")
    return run_benchmark(cfg, bench_step, "step")


if __name__ == "__main__":
    run_cli(main)
