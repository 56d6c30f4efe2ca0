"""Our sampling against llama.cpp on the same GGUF files: float32, 8-bit and 4-bit, batch 1 and several rows, in one
run, on the same threads.

    python benchmarks/bench_llamacpp.py [--shapes=smollm2-135m --shapes=gpt2-124m --batch_sizes=1 --batch_sizes=8]

For each shape a model with random weights is written by export.py's GGUF writer as f32, q8_0, q4_0 and q4_1 (and
by llama.cpp's quantizer from the f32 file as q4_k_m), and each file is decoded by llama-cpp-python (built from
source, as the slow tests use it). The paths, each generating
new_tokens after the same prompt in every row, with top-k sampling:
  ours_f32: gptkit.infer.generate with no decode argument on the float32 model (sample.py with no flag)
  ours_int8: the same on the model quantize_int8 made (sample.py --quantize=int8)
  ours_q4_0: the same on the model read from the q4_0 file as sample.py --init_from=FILE.gguf reads it: its own
    blocks left in the file, its head in its own q8_0 blocks (the file's precision, the bytes llama.cpp reads)
  ours_int4: the same as sample.py --init_from=FILE.gguf --quantize=int4 reads it: its own blocks, and its head
    (q8_0) quantized to 4 bits
  ours_q4_1: the q4_1 file read as sample.py --init_from=FILE.gguf reads it (with --quantize none or int4 alike):
    its own blocks, with their minimums, left in the file, its head in its own q8_0 blocks
  ours_q8_0: the q8_0 file read as sample.py --init_from=FILE.gguf reads it: its own blocks left in the file
  ours_q4_k_m: the q4_k_m file (llama.cpp's quantizer's, from the f32 file: most matrices Q4_K, some Q6_K) as
    sample.py --init_from=FILE.gguf --quantize=int4 reads it: the Q4_K matrices' own codes, the others quantized
  llamacpp_f32, llamacpp_q8_0, llamacpp_q4_0, llamacpp_q4_1, llamacpp_q4_k_m: llama.cpp on the f32, q8_0, q4_0, q4_1
    and q4_k_m files, every row a sequence of one batch, each sampled by its own top-k sampler
Repeats go round-robin over the paths (measure.time_paths), so load from other work slows every path alike.
tokens_per_s counts the whole run (the prompts' prefill included); generation_tokens_per_s the tokens after each
row's first, over the run's seconds less those of a run to the first token alone (taken in the same round), as
llama.cpp's own benchmark reports text generation apart from prompt processing. read_gb_s: the memory's read speed
around the path's runs (measure.read_bandwidth before and after each; --bandwidth_mb=0 skips it), since a shared
machine's can jump between two levels within minutes.
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
from gptkit.weights import load
from gptkit.weights.export_gguf import export_gguf
from gptkit.weights.quantization import apply_quantization, quantize_int8
from measure import MODEL_SHAPES, print_table, read_bandwidth, run_benchmark, time_paths

SHAPES = {name: MODEL_SHAPES[name] for name in ("smollm2-135m", "gpt2-124m", "smollm2-1.7b")}  # llama.cpp holds
PATHS = ("ours_f32", "ours_int8", "ours_int4", "ours_q4_0", "ours_q4_1", "ours_q8_0", "ours_q4_k_m")
PATHS += ("llamacpp_f32", "llamacpp_q8_0", "llamacpp_q4_0", "llamacpp_q4_1", "llamacpp_q4_k_m")
FILE_OF = {
    "ours_int4": "q4_0",
    "ours_q4_0": "q4_0",
    "ours_q4_1": "q4_1",
    "ours_q8_0": "q8_0",
    "llamacpp_f32": "f32",
    "llamacpp_q8_0": "q8_0",
    "llamacpp_q4_0": "q4_0",
    "llamacpp_q4_1": "q4_1",
    "ours_q4_k_m": "q4_k_m",
    "llamacpp_q4_k_m": "q4_k_m",
}
AGAINST = {
    "ours_f32": "llamacpp_f32",
    "ours_int8": "llamacpp_q8_0",
    "ours_int4": "llamacpp_q4_0",
    "ours_q4_0": "llamacpp_q4_0",
    "ours_q4_1": "llamacpp_q4_1",
    "ours_q8_0": "llamacpp_q8_0",
    "ours_q4_k_m": "llamacpp_q4_k_m",
}
GGUF_QUANTIZE = {
    "ours_int4": "int4",
    "ours_q4_0": "none",
    "ours_q4_1": "none",
    "ours_q8_0": "none",
    "ours_q4_k_m": "int4",
}  # our paths on a file: its --quantize
QUANTIZED_BY_LLAMACPP = {"q4_k_m": 15}  # files llama.cpp's quantizer writes from the f32 file: llama.h's ftype


@dataclass(kw_only=True)
class LlamaCppBench:
    shapes: list[str] = setting_list(["smollm2-135m", "gpt2-124m"], f"model shapes: {', '.join(SHAPES)}")
    paths: list[str] = setting_list(list(PATHS), f"which decoders: {', '.join(PATHS)}")
    batch_sizes: list[int] = setting_list([1, 8], "rows decoded at once (each its own prompt and sampler)")
    threads: int = setting(2, "threads for torch and for llama.cpp", rule="positive")
    prompt_tokens: int = setting(16, "prompt length")
    new_tokens: int = setting(128, "tokens generated per row and run")
    top_k: int = setting(200, "top-k sampling (temperature 1), for every path")
    repeats: int = setting(3, "runs per path; the median is reported")
    bandwidth_mb: int = setting(
        1024,
        "megabytes read to measure the memory's read speed around each run (0 = not measured)",
        rule="non_negative",
    )
    json_out: str = setting("bench_results/llamacpp.json", "where to write the JSON results ('' = nowhere)")


def byte_tokenizer() -> tok.BpeTokenizer:
    """A byte-level BPE of the 256 bytes and <|endoftext|>: the file needs a tokenizer; ids are what both decode."""
    ranks = {bytes([b]): b for b in range(256)}
    record = bpe.make_record("bytes", bpe.GPT4_PATTERN, {tok.END_OF_TEXT: 256}, bpe.ranks_to_text(ranks))
    return tok.BpeTokenizer(record)


class LlamaCppDecoder:
    """llama.cpp decoding `rows` sequences of one GGUF file at once through llama-cpp-python's C API: each row a
    sequence of one batch, sampled by its own top-k sampler (the high-level Llama class decodes one sequence)."""

    def __init__(self, path: Path, rows: int, positions: int, threads: int, top_k: int) -> None:
        import llama_cpp

        self.api = llama_cpp
        self.rows = rows
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = rows * positions
        params.n_batch = params.n_ubatch = rows * positions
        params.n_seq_max = rows
        params.n_threads = params.n_threads_batch = threads
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        self.batch = llama_cpp.llama_batch_init(rows * positions, 0, rows)
        self.samplers = [self.top_k_sampler(top_k, seed=row) for row in range(rows)]

    def top_k_sampler(self, top_k: int, seed: int):
        """The top_k most likely tokens, then a draw at temperature 1."""
        api = self.api
        chain = api.llama_sampler_chain_init(api.llama_sampler_chain_default_params())
        api.llama_sampler_chain_add(chain, api.llama_sampler_init_top_k(top_k))
        api.llama_sampler_chain_add(chain, api.llama_sampler_init_dist(seed))
        return chain

    def fill(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """The batch of (token, position, row, whether its logits are wanted)."""
        batch = self.batch
        batch.n_tokens = len(tokens)
        for i, (token, position, row, wanted) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, wanted
            batch.seq_id[i][0] = row

    def decode(self) -> None:
        if self.api.llama_decode(self.context, self.batch) != 0:
            raise RuntimeError("llama_decode failed")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        """new_tokens sampled tokens after each of the prompts (one a row): the prompts in one batch, then one batch
        a step with a token of every row."""
        api = self.api
        api.llama_memory_clear(api.llama_get_memory(self.context), True)
        length = len(prompts[0])
        self.fill([(t, p, row, p == length - 1) for row, ids in enumerate(prompts) for p, t in enumerate(ids)])
        self.decode()
        outputs = [row * length + length - 1 for row in range(len(prompts))]
        for step in range(new_tokens):
            tokens = [
                api.llama_sampler_sample(self.samplers[row], self.context, out) for row, out in enumerate(outputs)
            ]
            if step == new_tokens - 1:
                break
            self.fill([(token, length + step, row, True) for row, token in enumerate(tokens)])
            self.decode()
            outputs = list(range(len(prompts)))

    def close(self) -> None:
        api = self.api
        for sampler in self.samplers:
            api.llama_sampler_free(sampler)
        api.llama_batch_free(self.batch)
        api.llama_free(self.context)
        api.llama_model_free(self.model)


def run_ours(model: GPT, prompt: torch.Tensor, top_k: int, new_tokens: int) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        generate(model, prompt, new_tokens, top_k=top_k, generator=generator)


def write_files(model: GPT, shape: str, formats: set[str], directory: Path) -> dict[str, Path]:
    """The GGUF file of `model` in each of `formats`: f32, q8_0, q4_0 and q4_1 written by export.py's writer, q4_k_m
    by llama.cpp's quantizer from the f32 file."""
    files = {}
    written = formats - set(QUANTIZED_BY_LLAMACPP)
    if written != formats:
        written |= {"f32"}
    for outtype in sorted(written):
        out = directory / f"{shape}-{outtype}"
        out.mkdir()
        files[outtype] = out / export_gguf(model, byte_tokenizer(), out, outtype, shape)[0]
    for outtype in sorted(formats & set(QUANTIZED_BY_LLAMACPP)):
        files[outtype] = directory / f"{shape}-{outtype}.gguf"
        llama_cpp_quantize(files["f32"], files[outtype], QUANTIZED_BY_LLAMACPP[outtype])
    return files


