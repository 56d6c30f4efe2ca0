"""Our sampling against llama.cpp on the same weights: batch 1, float32 and 8-bit, in one run, on the same threads.

    python benchmarks/bench_llamacpp.py [--shapes=smollm2-135m --shapes=gpt2-124m --threads=2 --new_tokens=128]

For each shape a model with random weights is written by export.py's GGUF writer as f32 and as q8_0 and loaded
by llama-cpp-python (built from source, as the slow tests use it). The paths, each generating new_tokens after the
same prompt with top-k sampling:
  ours_f32: gptkit.infer.generate with no decode argument on the float32 model (sample.py with no flag)
  ours_int8: the same on the model quantize_int8 made (sample.py --quantize=int8)
  llamacpp_f32, llamacpp_q8_0: llama-cpp-python's Llama.generate on the f32 and q8_0 files
Repeats go round-robin over the paths (measure.time_paths), so load from other work slows every path alike.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting, setting_list
from gptkit.data import bpe
from gptkit.data import tokenizer as tok
from gptkit.infer import generate
from gptkit.model import GPT, GPTConfig
from gptkit.weights.export_gguf import export_gguf
from gptkit.weights.quantization import quantize_int8
from measure import MODEL_SHAPES, print_table, run_benchmark, time_paths

SHAPES = {name: MODEL_SHAPES[name] for name in ("smollm2-135m", "gpt2-124m")}  # shapes llama.cpp holds
PATHS = ("ours_f32", "ours_int8", "llamacpp_f32", "llamacpp_q8_0")


@dataclass
class LlamaCppBench:
    shapes: list[str] = setting_list(list(SHAPES), f"model shapes: {', '.join(SHAPES)}")
    threads: int = setting(2, "threads for torch and for llama.cpp", rule="positive")
    prompt_tokens: int = setting(16, "prompt length")
    new_tokens: int = setting(128, "tokens generated per run")
    top_k: int = setting(200, "top-k sampling (temperature 1), for every path")
    repeats: int = setting(3, "runs per path; the median is reported")
    json_out: str = setting("bench_results/llamacpp.json", "where to write the JSON results ('' = nowhere)")


def byte_tokenizer() -> tok.BpeTokenizer:
    """A byte-level BPE of the 256 bytes and <|endoftext|>: the file needs a tokenizer; ids are what both decode."""
    ranks = {bytes([b]): b for b in range(256)}
    record = bpe.make_record("bytes", bpe.GPT4_PATTERN, {tok.END_OF_TEXT: 256}, bpe.ranks_to_text(ranks))
    return tok.BpeTokenizer(record)


def run_ours(model: GPT, prompt: torch.Tensor, top_k: int, new_tokens: int) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        generate(model, prompt, new_tokens, top_k=top_k, generator=generator)


def run_llama_cpp(llm, prompt: list[int], top_k: int, new_tokens: int) -> None:
    tokens = llm.generate(prompt, top_k=top_k, top_p=1.0, min_p=0.0, temp=1.0, repeat_penalty=1.0, reset=True)
    for count, _ in enumerate(tokens, start=1):
        if count == new_tokens:
            break


def bench_shape(cfg: LlamaCppBench, shape: str, directory: Path) -> list[dict]:
    import llama_cpp

    config = GPTConfig(**SHAPES[shape])
    torch.manual_seed(0)
    model = GPT(config).eval()
    files = {}
    for outtype in ("f32", "q8_0"):
        out = directory / f"{shape}-{outtype}"
        out.mkdir()
        files[outtype] = out / export_gguf(model, byte_tokenizer(), out, outtype, shape)[0]
    context = cfg.prompt_tokens + cfg.new_tokens + 8
    llms = {
        outtype: llama_cpp.Llama(
            model_path=str(path), n_ctx=context, n_threads=cfg.threads, n_threads_batch=cfg.threads, verbose=False
        )
        for outtype, path in files.items()
    }
    int8 = quantize_int8(copy.deepcopy(model))
    prompt = torch.randint(0, 256, (1, cfg.prompt_tokens), generator=torch.Generator().manual_seed(1))
    ids = prompt[0].tolist()
    runs = {
        "ours_f32": (partial(run_ours, model, prompt, cfg.top_k), cfg.new_tokens, cfg.repeats),
        "ours_int8": (partial(run_ours, int8, prompt, cfg.top_k), cfg.new_tokens, cfg.repeats),
        "llamacpp_f32": (partial(run_llama_cpp, llms["f32"], ids, cfg.top_k), cfg.new_tokens, cfg.repeats),
        "llamacpp_q8_0": (partial(run_llama_cpp, llms["q8_0"], ids, cfg.top_k), cfg.new_tokens, cfg.repeats),
    }
    rows = []
    for path, timed in time_paths(runs).items():
        seconds = statistics.median(run[0] for run in timed)
        rows.append(
            {
                "shape": shape,
                "path": path,
                "batch": 1,
                "new_tokens": cfg.new_tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(cfg.new_tokens / seconds, 1),
                "all_seconds": [round(run[0], 3) for run in timed],
            }
        )
    speed = {row["path"]: row["tokens_per_s"] for row in rows}
    for row in rows:
        reference = "llamacpp_q8_0" if row["path"] in ("ours_int8", "llamacpp_q8_0") else "llamacpp_f32"
        row["x_llamacpp"] = round(row["tokens_per_s"] / speed[reference], 2)
    return rows


def bench_llamacpp(cfg: LlamaCppBench) -> list[dict]:
    """Tokens/s at batch 1 of our sampling and llama.cpp's on the same weights, float32 and 8-bit."""
    unknown = sorted(set(cfg.shapes) - set(SHAPES))
    if unknown:
        raise UserError(f"unknown --shapes {unknown}; use {', '.join(SHAPES)}")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise UserError("llama-cpp-python is not installed (pip install llama-cpp-python)") from exc
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for shape in cfg.shapes:
            rows += bench_shape(cfg, shape, Path(directory))
    print_table(rows, ["shape", "path", "batch", "new_tokens", "seconds", "tokens_per_s", "x_llamacpp"])
    return rows


def main(argv: list[str]) -> int:
    cfg = parse_settings(LlamaCppBench, argv, prog="bench_llamacpp.py", description=bench_llamacpp.__doc__ or "")
    torch.set_num_threads(cfg.threads)
    return run_benchmark(cfg, bench_llamacpp, "llamacpp")


if __name__ == "__main__":
    run_cli(main)
