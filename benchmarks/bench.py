"""Benchmarks that print a table and write JSON: sampling speed, training throughput, time to quality.

    python bench.py sample   [--repeats=3 --batch_sizes=1 --batch_sizes=8 --json_out=bench_results/sample.json]
    python bench.py linear   [--batch_sizes=1 --batch_sizes=8]   (weight-streaming GB/s of each decoding kernel)
    python bench.py train    [--config=config/train_shakespeare_char_cpu.py --iters=30]
    python bench.py quality  [--config=config/train_shakespeare_char_cpu.py --runs=3]   (wall time + full val loss)
                             [--nanogpt_dir=DIR]   (nanoGPT's CPU recipe first, as the reference time)
Also bench_step.py, bench_prepare.py, bench_serve.py, bench_tokenizer.py. Results, commands: docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import json
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from gptkit.core.devices import resolve_device
from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting, setting_list
from gptkit.infer import generate, generate_stream
from gptkit.infer.compiled import CPU_COMPILE_OPTIONS
from gptkit.infer.native import NativeStep
from gptkit.infer.onednn import onednn_linear_available, optimize_for_cpu_decoding, use_decoding_layout
from gptkit.model import GPT, GPTConfig
from gptkit.weights.hf import write_hf
from gptkit.weights.quantization import quantize_int4, quantize_int8, replace_linears
from measure import MODEL_SHAPES, print_table, read_bandwidth, run_benchmark, time_paths

# ----------------------------------------------------------------------------------------------- sampling
# auto: the documented call on a fresh model, `gptkit.infer.generate(GPT(config).eval(), ...)`, nothing else: the
# default backend, as sample.py decodes with no flag; eager, eager_bf16: decode="eager" (plain PyTorch, float32 and
# bfloat16 weights); onednn: decode="eager" after an explicit optimize_for_cpu_decoding() (oneDNN at every batch);
# int8: int8 weights (--quantize=int8), eager; compiled, compiled_bf16, int8_compiled: decode="compiled" (float32,
# bfloat16, int8); native, native_bf16, native_int8, native_int4: decode="native" (float32, bfloat16, int8, int4;
# one row or several);
# uncached: nanoGPT's loop;
# no_products: the eager path with every matrix product skipped (each Linear returns zeros of its output's
# shape without reading its weight): a token's time in it is what the rest of a step costs (attention, norms...).
# weights_read, weights_read_bf16: no decoding; per token, one plain sum over every weight matrix a step reads
# (float32, bfloat16): the speed these tensors stream at, the ceiling of a decoding path's of_bound at that moment
# (the bound's read speed comes from one sum over a single buffer of bandwidth_mb, which can read faster: see
# docs/benchmarks.md).
# native_read: no decoding; per token, one plain sum over the buffer the float32 native step packed its matrices
# into, the very memory the native path reads. Where a buffer lies moved its speed on a VM
# (docs/benchmarks.md), so this is the native path's own ceiling at that moment. (No bfloat16 twin: torch's bfloat16
# sum is slower than the native bfloat16 step itself.)
SAMPLE_PATHS = (
    "auto",
    "eager",
    "eager_bf16",
    "onednn",
    "compiled",
    "compiled_bf16",
    "native",
    "native_bf16",
    "native_int8",
    "native_int4",
    "int8",
    "int8_compiled",
    "no_products",
    "weights_read",
    "weights_read_bf16",
    "native_read",
    "uncached",
    "hf",
)
# Bytes per weight a path reads in one decoding step (float32 elsewhere): the memory-speed bound's numerator.
WEIGHT_BYTES = {
    "eager_bf16": 2,
    "compiled_bf16": 2,
    "native_bf16": 2,
    "native_int8": 1,
    "native_int4": 0.625,  # 4-bit codes and a float16 scale and minimum per 32 weights: 20 bytes per 32
    "int8": 1,
    "int8_compiled": 1,
    "weights_read_bf16": 2,
}
NATIVE_PATHS = ("native", "native_bf16", "native_int8", "native_int4")
COMPILED_PATHS = ("compiled", "compiled_bf16", "int8_compiled")
READ_PATHS = ("weights_read", "weights_read_bf16", "native_read")
# The decode argument of every path that passes one (auto passes none: it is the default).
DECODE_OF_PATH = {
    **dict.fromkeys(("eager", "eager_bf16", "onednn", "int8", "no_products"), "eager"),
    **dict.fromkeys(COMPILED_PATHS, "compiled"),
    **dict.fromkeys(NATIVE_PATHS, "native"),
}


@dataclass(kw_only=True)
class SampleBench:
    model: str = setting(
        "gpt2-124m",
        f"the model's shape, random weights: {', '.join(MODEL_SHAPES)} (demo-124m: make demo's architecture at "
        "GPT-2 124M's size; tiny: 2 layers, 64 wide, to check the script itself)",
        choices=tuple(MODEL_SHAPES),
    )
    repeats: int = setting(3, "runs per measurement; the median is reported")
    batch_sizes: list[int] = setting_list([1, 8], "batch sizes to measure (repeat the flag)")
    prompt_tokens: int = setting(16, "prompt length")
    new_tokens: int = setting(256, "tokens generated per sequence")
    top_k: int = setting(200, "top-k sampling, as nanoGPT's sample.py")
    threads: int = setting(0, "torch threads (0 = torch's default)")
    paths: list[str] = setting_list(
        list(SAMPLE_PATHS),
        f"which generators: {', '.join(SAMPLE_PATHS)} (auto: the documented gptkit.infer.generate call, the "
        "default backend; eager: plain PyTorch with the KV cache; compiled: float32, the compiled decoding step; "
        "weights_read: no decoding, a plain sum over the step's weights, the ceiling of of_bound; native_read: the "
        "same over the native step's own packed weights)",
    )
    bandwidth_mb: int = setting(1024, "megabytes read to measure the memory read speed (0 = skip the bound)")
    uncached_new_tokens: int = setting(256, "tokens for the slow uncached path (fewer make it look faster)")
    uncached_repeats: int = setting(1, "runs of the slow uncached path")
    device: str = setting("cpu", "device to run on")
    json_out: str = setting("bench_results/sample.json", "where to write the JSON results ('' = nowhere)")


def run_sample_path(path: str, models: dict, prompt: torch.Tensor, top_k: int, new_tokens: int) -> None:
    """Generate new_tokens for every row of prompt by `path` (see SAMPLE_PATHS), as a user would call it."""
    generator = torch.Generator(device=prompt.device).manual_seed(0)
    with torch.inference_mode():
        if path == "uncached":
            models["plain"].generate(prompt, new_tokens, top_k=top_k, generator=generator)  # as nanoGPT samples
        elif path in DECODE_OF_PATH:
            for _ in generate_stream(
                models[path], prompt, new_tokens, top_k=top_k, generator=generator, decode=DECODE_OF_PATH[path]
            ):
                pass
        elif path == "native_read":
            read_every_weight([NativeStep.for_model(models[path], torch.float32).matrices], new_tokens)
        elif path in READ_PATHS:
            read_every_weight(step_weights(models[path]), new_tokens)
        elif path == "hf":
            models["hf"].generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                top_k=top_k,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        else:  # auto: the documented call with no decode argument
            generate(models[path], prompt, new_tokens, top_k=top_k, generator=generator)


def step_weights(model: GPT) -> list[torch.Tensor]:
    """The matrices a decoding step reads whole: the blocks' and the (tied) head's, not a learned position table (a
    step reads one row of it). Biases and norm weights are left out: they are ~0.1% of GPT-2's bytes, and a sum over
    each would time its own dispatch (some 100 calls a token), not its bytes."""
    position_table = model.transformer.wpe.weight if model.config.pos_encoding == "learned" else None
    return [p for p in model.parameters() if p.dim() == 2 and p is not position_table]


def read_every_weight(weights: list[torch.Tensor], passes: int) -> None:
    """`passes` times, one sum over each of `weights`: a step's weight reads with nothing else."""
    for _ in range(passes):
        for weight in weights:
            torch.sum(weight)