def llama_cpp_quantize(source: Path, target: Path, file_type: int) -> None:
    """llama.cpp's quantizer (llama_model_quantize) writing `source` as `file_type` (llama.h's LLAMA_FTYPE_*)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = file_type
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {target.name}")


def our_models(model: GPT, paths: list[str], files: dict[str, Path]) -> dict[str, GPT]:
    """The model each of our paths decodes. Without ours_f32 the float32 model is quantized to int8 in place (a 1.7B
    shape's float32 copy is 6.8 GB)."""
    models = {}
    for path, quantize in GGUF_QUANTIZE.items():
        if path in paths:  # as sample.py reads it on the CPU: its Q4_0 or Q8_0 matrices left in the file
            loaded = load(str(files[FILE_OF[path]]), tokenizer=False, keep_int4=True)
            models[path] = apply_quantization(loaded.model.eval(), quantize)
    if "ours_f32" in paths:
        models["ours_f32"] = model
    if "ours_int8" in paths:
        models["ours_int8"] = quantize_int8(copy.deepcopy(model) if "ours_f32" in paths else model)
    return models


def bench_shape(cfg: LlamaCppBench, shape: str, directory: Path) -> list[dict]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPES[shape])).eval().requires_grad_(False)
    files = write_files(model, shape, {FILE_OF[path] for path in cfg.paths if path in FILE_OF}, directory)
    models = our_models(model, cfg.paths, files)
    del model
    positions = cfg.prompt_tokens + cfg.new_tokens + 8
    rows = []
    # the memory's read speed around each run (the module's docstring says why)
    measure = partial(read_bandwidth, torch.device("cpu"), cfg.bandwidth_mb) if cfg.bandwidth_mb else None
    for batch in cfg.batch_sizes:
        prompt = torch.randint(0, 256, (batch, cfg.prompt_tokens), generator=torch.Generator().manual_seed(1))
        decoders = {
            path: LlamaCppDecoder(files[FILE_OF[path]], batch, positions, cfg.threads, cfg.top_k)
            for path in cfg.paths
            if path.startswith("llamacpp")
        }
        runs = {}
        for path in cfg.paths:
            if path in models:
                generate_tokens = partial(run_ours, models[path], prompt, cfg.top_k)
            else:
                generate_tokens = partial(decoders[path].generate, prompt.tolist())
            runs[path] = (generate_tokens, cfg.new_tokens, cfg.repeats)
            runs[f"{path} to the first token"] = (generate_tokens, 1, cfg.repeats)
        timed = time_paths(runs, measure)
        for path in cfg.paths:
            whole = [run[0] for run in timed[path]]
            first = [run[0] for run in timed[f"{path} to the first token"]]
            seconds = statistics.median(whole)
            generation = statistics.median(w - f for w, f in zip(whole, first))  # each round's own difference
            rows.append(
                {
                    "shape": shape,
                    "path": path,
                    "batch": batch,
                    "new_tokens": cfg.new_tokens,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(batch * cfg.new_tokens / seconds, 1),
                    "generation_seconds": round(generation, 4),
                    "generation_tokens_per_s": round(batch * (cfg.new_tokens - 1) / generation, 1),
                    "all_seconds": [round(s, 3) for s in whole],
                    "first_token_seconds": [round(s, 3) for s in first],
                }
            )
            if measure is not None:
                speeds = [run[1] / 1e9 for run in timed[path]]
                rows[-1]["read_gb_s"] = round(statistics.median(speeds), 1)
                rows[-1]["all_read_gb_s"] = [round(speed, 1) for speed in speeds]
        for decoder in decoders.values():
            decoder.close()
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """x_llamacpp: each of our paths against llama.cpp on the same precision's file; x_int8: our paths on a GGUF file
    against int8; each of the whole runs' tokens/s, and with the suffix _generation of the generation's alone."""
    for measure, suffix in (("tokens_per_s", ""), ("generation_tokens_per_s", "_generation")):
        speed = {(row["batch"], row["path"]): row[measure] for row in rows}
        for row in rows:
            against = speed.get((row["batch"], AGAINST.get(row["path"], "")))
            if against:
                row[f"x_llamacpp{suffix}"] = round(row[measure] / against, 2)
            int8 = speed.get((row["batch"], "ours_int8"))
            if row["path"] in GGUF_QUANTIZE and int8:
                row[f"x_int8{suffix}"] = round(row[measure] / int8, 2)