class SkippedProduct(torch.nn.Module):
    """Stands in for a Linear in the no_products path: an output of the right shape, no weight read."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros((*x.shape[:-1], self.out_features))


def without_products(model: GPT) -> GPT:
    """`model` (in place) with every nn.Linear replaced by a SkippedProduct."""
    return replace_linears(model, SkippedProduct)


def sample_models(config: GPTConfig, paths: list[str], device: torch.device) -> dict:
    """One model per path, all with the same (random) weights; "plain" is never changed by the fast path."""
    torch.manual_seed(0)
    plain = GPT(config).eval().to(device)  # the weights as nanoGPT stores them, for the uncached path (never changed)
    models = {"plain": plain}
    for path, dtype in (
        ("auto", torch.float32),
        ("eager", torch.float32),
        ("onednn", torch.float32),
        ("eager_bf16", torch.bfloat16),
        ("compiled", torch.float32),
        ("compiled_bf16", torch.bfloat16),
        ("native", torch.float32),
        ("native_bf16", torch.bfloat16),
        ("weights_read", torch.float32),
        ("weights_read_bf16", torch.bfloat16),
    ):
        if path in paths:  # copies: a second random initialisation of GPT-2 124M would take seconds
            models[path] = copy.deepcopy(plain).to(device, dtype)
    if "native_read" in paths:  # the native path's own model when it runs too: one packed buffer, read by both
        models["native_read"] = models["native"] if "native" in models else copy.deepcopy(plain).to(device)
    if {"int8", "int8_compiled", "native_int8"} & set(paths):  # one int8 model: each path uses its own kernels
        int8 = quantize_int8(copy.deepcopy(plain))  # a UserError off the CPU
        models["int8"] = models["int8_compiled"] = models["native_int8"] = int8
    if "native_int4" in paths:
        models["native_int4"] = quantize_int4(copy.deepcopy(plain))
    if "no_products" in paths:
        models["no_products"] = without_products(copy.deepcopy(plain))
    if "onednn" in models and device.type == "cpu":
        optimize_for_cpu_decoding(models["onednn"])  # oneDNN at every batch, whatever auto would pick
    if "hf" in paths and config.pos_encoding != "rope":
        import transformers

        hf_config = transformers.GPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.block_size,
            n_embd=config.n_embd,
            n_layer=config.n_layer,
            n_head=config.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        models["hf"] = transformers.GPT2LMHeadModel(hf_config).eval().to(device)
        models["hf"].load_state_dict(hf_state_from(plain), strict=False)
    elif "hf" in paths:  # the Llama family
        models["hf"] = hf_model_of(plain)
    return models


def hf_model_of(model: GPT):
    """The transformers class that computes `model` exactly (gptkit.weights.hf.write_hf: Llama, Qwen2/3,
    NanoChat), with its weights; UserError for a model no class holds."""
    import tempfile

    import transformers

    with tempfile.TemporaryDirectory() as directory:
        try:
            write_hf(model, directory)
        except UserError as error:
            raise UserError(f"--paths=hf: {error}") from None
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def step_matrix_shapes(config: GPTConfig) -> list[tuple[int, int]]:
    """The (out, in) shapes of the matrices a decoding step multiplies, each as often as a step does."""
    C, Q, K, F = config.n_embd, config.n_head * config.head_dim, config.n_kv_head * config.head_dim, config.mlp_hidden
    fc = 2 * F if config.activation == "swiglu" else F
    return [(Q + 2 * K, C), (C, Q), (fc, C), (C, F)] * config.n_layer + [(config.vocab_size, C)]


def matmul_flop_s(config: GPTConfig, batch: int, repeats: int = 50) -> float:
    """FLOP/s of float32 products of `batch` rows by each of a step's matrix shapes with the weights in the caches:
    the machine's compute rate for the step's shapes, without its memory's. Each shape's weight is cut to ~1 MB of
    rows (in L2) and timed product by product, the fastest of `repeats` (on a loaded machine a product whose thread
    was descheduled waits a whole time slice); the rate is the step's FLOPs over the sum of its shapes' times, so a
    shape counts as often as the step multiplies it. Measured on one thread and multiplied by torch's threads (one a
    core): the cores' own rate, an upper bound, where the threaded library's small products paid for waking its
    threads (one-row products after eight-row ones took milliseconds each on a shared 2-core Xeon)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return threads * one_thread_flop_s(config, batch, repeats)
    finally:
        torch.set_num_threads(threads)