def bench_llamacpp(cfg: LlamaCppBench) -> list[dict]:
    """Tokens/s of our sampling and llama.cpp's on the same GGUF files: float32, 8-bit and 4-bit."""
    for name, chosen, known in (("shapes", cfg.shapes, SHAPES), ("paths", cfg.paths, PATHS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            raise UserError(f"unknown --{name} {unknown}; use {', '.join(known)}")
    if any(size < 1 for size in cfg.batch_sizes):
        raise UserError(f"--batch_sizes {cfg.batch_sizes}: each must be at least 1")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise UserError("llama-cpp-python is not installed (pip install llama-cpp-python)") from exc
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for shape in cfg.shapes:
            rows += bench_shape(cfg, shape, Path(directory))
    columns = ["shape", "path", "batch", "new_tokens", "seconds", "tokens_per_s", "x_llamacpp", "x_int8"]
    columns += ["generation_tokens_per_s", "x_llamacpp_generation", "x_int8_generation", "read_gb_s"]
    print_table(rows, columns)
    return rows


def main(argv: list[str]) -> int:
    cfg = parse_settings(LlamaCppBench, argv, prog="bench_llamacpp.py", description=bench_llamacpp.__doc__ or "")
    torch.set_num_threads(cfg.threads)
    return run_benchmark(cfg, bench_llamacpp, "llamacpp")


if __name__ == "__main__":
    run_cli(main)