def one_thread_flop_s(config: GPTConfig, batch: int, repeats: int) -> float:
    """matmul_flop_s's measure on the current thread alone."""
    total_seconds = total_flops = 0.0
    for (out_features, in_features), count in Counter(step_matrix_shapes(config)).items():
        rows = min(out_features, max(16, 2**18 // in_features))
        weight, x = torch.randn(rows, in_features), torch.randn(batch, in_features)
        best = float("inf")
        for attempt in range(repeats + 1):  # the first one warms up
            start = time.perf_counter()
            F.linear(x, weight)  # as the model multiplies (torch.mm of one row by a transposed weight is far slower)
            if attempt:
                best = min(best, time.perf_counter() - start)
        total_seconds += best * out_features / rows * count
        total_flops += 2 * batch * out_features * in_features * count
    return total_flops / total_seconds


def roofline(batch: int, weight_bytes: int, read_gb_s: float, compute_s: float) -> float:
    """Tokens/s of steps of `batch` rows that take the longer of reading weight_bytes at read_gb_s and compute_s."""
    return batch / max(weight_bytes / (read_gb_s * 1e9), compute_s)


def add_roofline(rows: list[dict], models: dict, flop_s: dict[int, float]) -> None:
    """The roofline of a step of `batch` rows: the longer of reading every weight once (weight bytes of the path
    over the read speed) and multiplying them with every row (2 x batch x weights FLOPs over flop_s[batch], the
    measured matmul rate for the step's shapes); bound_tokens_per_s = batch / that time, bound_by says which leg.

    Each run of a row is set against the read speed measured around it (see time_paths): of_bound is the median of
    the runs' fractions of their own bound; bound_tokens_per_s is the bound at the median of those read speeds.
    With a no_products row in the run, each batch-1 row also gets the time its matrix products take (its time per
    token less no_products') and the speed they stream the weights at in the step: where the rest of the step goes.
    """
    weights = models["plain"].get_num_params(non_embedding=True)  # the blocks and the head; lookups read a row
    rest = next((1 / r["tokens_per_s"] for r in rows if r["path"] == "no_products" and r["batch"] == 1), None)
    for row in rows:
        batch = row["batch"]
        reads = row["path"] in READ_PATHS and batch > 1  # one read a "token" at any batch: no step to bound
        if row["path"] in ("uncached", "no_products") or reads or not row.get("read_gb_s"):
            continue
        weight_bytes = weights * WEIGHT_BYTES.get(row["path"], 4)
        compute_s = 2 * batch * weights / flop_s[batch]
        fractions = [
            row["new_tokens"] * batch / run["seconds"] / roofline(batch, weight_bytes, run["read_gb_s"], compute_s)
            for run in row["runs"]
        ]
        row["matmul_gflop_s"] = round(flop_s[batch] / 1e9, 1)
        row["bound_by"] = "memory" if weight_bytes / (row["read_gb_s"] * 1e9) >= compute_s else "compute"
        row["bound_tokens_per_s"] = round(roofline(batch, weight_bytes, row["read_gb_s"], compute_s), 1)
        row["of_bound"] = round(statistics.median(fractions), 3)
        # no_products is the eager step: its rest says nothing of the compiled or native step, which fuse that
        # work, nor of auto (the native step where it is built); a read path has no products
        fused_or_none = row["path"] in ("auto", *COMPILED_PATHS, *NATIVE_PATHS, *READ_PATHS)
        products = 1 / row["tokens_per_s"] - rest if rest is not None and not fused_or_none and batch == 1 else 0
        if products > 0:
            row["products_ms"] = round(products * 1e3, 2)
            row["products_gb_s"] = round(weight_bytes / products / 1e9, 1)


def bench_sample(cfg: SampleBench, config: GPTConfig | None = None) -> list[dict]:
    """Tokens/s of each generation path at each batch size; `config`: the model's shape (else --model's)."""
    unknown = sorted(set(cfg.paths) - set(SAMPLE_PATHS))
    if unknown:
        raise UserError(f"unknown --paths {unknown}; use {', '.join(SAMPLE_PATHS)}")
    device = resolve_device(cfg.device)
    config = config or GPTConfig(**MODEL_SHAPES[cfg.model])  # random weights
    models = sample_models(config, cfg.paths, device)
    rows, flop_s = [], {}
    for batch in cfg.batch_sizes:
        prompt = torch.randint(0, config.vocab_size, (batch, cfg.prompt_tokens), device=device)
        runs = {
            path: (
                partial(run_sample_path, path, models, prompt, cfg.top_k),
                cfg.uncached_new_tokens if path == "uncached" else cfg.new_tokens,
                cfg.uncached_repeats if path == "uncached" else cfg.repeats,
            )
            for path in cfg.paths
        }
        # the roofline's legs (see add_roofline): the read speed around each run, the matmul rate once per batch
        measure = partial(read_bandwidth, device, cfg.bandwidth_mb) if cfg.bandwidth_mb else None
        if measure is not None and device.type == "cpu":
            flop_s[batch] = matmul_flop_s(config, batch)
        for path, timed in time_paths(runs, measure).items():
            new_tokens, seconds = runs[path][1], statistics.median(run[0] for run in timed)
            row = {
                "path": path,
                "batch": batch,
                "new_tokens": new_tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(batch * new_tokens / seconds, 1),
            }
            if measure is not None:
                row["read_gb_s"] = round(statistics.median(run[1] for run in timed) / 1e9, 2)
                row["runs"] = [{"seconds": round(s, 6), "read_gb_s": round(speed / 1e9, 2)} for s, speed in timed]
            rows.append(row)
        if measure is not None:
            print_read_speeds([row for row in rows if row["batch"] == batch], cfg.bandwidth_mb)
    by_key = {(r["path"], r["batch"]): r["tokens_per_s"] for r in rows}
    for row in rows:
        for reference in ("hf", "uncached", "auto"):  # a read path generates nothing: no speed-up to show
            if (reference, row["batch"]) in by_key and row["path"] not in (reference, *READ_PATHS):
                row[f"x_{reference}"] = round(row["tokens_per_s"] / by_key[(reference, row["batch"])], 2)
    if flop_s:
        add_roofline(rows, models, flop_s)
    print_table(
        rows,
        [
            "path",
            "batch",
            "new_tokens",
            "seconds",
            "tokens_per_s",
            "x_hf",
            "x_uncached",
            "x_auto",
            "read_gb_s",
            "matmul_gflop_s",
            "bound_by",
            "bound_tokens_per_s",
            "of_bound",
            "products_ms",
            "products_gb_s",
        ],
    )
    return rows


def print_read_speeds(rows: list[dict], megabytes: int) -> None:
    """The read speed the batch-1 runs were set against: the median of all of them, and their range."""
    speeds = [run["read_gb_s"] for row in rows if "runs" in row for run in row["runs"]]
    print(
        f"memory read speed: {statistics.median(speeds):.3f} GB/s (median over the {len(speeds)} runs of the "
        f"mean of a measure before and after each, every measure the best of 5 sums of {megabytes} MB; "
        f"{min(speeds):.1f}-{max(speeds):.1f})"
    )


@dataclass(kw_only=True)
class LinearBench:
    batch_sizes: list[int] = setting_list([1, 8], "rows per product: sequences decoded at once (repeat the flag)")
    repeats: int = setting(5, "passes over every weight copy; the median pass is reported")
    weight_mb: int = setting(256, "megabytes of copies of each matrix per pass: more than the CPU caches hold")
    threads: int = setting(0, "torch threads (0 = torch's default)")
    weights: list[str] = setting_list([], "which of GPT-2's decoding weights (repeat the flag; none = all of them)")
    compiled: bool = setting(False, "also inductor's kernels (torch.compile, max-autotune, frozen weights): slow")
    bandwidth_mb: int = setting(1024, "megabytes read to measure the memory read speed (0 = skip it)")
    json_out: str = setting("bench_results/linear.json", "where to write the JSON results ('' = nowhere)")


# The weight matrices (out, in) that decoding GPT-2 124M multiplies, once per layer or once per token.
GPT2_DECODING_WEIGHTS = {
    "attn.c_attn": (2304, 768),
    "attn.c_proj": (768, 768),
    "mlp.c_fc": (3072, 768),
    "mlp.c_proj": (768, 3072),
    "lm_head": (50257, 768),
}


def median_pass_seconds(layers: list[torch.nn.Module], batch: int, in_features: int, repeats: int) -> float:
    """Median seconds per layer of `repeats` passes over every layer (after one pass that warms up)."""
    x = torch.randn(batch, 1, in_features)
    passes = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for layer in layers:
                layer(x)
            passes.append((time.perf_counter() - start) / len(layers))
    return statistics.median(passes[1:])


class ProductsOfCopies(torch.nn.ModuleList):
    """Every layer's product with the same input, as one graph: torch.compile streams all the copies' weights."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [layer(x) for layer in self]


def compiled_products(layers: list[torch.nn.Module], x: torch.Tensor) -> Callable:
    """ProductsOfCopies(layers) compiled as gptkit.infer.compiled compiles a step (frozen weights), built on x."""
    recompiles = torch._dynamo.config.patch(recompile_limit=64)  # each call's graph recompiles the one forward
    with torch._inductor.config.patch(freezing=True), recompiles, torch.inference_mode():
        compiled = torch.compile(ProductsOfCopies(layers), fullgraph=True, options=CPU_COMPILE_OPTIONS)
        compiled(x)  # compiles (and autotunes) now, not in a timed pass
    return compiled


def compiled_gb_s(layers: list[torch.nn.Module], batch: int, weight_bytes: int, repeats: int) -> float:
    """GB/s of weight bytes (`weight_bytes` per layer) that compiled_products(layers) streams at `batch` rows."""
    in_features = layers[0].in_features
    compiled = compiled_products(layers, torch.randn(batch, 1, in_features))
    return round(weight_bytes * len(layers) / median_pass_seconds([compiled], batch, in_features, repeats) / 1e9, 1)


def bench_linear(cfg: LinearBench) -> list[dict]:
    """Weight-streaming GB/s of a decoding step's products on CPU: float32 F.linear on the weights as stored and
    transposed, gptkit.infer.onednn's DecodingLinear, inductor's kernels (`compiled`), gptkit.weights.quantization's int8
    Linear, eager and compiled (of its int8 bytes); the fastest float32 one over the read speed of the same run."""
    unknown = sorted(set(cfg.weights) - set(GPT2_DECODING_WEIGHTS))
    if unknown:
        raise UserError(f"unknown --weights {unknown}; use {', '.join(GPT2_DECODING_WEIGHTS)}")
    torch.manual_seed(0)
    onednn = onednn_linear_available()
    bandwidth = read_bandwidth(torch.device("cpu"), cfg.bandwidth_mb) if cfg.bandwidth_mb else None
    if bandwidth:
        print(f"memory read speed: {bandwidth / 1e9:.3f} GB/s (best of 5 sums of {cfg.bandwidth_mb} MB)")
    rows = []
    for name, (out_features, in_features) in GPT2_DECODING_WEIGHTS.items():
        if cfg.weights and name not in cfg.weights:
            continue
        nbytes = out_features * in_features * 4
        copies = max(2, -(-cfg.weight_mb * 2**20 // nbytes))  # weights come from memory, not from a cache
        layers = [torch.nn.Linear(in_features, out_features) for _ in range(copies)]
        by_batch = {b: {"weight": name, "shape": f"{out_features}x{in_features}", "batch": b} for b in cfg.batch_sizes}
        int8_layers = list(quantize_int8(copy.deepcopy(torch.nn.Sequential(*layers))))  # before the layout changes
        int8 = {b: median_pass_seconds(int8_layers, b, in_features, cfg.repeats) for b in cfg.batch_sizes}
        for batch, row in by_batch.items():  # on the weights as stored (freezing prepacks its own copy)
            row["compiled"] = compiled_gb_s(layers, batch, nbytes, cfg.repeats) if cfg.compiled else None
            row["int8_compiled"] = compiled_gb_s(int8_layers, batch, nbytes // 4, cfg.repeats) if cfg.compiled else None
        del int8_layers
        # Variants in this order, each over every batch size: each step changes the layers for good.
        for variant in ("F.linear", "transposed", "optimized"):
            if variant == "optimized" and not onednn:
                for row in by_batch.values():
                    row[variant] = None  # this build or CPU has no direct oneDNN path: same as "transposed"
                continue
            if variant != "F.linear":  # what optimize_for_cpu_decoding does to each Linear
                for layer in layers:
                    use_decoding_layout(layer, onednn=variant == "optimized")
            for batch, row in by_batch.items():
                row[variant] = round(nbytes / median_pass_seconds(layers, batch, in_features, cfg.repeats) / 1e9, 1)
        for batch, row in by_batch.items():
            row["int8"] = round(nbytes / 4 / int8[batch] / 1e9, 1)  # an int8 weight is a quarter of float32's bytes
            fastest = max(row[v] or 0 for v in ("F.linear", "transposed", "optimized", "compiled"))
            row["float32_of_read"] = round(fastest * 1e9 / bandwidth, 3) if bandwidth else None
        rows.extend(by_batch.values())
        print_table(rows[-len(by_batch) :], list(rows[-1]))
    return rows


def hf_state_from(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face GPT-2 names (Conv1D weights transposed), so both run the same model."""
    from gptkit.weights.hf import CONV1D_WEIGHTS

    return {k: (v.t() if k.endswith(CONV1D_WEIGHTS) else v) for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------- training
@dataclass(kw_only=True)
class TrainBench:
    config: str = setting("config/train_shakespeare_char_cpu.py", "training recipe to measure")
    iters: int = setting(30, "training iterations per run (the first few are warm-up)")
    runs: int = setting(1, "runs; the median is reported")
    extra: list[str] = setting_list([], "extra --key=value flags for train.py (repeat the flag)")
    work_dir: str = setting("bench_results", "where each run's out_dir goes")
    json_out: str = setting("bench_results/train.json", "where to write the JSON results ('' = nowhere)")


def timed_command(command: list[str], cwd: str | None = None) -> tuple[float, subprocess.CompletedProcess]:
    """Run `command` with its output captured; return (wall seconds of the whole command, its result). Every
    wall time this benchmark reports, ours and nanoGPT's, is measured here, the same way."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - start, result


def last_error_line(result: subprocess.CompletedProcess) -> str:
    return (result.stderr.strip().splitlines() or ["no output"])[-1]


def run_train(args: list[str], out_dir: str) -> tuple[float, dict]:
    """Run train.py with args into out_dir, a work directory of the benchmark's own (a run there replaces the
    previous benchmark's); return (wall seconds of the whole command, its summary.json)."""
    train_py = str(Path(__file__).resolve().parent.parent / "train.py")
    seconds, result = timed_command([sys.executable, train_py, *args, f"--out_dir={out_dir}", "--overwrite=True"])
    if result.returncode != 0:
        raise UserError(f"train.py {' '.join(args)} failed: {last_error_line(result)}")
    return seconds, json.loads((Path(out_dir) / "summary.json").read_text())


def bench_train(cfg: TrainBench) -> list[dict]:
    rows = []
    for run in range(cfg.runs):
        args = [
            cfg.config,
            f"--max_iters={cfg.iters}",
            "--eval_interval=1000000",
            "--eval_iters=1",
            "--always_save_checkpoint=False",
            "--eval_full_split=False",
            *cfg.extra,
        ]
        seconds, summary = run_train(args, str(Path(cfg.work_dir) / f"train_run{run}"))
        rows.append(
            {
                "config": cfg.config,
                "run": run,
                "wall_s": round(seconds, 1),
                "train_s": summary["train_seconds"],
                "tokens_per_s": summary["tokens_per_s"],
            }
        )
    print_table(rows, list(rows[0]))
    return rows


# ----------------------------------------------------------------------------------------- time to quality
@dataclass(kw_only=True)
class QualityBench:
    config: list[str] = setting_list(["config/train_shakespeare_char_cpu.py"], "recipes to run (repeat the flag)")
    runs: int = setting(3, "runs per recipe; medians are reported")
    extra: list[str] = setting_list([], "extra --key=value flags for every run")
    nanogpt_dir: str = setting(
        "",
        "a karpathy/nanoGPT checkout with data/shakespeare_char prepared (its prepare.py): "
        "its CPU recipe runs once first, and each recipe's time is also given as a fraction of "
        "its time ('' = no reference run)",
    )
    work_dir: str = setting("bench_results", "where each run's out_dir goes")
    json_out: str = setting("bench_results/quality.json", "where to write the JSON results ('' = nowhere)")


# nanoGPT's CPU recipe, as its README gives it for a laptop: 4 layers x 128, 64-character windows, 2000 AdamW steps.
NANOGPT_CPU_RECIPE = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]


def run_nanogpt(directory: str) -> dict:
    """Wall seconds of nanoGPT's CPU recipe in `directory` (its own train.py) and its last printed val loss
    (nanoGPT's 20-batch estimate; its whole-split loss, 1.898, is documented in docs/benchmarks.md)."""
    if not (Path(directory) / "train.py").is_file():
        raise UserError(f"no train.py in --nanogpt_dir={directory}; give a checkout of karpathy/nanoGPT")
    seconds, result = timed_command([sys.executable, "train.py", *NANOGPT_CPU_RECIPE], cwd=directory)
    losses = re.findall(r"^step \d+: train loss [\d.]+, val loss ([\d.]+)", result.stdout, re.MULTILINE)
    if result.returncode != 0 or not losses:
        raise UserError(f"nanoGPT's train.py in {directory} failed ({last_error_line(result)}); prepare its data first")
    print(f"nanoGPT CPU recipe: {seconds:.1f} s wall, val loss (its 20-batch estimate) {losses[-1]}")
    return {
        "config": "nanoGPT " + " ".join(NANOGPT_CPU_RECIPE),
        "runs": 1,
        "median_wall_s": round(seconds, 1),
        "val_loss_estimate": float(losses[-1]),
    }


def bench_quality(cfg: QualityBench) -> list[dict]:
    """Whole-command wall time and the final whole-val-split loss of each recipe (train.py --eval_full_split).
    The recipes take turns (run 0 of each, then run 1 of each...), so a change in the machine's load falls on all."""
    reference = run_nanogpt(cfg.nanogpt_dir) if cfg.nanogpt_dir else None
    runs = {config: [] for config in cfg.config}
    for run in range(cfg.runs):
        for config in cfg.config:
            out_dir = str(Path(cfg.work_dir) / f"quality_{Path(config).stem}_{run}")
            seconds, summary = run_train([config, "--eval_full_split=True", *cfg.extra], out_dir)
            runs[config].append(
                {
                    "wall_s": round(seconds, 1),
                    "val_loss_full": summary["val_loss_full"],
                    "train_s": summary["train_seconds"],
                    "ms_per_step": round(1e3 * summary["train_seconds"] / max(summary["iters"], 1), 1),
                }
            )
            print(f"{config} run {run}: {seconds:.1f} s wall, full val loss {summary['val_loss_full']:.4f}")
    rows = [
        {
            "config": config,
            "extra": " ".join(cfg.extra),
            "runs": cfg.runs,
            "median_wall_s": round(statistics.median(r["wall_s"] for r in config_runs), 1),
            "median_ms_per_step": round(statistics.median(r["ms_per_step"] for r in config_runs), 1),
            "median_val_loss_full": round(statistics.median(r["val_loss_full"] for r in config_runs), 4),
            "all": config_runs,
        }
        for config, config_runs in runs.items()
    ]
    if reference:
        for row in rows:
            row["x_nanogpt_time"] = round(row["median_wall_s"] / reference["median_wall_s"], 3)
        rows.insert(0, reference)
    print_table(
        rows,
        [
            "config",
            "extra",
            "runs",
            "median_wall_s",
            "median_ms_per_step",
            "median_val_loss_full",
            "val_loss_estimate",
            "x_nanogpt_time",
        ],
    )
    return rows


COMMANDS = {
    "sample": (SampleBench, bench_sample),
    "linear": (LinearBench, bench_linear),
    "train": (TrainBench, bench_train),
    "quality": (QualityBench, bench_quality),
}
SUMMARIES = {
    "sample": "tokens/s of each decoding path at each batch size",
    "linear": "weight-streaming GB/s of a decoding step's products on the CPU",
    "train": "training tokens/s and wall time of a recipe",
    "quality": "wall time and final validation loss of whole training recipes",
}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("--help", "-h"):
        print(f"usage: python benchmarks/bench.py {{{','.join(COMMANDS)}}} [--key=value ...]\n")
        for name, summary in SUMMARIES.items():
            print(f"  {name:8} {summary}")
        print("\n`python benchmarks/bench.py NAME --help` lists a benchmark's settings.")
        return 0
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"name a benchmark first: python bench.py {{{','.join(COMMANDS)}}} [--key=value ...]")
    settings_class, function = COMMANDS[argv[0]]
    cfg = parse_settings(settings_class, argv[1:], prog=f"bench.py {argv[0]}", description=function.__doc__ or "")
    if getattr(cfg, "threads", 0):  # sample and linear: before anything runs
        torch.set_num_threads(cfg.threads)
    return run_benchmark(cfg, function, argv[0])


if __name__ == "__main__":
    run_cli(main)
